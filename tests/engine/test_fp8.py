"""precision=fp8 on a CPU: refused where it cannot run or pay; with torchao's emulation, the conversion, a run,
its checkpoints (bitwise resume, resumed without FP8) and the export. FP8's speed awaits a GPU (issue 26)."""

import shutil

import pytest
import torch
from torch import nn

from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.config import DataConfig, GpuConfig
from lm.engine import fp8
from lm.engine.module import LMModule
from lm.interop.hf import load_run, to_hf_model
from lm.model import ModelConfig
from lm.numbers import cost
from lm.run.train import main
from lm.store.bench_file import measured_mfu, write_bench
from lm.tools.sky import ASSUMED_MFU, rank_gpus

from ..checkpoint.test_resume import RUN, ckpt
from ..conftest import CONF
from ..conftest import train_in_process as train
from ..harness import assert_same

pytest.importorskip("torchao.float8")

EMULATED = ["precision.fp8=tensorwise", "precision.fp8_emulate=true"]
H100 = GpuConfig(name="h100_sxm", peak_bf16_tflops=989.4, peak_fp8_tflops=1978.9)
A100 = GpuConfig(name="a100_80gb", peak_bf16_tflops=312, peak_fp8_tflops=None)
TINY_MODEL = ModelConfig(vocab_size=512, n_layer=2, d_model=64, n_head=4, max_seq_len=32)


def test_the_blocks_linears_compute_in_fp8_and_the_state_dict_is_unchanged():
    torch.manual_seed(0)
    plain = LMModule(TINY_MODEL, {})
    torch.manual_seed(0)
    converted = LMModule(TINY_MODEL, {}, fp8="tensorwise", fp8_emulate=True)
    kinds = {
        name: type(m).__name__ for name, m in converted.model.named_modules() if isinstance(m, nn.Linear)
    }
    assert kinds.pop("lm_head") == "Linear"  # the logits stay in high precision
    assert set(kinds.values()) == {"Float8Linear"} and len(kinds) == 2 * 7  # q k v o, w1 w2 w3 per block
    assert "14 of 15 linear layers in FP8" in fp8.describe(converted.model)
    # Same keys, shapes and fp32 values: FP8 is how the matmuls run, not what a checkpoint holds.
    a, b = plain.state_dict(), converted.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    window = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    loss_fp8, loss = converted.loss(window), plain.loss(window)
    loss_fp8.backward()
    assert torch.isfinite(loss_fp8) and 0 < abs(loss_fp8.item() - loss.item()) < 0.05
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in converted.parameters())


@pytest.mark.parametrize(
    ("cuda", "planned", "gpu", "compile", "refusal"),
    [
        (False, False, GpuConfig(name="cpu"), False, "this run is on a CPU"),
        (True, True, A100, True, "the catalog's a100_80gb has no FP8 tensor cores"),
        (True, True, H100, False, "without torch.compile"),
        (True, True, H100, True, None),
    ],
    ids=["cpu", "a100", "h100-eager", "h100-compile"],
)
def test_fp8_is_refused_where_it_cannot_run_or_pay(cuda, planned, gpu, compile, refusal):
    if refusal is None:
        fp8.check_fp8("tensorwise", False, cuda, planned, gpu, compile)
        return
    with pytest.raises(Refused, match=refusal):
        fp8.check_fp8("tensorwise", False, cuda, planned, gpu, compile)
    fp8.check_fp8(None, False, cuda, planned, gpu, compile)  # off: nothing to refuse


def test_fp8_on_a_cpu_exits_78_before_the_run_directory_exists(tmp_path, data_cache):
    root = tmp_path / "runs"
    with pytest.raises(Refused, match="this run is on a CPU") as refusal:
        train(
            ["trainer=cpu", "precision=fp8", f"run.root={root}", f"data.cache_dir={data_cache}", "run.name=x"]
        )
    assert exit_code(refusal.value) == EXIT_CONFIG and not (root / "x").exists()


