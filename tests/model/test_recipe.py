"""The recipe levers of issue 25 (lm.model): each trains, is off by default without a trace, composes with
compile and resume, exports where a transformers architecture carries it and is refused where none does."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.config import to_objects
from lm.engine.kernels import check_liger_model
from lm.engine.module import LMModule
from lm.interop.hf import load_init_from, model_config_from_hf, to_hf_model
from lm.model import ModelConfig, Transformer
from lm.numbers import memory
from lm.numbers.cost import flops_per_token
from lm.run.train import main
from lm.store import rundir

from ..interop.test_export import max_logit_diff, source_folder, tiny_lm
from ..numbers.test_memory import saved_bytes

LEVERS = {
    "qk_norm": dict(qk_norm=True),
    "relu2_gated": dict(mlp="relu2_gated"),
    "relu2": dict(mlp="relu2"),
    "logit_softcap": dict(logit_softcap=2.0),
    "z_loss": dict(z_loss=1e-2),
    "zero_init_proj": dict(zero_init_proj=True),
}
TINY = dict(vocab_size=100, n_layer=2, d_model=32, n_head=4, max_seq_len=16)


def tiny_module(**levers) -> LMModule:
    torch.manual_seed(0)
    return LMModule(ModelConfig(**TINY, **levers), {}).train()


def keys(cfg: ModelConfig) -> list[str]:
    with torch.device("meta"):
        return list(Transformer(cfg).state_dict())


@pytest.mark.parametrize("lever", LEVERS)
def test_each_lever_trains_with_finite_loss_and_gradients(lever):
    module = tiny_module(**LEVERS[lever])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    batch = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        loss, ce, z = module.objective(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        optimizer.step()
        losses.append(float(ce.detach()))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert (z is not None) == (lever == "z_loss")


def test_off_by_default_the_model_is_todays():
    """Every lever off: the same keys, the same initial weights and logits as a config that never names
    them (a lever whose off state moved the init's random draws would fail here)."""
    cfg = ModelConfig(**TINY)
    off = ModelConfig(
        **TINY,
        qk_norm=False,
        mlp="swiglu",
        logit_softcap=None,
        z_loss=0.0,
        zero_init_proj=False,
        doc_mask=False,
    )
    assert keys(cfg) == keys(off)
    assert ".mlp.w3.weight" in " ".join(keys(cfg)) and "q_norm" not in " ".join(keys(cfg))
    torch.manual_seed(0)
    a = Transformer(cfg)
    torch.manual_seed(0)
    b = Transformer(off)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_each_lever_changes_only_its_own_keys_and_weights():
    base = keys(ModelConfig(**TINY))
    qk = keys(ModelConfig(**TINY, qk_norm=True))
    assert set(qk) - set(base) == {f"blocks.{i}.attn.{n}_norm.weight" for i in range(2) for n in "qk"}
    assert set(base) - set(keys(ModelConfig(**TINY, mlp="relu2"))) == {
        f"blocks.{i}.mlp.w3.weight" for i in range(2)
    }
    for lever in ("relu2_gated", "logit_softcap", "z_loss", "zero_init_proj"):
        assert keys(ModelConfig(**TINY, **LEVERS[lever])) == base, lever
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(**TINY)).state_dict()
    torch.manual_seed(0)
    zeroed = Transformer(ModelConfig(**TINY, zero_init_proj=True)).state_dict()
    for name, tensor in zeroed.items():
        if name.endswith(("wo.weight", "w2.weight")):
            assert not tensor.any(), name
        else:  # the other weights keep their draws
            assert torch.equal(tensor, plain[name]), name


def test_non_gated_relu2_matches_swiglus_parameters_and_flops():
    for d_model in (32, 128, 768, 2048):
        shape = dict(vocab_size=1000, d_model=d_model, n_head=4, n_layer=2)
        swiglu, relu2 = ModelConfig(**shape), ModelConfig(**shape, mlp="relu2")
        assert relu2.hidden_dim == 3 * swiglu.hidden_dim // 2
        assert flops_per_token(relu2, 128) == flops_per_token(swiglu, 128)
    qk = ModelConfig(**TINY, qk_norm=True)
    extra = 6 * 2 * qk.head_dim * qk.n_layer  # the q/k gains, counted as N like every RMSNorm gain
    assert flops_per_token(qk, 16) - flops_per_token(ModelConfig(**TINY), 16) == extra


def test_z_loss_adds_its_coefficient_times_the_mean_squared_logsumexp():
    module = tiny_module(z_loss=1e-3)
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(2))
    total, ce, z = module.objective(batch)
    logits = module.model(batch[:, :-1]).float()
    expected = 1e-3 * torch.logsumexp(logits, dim=-1).square().mean()
    assert torch.allclose(z, expected, rtol=1e-6) and float(z) > 0
    assert torch.equal(total, ce + z)
    assert torch.equal(module.loss(batch), ce)  # validation: the cross-entropy alone


