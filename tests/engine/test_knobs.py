"""The speed knobs on a CPU: every combination composes, impossible ones are refused before anything is
prepared, activation checkpointing (`auto` included) never changes the numbers, and the model compiles
without graph breaks. The CUDA half (Liger against eager, real compile, flash attention, auto's trial
steps) is tests/engine/test_knobs_gpu.py."""

import importlib.util
import itertools
import logging
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lm.base.exits import Refused
from lm.config import register_configs, to_objects
from lm.engine.activation_checkpointing import allowed_bytes, candidates, resolve
from lm.engine.fp8 import check_fp8
from lm.engine.kernels import check_liger
from lm.engine.module import LMModule
from lm.engine.runtime import resolve_precision
from lm.model import ModelConfig
from lm.run.train import main

from ..conftest import CONF

KNOBS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml")) for group in
         ("precision", "activation_checkpointing", "kernels")}  # fmt: skip


def test_the_knob_groups_hold_the_issue_options():
    assert {"auto", "bf16", "bf16_true", "fp16", "fp32", "fp8", "fp8_rowwise"} <= set(KNOBS["precision"])
    assert {"off", "on", "every2", "auto"} <= set(KNOBS["activation_checkpointing"])
    assert {"auto", "eager", "compile", "liger", "liger_compile"} <= set(KNOBS["kernels"])


@pytest.mark.slow  # over ~15 s on 2 cores: CI's second pass
def test_every_knob_combination_composes_and_resolves_on_a_cpu():
    register_configs()
    combos = list(itertools.product(*KNOBS.values()))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for precision, ac, kernels in combos:
            overrides = [f"precision={precision}", f"activation_checkpointing={ac}", f"kernels={kernels}"]
            cfg = to_objects(compose("train", overrides=overrides))
            files = {
                g: OmegaConf.load(CONF / g / f"{o}.yaml") for g, o in zip(KNOBS, (precision, ac, kernels))
            }
            nodes = {"precision": cfg.precision, "activation_checkpointing": cfg.activation_checkpointing,
                     "kernels": cfg.kernels}  # fmt: skip

            def expected(group: str, key: str, files=files, nodes=nodes):
                """What the group file says, else the schema's default (conf/ holds only what differs)."""
                return files[group].get(key, getattr(type(nodes[group])(), key))

            # The group file's values land in the typed node (nothing dropped or renamed by the schema).
            assert cfg.precision.mode == expected("precision", "mode")
            assert cfg.activation_checkpointing.auto == expected("activation_checkpointing", "auto")
            assert cfg.kernels.liger == expected("kernels", "liger")
            # What a CPU run does with it: fp16 and Liger are refused with their fix, the rest resolve.
            if cfg.precision.mode == "16-mixed":
                with pytest.raises(Refused, match="needs a CUDA GPU"):
                    resolve_precision(cfg.precision.mode, cuda=False, bf16=False)
            else:
                assert resolve_precision(cfg.precision.mode, cuda=False, bf16=False) in (
                    "bf16-mixed",
                    "bf16-true",
                    "32-true",
                )
            assert cfg.precision.fp8 == expected("precision", "fp8")
            if cfg.precision.fp8:  # FP8 needs FP8 tensor cores
                with pytest.raises(Refused, match="this run is on a CPU"):
                    check_fp8(cfg.precision.fp8, False, False, False, cfg.gpu, cfg.kernels.compile)
            if cfg.kernels.liger:
                with pytest.raises(Refused, match="kernels=eager or kernels=compile"):
                    check_liger(cfg.kernels.liger, cuda=False)
            else:
                check_liger(cfg.kernels.liger, cuda=False)
            a = cfg.activation_checkpointing
            decision = resolve(a.every, a.auto, cfg.model.n_layer)
            assert decision.every == (0 if a.auto else a.every)
    assert len(combos) >= 7 * 4 * 5