def test_mfu_of_an_fp8_run_is_against_the_fp8_peak_and_plans_see_its_speed(tmp_path):
    assert cost.peak_flops(H100, "bf16-mixed", True, fp8=True) == pytest.approx(1978.9e12)
    assert cost.peak_flops(A100, "bf16-mixed", True, fp8=True) is None
    catalog = cost.load_catalog(CONF)
    # FP8 tensor cores: twice the dense bf16 peak
    for name in ("h100_sxm", "h100_pcie", "h200", "l40s", "b200"):
        assert catalog[name].peak_fp8_tflops == pytest.approx(2 * catalog[name].peak_bf16_tflops, rel=0.03)
    assert catalog["a100_80gb"].peak_fp8_tflops is None
    # A bench whose FP8 row ran at 1.3x bf16's tokens/s: its MFU (against the FP8 peak) is 0.65x bf16's, and
    # the rate a plan multiplies (MFU against the bf16 peak) is the faster one.
    rows = [
        {"combo": ["precision=bf16"], "status": "ok", "gpu": "h100_sxm", "precision": "bf16-mixed", "mfu": 0.5},
        {"combo": ["precision=fp8"], "status": "ok", "gpu": "h100_sxm", "mfu": 0.325,
         "precision": "bf16-mixed+fp8-tensorwise"},
    ]  # fmt: skip
    model = ModelConfig()
    write_bench(tmp_path, {"model": model.__dict__, "results": rows}, "")
    ratio = cost.fp8_peak_ratio(catalog["h100_sxm"])
    assert measured_mfu(tmp_path, "h100_sxm", model, 0, ratio) == pytest.approx(0.65, rel=0.01)
    assert measured_mfu(tmp_path, "h100_sxm", model, 0) == pytest.approx(0.5)  # no ratio: bf16 rows only win
    # `lm sky` ranks a benched GPU at its measured speed, the others at the assumed MFU.
    assumed = {c.gpu.name: c for c in rank_gpus(model, DataConfig(), 0, catalog)}
    benched = {c.gpu.name: c for c in rank_gpus(model, DataConfig(), 0, catalog, bench_dir=tmp_path)}
    speedup = assumed["h100_sxm"].usd_per_billion_tokens / benched["h100_sxm"].usd_per_billion_tokens
    assert speedup == pytest.approx(0.65 / ASSUMED_MFU, rel=1e-3)
    assert benched["a100_80gb"].usd_per_billion_tokens == assumed["a100_80gb"].usd_per_billion_tokens


@pytest.mark.slow  # three tiny emulated runs, ~40 s on 2 cores
def test_an_fp8_run_resumes_bitwise_continues_without_fp8_and_exports(tiny_cfg, tmp_path):
    runs = tmp_path / "runs"
    main(tiny_cfg(*RUN, *EMULATED, "run.name=whole", "trainer.max_steps=12"))
    main(tiny_cfg(*RUN, *EMULATED, "run.name=cut", "trainer.max_steps=6"))
    main(tiny_cfg(*RUN, *EMULATED, "run.name=cut", "trainer.max_steps=12"))
    whole, cut = ckpt(runs / "whole"), ckpt(runs / "cut")
    assert whole["global_step"] == cut["global_step"] == 12
    for key in ("state_dict", "optimizer_states"):
        assert_same(whole[key], cut[key], key)
    # The same checkpoint continues in high precision (the state dict never held FP8 tensors).
    shutil.copytree(runs / "whole", runs / "bf16", symlinks=True)
    main(tiny_cfg(*RUN, "run.name=bf16", "trainer.max_steps=16"))
    assert ckpt(runs / "bf16")["global_step"] == 16
    # The export is the high-precision model: transformers' logits equal lm's without FP8; the FP8 forward
    # (what training computed) differs from both by FP8 rounding, stated here.
    loaded = load_run(runs / "whole")
    hf = to_hf_model(loaded.model, eos_id=0).eval()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = loaded.model.eval()(ids), hf(ids).logits
        fp8.convert(loaded.model, "tensorwise", emulate=True)
        in_fp8 = loaded.model(ids)
    assert (ours[..., : theirs.shape[-1]] - theirs).abs().max() < 1e-4
    drift = (in_fp8 - ours).abs().max().item() / ours.abs().max().item()
    assert 0 < drift < 0.1, f"FP8 forward vs the export: max |diff| {drift:.3g} of the largest logit"