def test_softcap_bounds_the_logits_and_leaves_the_padding_masked():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY, logit_softcap=0.5))
    with torch.no_grad():
        model.lm_head.weight.mul_(1000)  # logits far beyond the cap
        logits = model(torch.randint(0, 100, (2, 16)))
    real = logits[..., :100]
    assert real.abs().max() <= 0.5 and real.abs().max() > 0.49
    assert torch.isneginf(logits[..., 100:]).all()


def test_liger_refuses_the_levers_its_kernels_cannot_serve():
    check_liger_model(ModelConfig(**TINY, qk_norm=True, zero_init_proj=True))  # these it serves
    for lever, name in [
        ("relu2", "model.mlp=relu2"),
        ("relu2_gated", "model.mlp=relu2_gated"),
        ("logit_softcap", "model.logit_softcap=2.0"),
        ("z_loss", "model.z_loss=0.01"),
    ]:
        with pytest.raises(Refused, match=rf"kernels\.liger=true cannot serve {re.escape(name)}") as e:
            check_liger_model(ModelConfig(**TINY, **LEVERS[lever]))
        assert exit_code(e.value) == EXIT_CONFIG


def test_liger_with_relu2_is_refused_at_preflight(tiny_cfg, tmp_path):
    """Before the CPU check (which would refuse Liger here anyway) and before any data or run directory."""
    cache = tmp_path / "fresh-cache"
    with pytest.raises(Refused, match=r"kernels\.liger=true cannot serve model\.mlp=relu2 "):
        main(tiny_cfg("kernels=liger", "model.mlp=relu2", f"data.cache_dir={cache}"))
    assert not cache.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("lever", ["qk_norm", "relu2", "logit_softcap"])
def test_memory_model_follows_the_lever(lever):
    """The activation estimate of each lever that changes what autograd keeps is within 6% of it."""
    batch, seq = 2, 96
    cfg = ModelConfig(
        vocab_size=1000, max_seq_len=seq, n_layer=2, d_model=256, n_head=8, n_kv_head=2, **LEVERS[lever]
    )
    for precision in ("32-true", "bf16-mixed"):
        est = memory.estimate(cfg, batch_size=batch, seq_len=seq, precision=precision, cuda=False)
        transient = est.tokens * (8 + (2 if precision != "32-true" else 0)) * cfg.padded_vocab_size
        predicted = est.activations + est.head - transient
        assert predicted == pytest.approx(saved_bytes(cfg, precision, 0, batch, seq), rel=0.06), precision


def test_qk_norm_and_relu2_compile_without_graph_breaks_and_match_eager():
    module = tiny_module(qk_norm=True, mlp="relu2", logit_softcap=2.0)
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(module.loss)(batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = module.loss(batch)
    module.model.compile()
    try:
        compiled = module.loss(batch)
    finally:
        torch._dynamo.reset()
    assert torch.allclose(compiled, eager, atol=1e-5), (float(compiled), float(eager))


# ----------------------------------------------------------------------------------------- export, import

PORTABLE = {
    "qk_norm": (dict(qk_norm=True), "Qwen3ForCausalLM", "silu"),
    "relu2_gated": (dict(mlp="relu2_gated"), "LlamaForCausalLM", "relu2"),
    "both": (dict(qk_norm=True, mlp="relu2_gated"), "Qwen3ForCausalLM", "relu2"),
    "training_only": (dict(z_loss=1e-4, zero_init_proj=True), "LlamaForCausalLM", "silu"),
}


@pytest.mark.parametrize("case", PORTABLE)
def test_portable_levers_export_with_parity_and_come_back_through_init_from(case, tmp_path, monkeypatch):
    levers, architecture, act = PORTABLE[case]
    model = tiny_lm(**levers)  # random norm gains: a q/k norm left out of the export would show
    hf = to_hf_model(model, eos_id=0)
    assert type(hf).__name__ == architecture and hf.config.hidden_act == act
    assert max_logit_diff(model, hf) < 1e-4
    hf.save_pretrained(tmp_path / "hf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == architecture and max_logit_diff(model, loaded) < 1e-4

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    back = model_config_from_hf(config, vocab_multiple=64, init_from=str(tmp_path / "hf"))
    assert (back.qk_norm, back.mlp) == (model.cfg.qk_norm, model.cfg.mlp)
    fresh = Transformer(back)
    load_init_from(fresh)
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids), model(ids))


@pytest.mark.parametrize(
    "levers, name",
    [(dict(mlp="relu2"), "model.mlp=relu2"), (dict(logit_softcap=15.0), "model.logit_softcap=15.0")],
)
def test_an_option_no_architecture_carries_is_refused_by_export_naming_it(levers, name):
    with pytest.raises(
        Refused, match=rf"cannot be exported to a transformers architecture: {re.escape(name)}"
    ):
        to_hf_model(tiny_lm(**levers), eos_id=0)