@pytest.mark.parametrize(
    ("precision", "ac", "expect_every", "expect_dtype"),
    [
        ("bf16_true", "every2", 2, torch.bfloat16),  # bf16 weights and AdamW moments
        ("bf16", "on", 1, torch.float32),  # autocast keeps fp32 master weights
        ("fp32", "auto", 0, torch.float32),  # auto on a CPU: off, and the log says why
    ],
)
def test_representative_combinations_train(
    tiny_cfg, tmp_path, caplog, precision, ac, expect_every, expect_dtype
):
    cfg = tiny_cfg(
        f"precision={precision}",
        f"activation_checkpointing={ac}",
        "kernels=eager",
        "trainer.max_steps=3",
        "trainer.val_every_steps=3",
        "trainer.limit_val_batches=2",
        "sampling=off",
    )
    with caplog.at_level(logging.INFO, logger="lm"):
        val_loss = main(cfg)
    assert val_loss is not None and torch.isfinite(torch.tensor(val_loss))
    line = next(r.getMessage() for r in caplog.records if "activation checkpointing" in r.getMessage())
    label = {0: "off", 1: "every block", 2: "1 block in 2"}[expect_every]
    assert f"activation checkpointing {label}" in line
    if ac == "auto":
        assert "no device memory limit" in line
    ckpt = torch.load(tmp_path / "runs" / "smoke" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["state_dict"]["model.tok_emb.weight"].dtype == expect_dtype
    assert ckpt["global_step"] == 3


@pytest.mark.parametrize("kernels", ["liger", "liger_compile"])
def test_liger_on_a_cpu_is_refused_before_anything_is_prepared(tiny_cfg, tmp_path, kernels):
    cache = tmp_path / "fresh-cache"
    cfg = tiny_cfg(f"kernels={kernels}", f"data.cache_dir={cache}")
    with pytest.raises(
        Refused, match=r"kernels\.liger=true needs a CUDA GPU.*kernels=eager or kernels=compile"
    ):
        main(cfg)
    assert not cache.exists()  # no tokenizer trained, no shards written
    assert not (tmp_path / "runs").exists()  # no run directory, no config.yaml


def test_liger_refusal_exits_78_from_the_command_line(tmp_path, data_cache):
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "kernels=liger",
            "trainer=cpu",
            f"run.root={tmp_path}",
            f"data.cache_dir={data_cache}",
        ],
        cwd=CONF.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "needs a CUDA GPU" in proc.stderr and "kernels=eager" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger_kernel is installed")
def test_liger_on_cuda_without_the_package_names_the_install():
    with pytest.raises(Refused, match=r"pip install -e '\.\[gpu\]'"):
        check_liger(True, cuda=True)


# ------------------------------------------------------------------------------- activation checkpointing


def tiny_module(n_layer: int = 4) -> LMModule:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=100, n_layer=n_layer, d_model=32, n_head=4, max_seq_len=16)
    return LMModule(cfg, {}).train()


