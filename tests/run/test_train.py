"""End-to-end runs of a tiny model on the bundled corpus: the run directory, resume, multirun."""

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm.base.exits import Refused
from lm.config import OptimConfig
from lm.engine.module import LMModule, lr_lambda
from lm.run.train import main

from ..conftest import CONF, TINY

ROOT = CONF.parent


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one TensorBoard scalar, across every events file of the run."""
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def test_smoke_run_leaves_the_run_directory_contract(tiny_cfg, tmp_path):
    cfg = tiny_cfg(
        "trainer.max_steps=60",
        "trainer.val_every_steps=20",
        "trainer.log_every_n_steps=5",
        "checkpoint.every_n_steps=25",
        "checkpoint.keep_last=2",
        "optim.warmup_steps=10",
    )
    val_loss = main(cfg)
    run = tmp_path / "runs" / "smoke"
    ckpts = run / "checkpoints"
    assert (ckpts / "last.ckpt").is_file()
    # Every 25 steps plus the final step, the newest two by step number kept.
    assert sorted(p.name for p in ckpts.glob("step-*.ckpt")) == ["step-50.ckpt", "step-60.ckpt"]
    assert (run / "config.yaml").is_file()

    train = scalars(run, "train/loss")
    val = scalars(run, "val/loss")
    # Lightning stamps a point with the 0-based index of the last training batch: 19 is after 20 steps.
    assert [s for s, _ in val] == [19, 39, 59]
    assert val[-1][1] < val[0][1] - 0.1
    assert sum(v for _, v in train[-3:]) / 3 < train[0][1] - 0.5
    assert train[0][1] == pytest.approx(math.log(512), abs=0.3)  # untrained: near uniform over the vocabulary
    assert val_loss == pytest.approx(val[-1][1])
    assert {"train/lr", "train/grad_norm"} <= set(
        EventAccumulator(str(run / "tb")).Reload().Tags()["scalars"]
    )

    # Rerunning a finished command resumes, has nothing to do, and writes no duplicate checkpoint.
    before = sorted(p.name for p in ckpts.iterdir())
    main(cfg)
    assert sorted(p.name for p in ckpts.iterdir()) == before

    # A checkpoint rebuilds its own model without the config tree.
    module = LMModule.load_from_checkpoint(ckpts / "last.ckpt", map_location="cpu")
    assert module.model_cfg.n_layer == 2 and module.model_cfg.vocab_size == 512


def test_clipping_by_the_shared_norm_equals_lightnings(tiny_cfg, tmp_path, monkeypatch):
    # LMModule clips with the norm it computed once for the step; Lightning's default computes it again.
    common = ["trainer.max_steps=6", "trainer.gradient_clip_val=0.05", "trainer.val_every_steps=100"]
    common.append("trainer.log_every_n_steps=1")
    main(tiny_cfg(*common, "run.name=shared"))
    import lightning.pytorch as pl

    monkeypatch.setattr(
        LMModule, "configure_gradient_clipping", pl.LightningModule.configure_gradient_clipping
    )
    main(tiny_cfg(*common, "run.name=lightning"))
    ours, theirs = (weights(tmp_path / f"runs/{n}/checkpoints/last.ckpt") for n in ("shared", "lightning"))
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7, msg=name)
    norms = [v for _, v in scalars(tmp_path / "runs/shared", "train/grad_norm")]
    assert norms and min(norms) > 0.05  # the clip really bit


@pytest.mark.slow  # 14-22 s on 2 cores: headroom under the README command's 10 min
def test_resumed_run_ends_with_the_same_weights(tiny_cfg, tmp_path):
    common = [
        "trainer.val_every_steps=10",
        "checkpoint.every_n_steps=7",
        "optim.total_steps=30",
        "optim.warmup_steps=5",
    ]
    main(tiny_cfg(*common, "run.name=straight", "trainer.max_steps=30"))
    main(
        tiny_cfg(*common, "run.name=split", "trainer.max_steps=13")
    )  # stops mid-way, between checkpoint intervals
    main(tiny_cfg(*common, "run.name=split", "trainer.max_steps=30"))  # the same command again resumes
    runs = tmp_path / "runs"
    # The rerun moved last.ckpt to its own final step (no `last-v1.ckpt` beside a stale link).
    assert (runs / "split/checkpoints/last.ckpt").resolve().name == "step-30.ckpt"
    assert not list((runs / "split/checkpoints").glob("*-v1.ckpt"))
    straight, split = (
        weights(runs / "straight/checkpoints/last.ckpt"),
        weights(runs / "split/checkpoints/last.ckpt"),
    )
    assert straight.keys() == split.keys()
    for name in straight:
        assert torch.equal(straight[name], split[name]), name
    steps = [s for s, _ in scalars(runs / "split", "train/loss")]
    assert max(steps) >= 25


def test_resume_false_starts_over_and_keeps_the_old_run(tiny_cfg, tmp_path):
    main(tiny_cfg("trainer.max_steps=5", "trainer.val_every_steps=5"))
    main(tiny_cfg("trainer.max_steps=3", "trainer.val_every_steps=3", "run.resume=false"))
    run = tmp_path / "runs" / "smoke"
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=False)["global_step"] == 3
    archived = list((run / "archive").glob("*/checkpoints/last.ckpt"))
    assert len(archived) == 1 and torch.load(archived[0], weights_only=False)["global_step"] == 5


@pytest.mark.parametrize(
    "knobs",
    [
        ["+experiment=smoke"],
        ["activation_checkpointing=on", "kernels=eager", "precision=fp32"],
        ["precision=bf16", "optim.schedule=cosine"],
    ],
)
def test_cheap_configurations_run_a_few_steps(tiny_cfg, tmp_path, knobs):
    main(tiny_cfg(*knobs, "trainer.max_steps=3", "trainer.val_every_steps=3"))
    assert (tmp_path / "runs/smoke/checkpoints/last.ckpt").is_file()


def test_fp16_on_a_cpu_is_refused_before_anything_is_written(tiny_cfg, tmp_path):
    with pytest.raises(Refused, match="needs a CUDA GPU"):
        main(tiny_cfg("precision=fp16"))
    assert not (tmp_path / "runs").exists()


def test_extra_callbacks_are_instantiated_from_target_nodes(tiny_cfg, tmp_path):
    main(
        tiny_cfg(
            "trainer.max_steps=4",
            "trainer.val_every_steps=4",
            "trainer.log_every_n_steps=1",
            "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
        )
    )
    tags = EventAccumulator(str(tmp_path / "runs/smoke/tb")).Reload().Tags()["scalars"]
    assert any(t.startswith("lr-AdamW") for t in tags)


@pytest.mark.slow  # 14-22 s on 2 cores: headroom under the README command's 10 min
def test_multirun_gives_one_run_directory_per_job(tmp_path, data_cache):
    overrides = [*TINY, f"run.root={tmp_path}", f"data.cache_dir={data_cache}", "trainer.max_steps=3"]
    overrides += ["trainer.val_every_steps=3"]
    cmd = [sys.executable, "train.py", "-m", "optim.lr=1e-4,3e-4", *overrides]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # Lightning's litlogger advertisement is kept out of the console and every job's log (issue 27).
    logs = [p.read_text() for p in (tmp_path / "smoke").rglob("*.log")]
    assert logs and "INFO" in "".join(logs)
    assert not [text for text in [result.stdout, result.stderr, *logs] if "litlogger" in text]
    jobs = sorted(p.parent.parent.name for p in (tmp_path / "smoke").glob("*/checkpoints/last.ckpt"))
    assert jobs == ["optim.lr=0.0001", "optim.lr=0.0003"]
    lrs = {
        p.name: torch.load(p / "checkpoints/last.ckpt", weights_only=False)["hyper_parameters"]["optim"]["lr"]
        for p in (tmp_path / "smoke").iterdir()
        if p.name.startswith("optim")
    }
    assert lrs == {"optim.lr=0.0001": 1e-4, "optim.lr=0.0003": 3e-4}


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_schedules_warm_up_then_end_at_their_floor(schedule):
    cfg = OptimConfig(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    f = lr_lambda(cfg, total_steps=100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(100) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    if schedule == "wsd":
        assert f(79) == 1.0 and f(90) == pytest.approx(0.55)  # flat, then linear over the last 20 steps
    values = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))  # never rises after warm-up


def test_job_directory_names_use_the_swept_keys_only():
    from lm.store.rundir import job_dirname

    task = ["trainer=cpu", "data.cache_dir=/tmp/x", "optim.lr=0.0003", "run.name=s"]
    argv = ["-m", "optim.lr=1e-4,3e-4", "trainer=cpu", "data.cache_dir=/tmp/x", "run.name=s"]
    assert job_dirname(task, argv, {"run.name"}) == "optim.lr=0.0003"
    # A launcher in another process: every override names the job, slashes flattened, long names hashed.
    fallback = job_dirname(task, ["--some-runner-flag"], {"run.name"})
    assert fallback == "data.cache_dir=_tmp_x,optim.lr=0.0003,trainer=cpu"
    long = job_dirname([f"k{i}=value{i}" for i in range(40)], [])
    assert len(long) <= 91 and long != job_dirname([f"k{i}=value{i}" for i in range(41)], [])


@pytest.mark.slow
def test_compiled_run_matches_eager_and_its_checkpoint_resumes_eagerly(tiny_cfg, tmp_path):
    common = ["trainer.max_steps=4", "trainer.val_every_steps=4", "data.num_workers=0"]
    eager = main(tiny_cfg(*common, "kernels=eager", "run.name=eager"))
    compiled = main(tiny_cfg(*common, "kernels=compile", "run.name=compiled"))
    assert compiled == pytest.approx(eager, abs=1e-3)
    ckpt = torch.load(tmp_path / "runs/compiled/checkpoints/last.ckpt", weights_only=False)
    assert not any("_orig_mod" in k for k in ckpt["state_dict"])  # compiled in place: same keys as eager
    main(tiny_cfg("trainer.max_steps=6", "trainer.val_every_steps=3", "kernels=eager", "run.name=compiled"))