def test_init_from_refuses_a_llama_for_an_unportable_or_different_lever(tiny_cfg, tmp_path):
    folder = source_folder(tmp_path / "hf", to_objects(tiny_cfg()).model)  # a Llama of the tiny shape
    for override, message in [
        (
            "model.qk_norm=true",
            "its model_type='llama' but lm's decoder has model_type='qwen3' (model.qk_norm",
        ),
        ("model.mlp=relu2_gated", "its hidden_act='silu' but lm's decoder has hidden_act='relu2' (model.mlp"),
        ("model.logit_softcap=15", "cannot carry model.logit_softcap=15.0"),
    ]:
        with pytest.raises(Refused, match=re.escape(message)) as refused:
            main(tiny_cfg(f"model.init_from={folder}", override))
        assert exit_code(refused.value) == EXIT_CONFIG, override


# ------------------------------------------------------------------------------- a real run, every lever


@pytest.mark.slow  # 17-23 s on 2 cores: headroom under the README command's 10 min
def test_every_lever_at_once_trains_resumes_logs_z_loss_and_export_refuses_it(tiny_cfg, tmp_path):
    """Lightning, Hydra's schema, bf16, activation checkpointing and a resume with all the levers on; then
    `lm export` exits 78 naming the options no architecture carries, and writes nothing."""
    levers = ["model.qk_norm=true", "model.mlp=relu2", "model.logit_softcap=15", "model.z_loss=1e-4",
              "model.zero_init_proj=true", "activation_checkpointing=on", "kernels=eager", "precision=bf16",
              "trainer.log_every_n_steps=1", "sampling=off"]  # fmt: skip
    main(tiny_cfg(*levers, "trainer.max_steps=2"))
    main(tiny_cfg(*levers, "trainer.max_steps=4"))  # resumes at step 2 (run.resume=true)
    run = tmp_path / "runs" / "smoke"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 4 and ckpt["hyper_parameters"]["model"]["mlp"] == "relu2"
    scalars = rundir.read_scalars(run)
    assert list(scalars["train/z_loss"].steps) == [0, 1, 2, 3] and all(
        v > 0 for v in scalars["train/z_loss"].values
    )
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "lm.cli", "export", str(run), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert "model.mlp=relu2" in done.stderr and "model.logit_softcap=15.0" in done.stderr
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp-*"))


def test_fp8_converts_the_levers_linear_layers_and_keeps_the_keys():
    """torchao's Float8Linear (emulated on the CPU) takes the ReLU² MLP's two matrices like SwiGLU's three;
    the q/k norms and the softcap are no linear layers and stay as they are."""
    from lm.engine import fp8

    torch.manual_seed(0)
    cfg = ModelConfig(**{**TINY, "d_model": 64}, qk_norm=True, mlp="relu2", logit_softcap=15.0)
    model = Transformer(cfg)
    before = list(model.state_dict())
    converted = fp8.convert(model, "tensorwise", emulate=True)
    assert "blocks.0.mlp.w1" in converted and "blocks.0.mlp.w2" in converted and len(converted) == 12
    assert list(model.state_dict()) == before
    logits = model(torch.randint(0, 100, (2, 16)))[..., :100]
    logits.logsumexp(-1).mean().backward()
    assert torch.isfinite(logits).all() and torch.isfinite(model.blocks[0].mlp.w1.weight.grad).all()


@pytest.mark.parametrize(
    "lever, name",
    [
        ("relu2_gated", "model.mlp=relu2_gated"),
        ("relu2", "model.mlp=relu2"),
    ],
)
def test_gguf_refuses_what_llama_cpps_graphs_would_drop(lever, name):  # qk_norm: llama.cpp's qwen3
    from lm.tools.export_gguf import check_gguf_portable

    check_gguf_portable(ModelConfig(**TINY, z_loss=1e-4, zero_init_proj=True))  # training-only: a plain Llama
    with pytest.raises(Refused, match=rf"--format gguf cannot carry {re.escape(name)}"):
        check_gguf_portable(ModelConfig(**TINY, **LEVERS[lever]))


def test_recipe_group_sets_the_levers_and_the_command_line_wins(compose):
    default = to_objects(compose())
    assert (default.model.qk_norm, default.optim.name) == (False, "adamw")  # llama2023: nothing changes
    assert to_objects(compose("recipe=llama2023")) == default
    modern = to_objects(compose("recipe=modern", "+experiment=plan_1b"))
    assert (modern.model.qk_norm, modern.optim.name, modern.model.n_layer) == (True, "muon", 18)
    assert to_objects(compose("recipe=modern", "optim=adamw")).optim.name == "adamw"
    assert to_objects(compose("recipe=modern", "model.qk_norm=false")).model.qk_norm is False


def test_init_from_compares_config_floats_with_a_relative_tolerance():
    """A config written from a GGUF holds float32 values (`rms_norm_eps=9.999999747378752e-06` for 1e-05): the
    same model, not a different one; a real difference is still named."""
    from lm.interop.hf import hf_config, mismatches

    model_cfg = tiny_lm().cfg
    c = hf_config(model_cfg, eos_id=0).to_dict()
    assert model_cfg.norm_eps == 1e-5 and mismatches(c, model_cfg) == []
    assert mismatches({**c, "rms_norm_eps": 9.999999747378752e-06}, model_cfg) == []
    [wrong] = mismatches({**c, "rms_norm_eps": 1.1e-05}, model_cfg)
    assert "1.1e-05" in wrong