def loss_and_grads(module: LMModule, batch: torch.Tensor, every: int):
    module.zero_grad(set_to_none=True)
    module.model.ac_every = every
    loss = module.loss(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("every", [1, 2, 3])
def test_checkpointing_changes_no_number(every):
    module = tiny_module()
    batch = torch.randint(0, 100, (3, 17))
    loss_off, grads_off = loss_and_grads(module, batch, 0)
    loss_k, grads_k = loss_and_grads(module, batch, every)
    assert torch.equal(loss_off, loss_k)
    for name, g in grads_off.items():
        assert torch.equal(g, grads_k[name]), name  # recomputation is the same arithmetic, bit for bit


def saved_activation_probe(module: LMModule, batch: torch.Tensor, calls: list[int]):
    """A real measurement for `auto` on a CPU: bytes autograd saves for the backward pass outside
    checkpointed blocks (what activation checkpointing trades for recomputation)."""

    def probe(every: int) -> int:
        calls.append(every)
        module.model.ac_every = every
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = module.loss(batch)
        loss.backward()
        module.zero_grad(set_to_none=True)
        return saved

    return probe


def test_auto_tries_least_checkpointing_first_and_takes_the_first_that_fits():
    module, batch = tiny_module(), torch.randint(0, 100, (2, 17))
    assert candidates(4) == [0, 4, 3, 1]  # off, 1 block, 2 blocks, all 4
    assert candidates(18) == [0, 18, 17, 8, 5, 4, 3, 2, 1]
    calls: list[int] = []
    probe = saved_activation_probe(module, batch, calls)
    peaks = {k: probe(k) for k in candidates(4)}
    assert peaks[0] > peaks[4] > peaks[3] > peaks[1]  # more checkpointing, less memory: the search's premise

    calls.clear()
    # Room for 1 block in 3 but not for 1 in 4: the search stops at the first candidate that fits.
    budget = (peaks[3] + peaks[4]) // 2
    decision = resolve(0, True, 4, probe=probe, budget_bytes=budget, free_memory_reserve=0.0)
    assert decision.every == 3 and calls == [0, 4, 3]
    assert [(t.every, t.fits) for t in decision.trials] == [(0, False), (4, False), (3, True)]
    assert [t.peak_bytes for t in decision.trials] == [peaks[0], peaks[4], peaks[3]]
    assert "1 block in 3" in decision.reason

    # The reserve is kept free: a peak that fits the budget but not the budget minus 10% does not fit.
    calls.clear()
    decision = resolve(0, True, 4, probe=probe, budget_bytes=peaks[0], free_memory_reserve=0.1)
    assert decision.every == 4 and calls == [0, 4]

    # Plenty of memory: off, after one trial. `every` is ignored under auto.
    calls.clear()
    decision = resolve(2, True, 4, probe=probe, budget_bytes=10 * peaks[0])
    assert decision.every == 0 and calls == [0]


def test_auto_skips_out_of_memory_trials_and_refuses_when_nothing_fits():
    module, batch = tiny_module(), torch.randint(0, 100, (2, 17))
    calls: list[int] = []
    measure = saved_activation_probe(module, batch, calls)

    def oom_below_every_block(every: int) -> int | None:
        return measure(every) if every == 1 else None  # torch.OutOfMemoryError in the real probe

    decision = resolve(0, True, 4, probe=oom_below_every_block, budget_bytes=10**9)
    assert decision.every == 1 and [t.peak_bytes is None for t in decision.trials] == [
        True,
        True,
        True,
        False,
    ]

    with pytest.raises(
        Refused, match=r"not even checkpointing every block fits.*data\.batch_size.*accumulate"
    ):
        resolve(0, True, 4, probe=measure, budget_bytes=1000)


def test_auto_without_a_device_limit_is_off_and_configured_values_stand():
    decision = resolve(1, True, 4, probe=None, budget_bytes=None)
    assert decision.every == 0 and "no device memory limit" in decision.reason and not decision.trials
    assert resolve(2, False, 4).every == 2


def test_free_memory_reserve_is_validated(compose):
    with pytest.raises(Refused, match="activation_checkpointing.free_memory_reserve"):
        to_objects(
            compose("activation_checkpointing=auto", "activation_checkpointing.free_memory_reserve=1.5")
        )


# ---------------------------------------------------------------------------------------------- compile


@pytest.mark.parametrize("every", [0, 2])
def test_the_training_loss_compiles_without_graph_breaks(every):
    module = tiny_module()
    module.model.ac_every = every
    torch._dynamo.reset()
    explained = torch._dynamo.explain(module.loss)(torch.randint(0, 100, (2, 17)))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_auto_sees_a_memory_cap_that_mem_get_info_does_not():
    """`lm bench bench.memory_limit_gb=24` on an 80 GB GPU caps the process with a memory fraction, which
    `torch.cuda.mem_get_info` ignores: `auto` used to budget the whole free device (and decided before the cap
    was even set), so the capped bench misstated what a smaller GPU does."""
    gb = 10**9
    assert allowed_bytes(free=79 * gb, total=80 * gb, fraction=0.3, reserved=0) == 24 * gb
    assert allowed_bytes(free=79 * gb, total=80 * gb, fraction=0.3, reserved=4 * gb) == 20 * gb
    assert allowed_bytes(free=10 * gb, total=80 * gb, fraction=1.0, reserved=4 * gb) == 10 * gb  # others' use
    assert allowed_bytes(free=79 * gb, total=80 * gb, fraction=0.01, reserved=4 * gb) == 0
