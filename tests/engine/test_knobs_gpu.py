"""The speed knobs on CUDA: real compile with zero graph breaks, Liger against eager (loss and gradients,
bf16 and fp32, interchangeable state dicts), the flash attention path, fused AdamW and auto's trial steps.
Every test skips cleanly without a GPU (and the Liger ones without liger_kernel)."""

import dataclasses
import importlib.util

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lm.engine.activation_checkpointing import cuda_trial_probe, free_device_memory, resolve
from lm.engine.module import LMModule
from lm.model import ModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_liger = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="needs liger_kernel: pip install -e '.[gpu]'"
)

CUDA = torch.device("cuda")
# Small, but with a real vocabulary padding (1000 -> 1024) and grouped-query attention.
SMALL = ModelConfig(vocab_size=1000, n_layer=2, d_model=128, n_head=4, n_kv_head=2, max_seq_len=128)


def pair(liger: bool, dtype: torch.dtype, model: ModelConfig = SMALL) -> tuple[LMModule, LMModule]:
    """An eager module and a second one (Liger or not) holding the same weights, on the GPU."""
    torch.manual_seed(0)
    eager = LMModule(model, {}).to(CUDA, dtype).train()
    other = LMModule(model, {}, liger=liger).to(CUDA, dtype).train()
    other.load_state_dict(eager.state_dict(), strict=True)  # same keys: checkpoints are interchangeable
    return eager, other


def loss_and_grads(module: LMModule, batch: torch.Tensor):
    module.zero_grad(set_to_none=True)
    loss = module.loss(batch)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in module.named_parameters()}


def assert_grads_close(a: dict, b: dict, rel: float) -> None:
    for name, g in a.items():
        err = (g - b[name]).norm() / g.norm().clamp_min(1e-12)
        assert err < rel, f"{name}: relative gradient error {err:.3g} >= {rel}"


def batch(size: int = 4, seq: int = 128) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab_size, (size, seq + 1), device=CUDA)


@needs_liger
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize(
    ("dtype", "loss_tol", "grad_rel"), [(torch.float32, 1e-4, 1e-3), (torch.bfloat16, 2e-2, 5e-2)]
)
def test_liger_matches_eager(dtype, loss_tol, grad_rel, qk_norm):
    """With QK-norm (recipe=modern) Liger's RMSNorm also serves the per-head q/k norms, on (B, H, T, E)."""
    eager, liger = pair(True, dtype, dataclasses.replace(SMALL, qk_norm=qk_norm))
    x = batch()
    loss_e, grads_e = loss_and_grads(eager, x)
    loss_l, grads_l = loss_and_grads(liger, x)
    assert abs(loss_e.item() - loss_l.item()) < loss_tol * max(1.0, loss_e.item())
    assert_grads_close(grads_e, grads_l, grad_rel)
    assert list(eager.state_dict()) == list(liger.state_dict())


@needs_liger
def test_liger_under_bf16_autocast_matches_eager():
    eager, liger = pair(True, torch.float32)
    x = batch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_e, grads_e = loss_and_grads(eager, x)
        loss_l, grads_l = loss_and_grads(liger, x)
    assert abs(loss_e.item() - loss_l.item()) < 2e-2 * loss_e.item()
    assert_grads_close(grads_e, grads_l, 5e-2)


def test_compile_fullgraph_has_no_graph_breaks_and_the_eager_loss():
    eager, compiled = pair(False, torch.float32)
    x = batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled.loss)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled.model.compile(fullgraph=True)  # fullgraph: any graph break is an error
    loss_e, grads_e = loss_and_grads(eager, x)
    loss_c, grads_c = loss_and_grads(compiled, x)
    assert abs(loss_e.item() - loss_c.item()) < 1e-3
    assert_grads_close(grads_e, grads_c, 1e-2)


@pytest.mark.parametrize("every", [0, 1])
def test_compile_with_bf16_autocast_and_checkpointing(every):
    torch.manual_seed(0)
    module = LMModule(SMALL, {}, ac_every=every).to(CUDA).train()
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(module.loss)(batch())
    assert explained.graph_break_count == 0, explained.break_reasons


def test_attention_takes_the_flash_kernel_in_bf16():
    torch.manual_seed(0)
    module = LMModule(SMALL, {}).to(CUDA).train()
    # With only the flash backend allowed, SDPA raises if the inputs are not eligible (mask, dtype, layout).
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = module.loss(batch())
    loss.backward()
    assert torch.isfinite(loss)


def test_adamw_is_fused_on_cuda():
    module = LMModule(SMALL, {}, total_steps=10).to(CUDA)
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True
    assert module.model.tok_emb.weight.shape[0] == 1024  # the vocabulary padded to a multiple of 64


def test_auto_measures_real_trial_steps():
    cfg = ModelConfig(vocab_size=32000, n_layer=4, d_model=512, n_head=8, max_seq_len=1024)
    before = torch.cuda.memory_allocated(CUDA)
    probe = cuda_trial_probe(
        cfg, batch_size=8, seq_len=1024, precision="bf16-mixed", liger=False, device=CUDA
    )
    peaks = {k: probe(k) for k in (0, 1)}
    assert all(p is not None and p > 0 for p in peaks.values())
    assert peaks[1] < peaks[0]  # checkpointing every block saves real memory
    # A budget just below "off" makes auto pick some checkpointing, measured, not guessed.
    decision = resolve(0, True, 4, probe=probe, budget_bytes=peaks[0] - 1, free_memory_reserve=0.0)
    assert decision.every > 0 and decision.trials[0].every == 0 and not decision.trials[0].fits
    # The trials leave no model, gradients or optimizer state behind on the device. cuBLAS keeps its
    # workspaces in the caching allocator (64 MiB on an H100), so the bound is half the fp32 weights.
    left = torch.cuda.memory_allocated(CUDA) - before
    weights = sum(p.numel() for p in LMModule(cfg, {}).parameters()) * 4
    assert left < weights / 2, f"{left / 2**20:.0f} MiB left on the device after the trials"


def test_free_memory_respects_the_process_memory_fraction():
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.get_per_process_memory_fraction(0)
    try:
        torch.cuda.set_per_process_memory_fraction(0.1, 0)
        assert free_device_memory(CUDA) <= 0.1 * total
    finally:
        torch.cuda.set_per_process_memory_fraction(before, 0)
