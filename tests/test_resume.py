"""Resuming with a changed config (applied and logged, or refused by name) and rotation in a copied run."""

import hashlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm.checkpoint.local import rotate
from lm.config import OptimConfig
from lm.engine.module import lr_lambda
from lm.run.train import main
from lm.store.exits import EXIT_CONFIG

from .conftest import CONF, TINY

ROOT = CONF.parent
RUN = [
    "optim.total_steps=30",  # the schedule spans the plan; step 20 lies in the decay
    "optim.warmup_steps=2",
    "optim.decay_fraction=0.5",
    "checkpoint.every_n_steps=5",
    "trainer.val_every_steps=100",
    "trainer.limit_val_batches=1",
    "+trainer.extra.num_sanity_val_steps=0",
    "data.num_workers=0",
]


def ckpt(run: Path) -> dict:
    return torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)


def files(run: Path) -> dict[str, str]:
    """sha256 of every file of a run directory but the invocation logs (hydra/) and the lock (which names its
    latest holder: the refusal comes after the resume point is found, under the lock), by relative path."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and "hydra" not in p.relative_to(run).parts and p.name != ".lock"
    }


def test_a_changed_optimizer_setting_is_applied_from_the_resumed_step_and_logged(tiny_cfg, tmp_path, caplog):
    runs = tmp_path / "runs"
    main(tiny_cfg(*RUN, "run.name=same", "trainer.max_steps=10"))
    shutil.copytree(runs / "same", runs / "changed", symlinks=True)  # two runs at the same step-10 state
    main(tiny_cfg(*RUN, "run.name=same", "trainer.max_steps=20"))
    # fused: the guard against non-finite steps reads the config's kernel; the groups must run that kernel.
    changes = ["optim.lr=3e-3", "optim.weight_decay=0.05", "optim.betas=[0.9,0.99]", "optim.fused=true"]
    with caplog.at_level(logging.INFO):
        main(tiny_cfg(*RUN, "run.name=changed", "trainer.max_steps=20", *changes))

    same, changed = ckpt(runs / "same"), ckpt(runs / "changed")
    assert changed["global_step"] == 20
    assert any(not torch.equal(same["state_dict"][k], changed["state_dict"][k]) for k in same["state_dict"])
    # The LR the schedule gives at step 20 under the new config (not the old peak carried in the checkpoint).
    new = OptimConfig(lr=3e-3, warmup_steps=2, decay_fraction=0.5, total_steps=30)
    multiplier = lr_lambda(new, total_steps=30)(20)
    decay, no_decay = changed["optimizer_states"][0]["param_groups"]
    assert decay["lr"] == pytest.approx(3e-3 * multiplier) and no_decay["lr"] == decay["lr"]
    assert changed["lr_schedulers"][0]["base_lrs"] == [3e-3, 3e-3]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert tuple(decay["betas"]) == (0.9, 0.99) and decay["fused"] and no_decay["fused"]
    assert same["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-3 * multiplier)
    assert changed["hyper_parameters"]["optim"]["lr"] == 3e-3  # recorded = trained with

    said = caplog.text
    assert "resumed at step 10" in said
    for line in (
        "optim.lr 0.001 -> 0.003",
        "optim.weight_decay 0.1 -> 0.05",
        "optim.betas [0.9, 0.95] -> [0.9, 0.99]",
    ):
        assert line in said
    text = EventAccumulator(str(runs / "changed/tb"), size_guidance={"tensors": 0}).Reload()
    [event] = text.Tensors("resume/changes/text_summary")
    assert event.step == 10 and b"optim.lr" in event.tensor_proto.string_val[0]


def test_another_architecture_is_refused_and_the_run_left_as_it_was(tiny_cfg, tmp_path, data_cache):
    main(tiny_cfg(*RUN, "trainer.max_steps=5"))
    run = tmp_path / "runs/smoke"
    before = files(run)
    cmd = [sys.executable, "train.py", *TINY, f"run.root={tmp_path / 'runs'}", f"data.cache_dir={data_cache}"]
    cmd += [*RUN, "trainer.max_steps=10", "model.n_layer=3"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert "model.n_layer=2 -> 3" in result.stderr and "run.resume=false" in result.stderr
    assert (
        files(run) == before
    )  # config.yaml, checkpoints, TensorBoard: as the last good invocation left them
    assert ckpt(run)["global_step"] == 5


@pytest.mark.slow
def test_a_copied_run_directory_rotates_the_checkpoints_it_brought(compose, tmp_path):
    first = tmp_path / "runs"
    main(compose(*TINY, *RUN, "trainer.max_steps=15", "checkpoint.keep_last=2"))
    ckpts = first / "smoke/checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*.ckpt")) == ["step-10.ckpt", "step-15.ckpt"]
    (ckpts / "notes.txt").write_text("a user's file")
    (ckpts / "step-abc.ckpt").write_text("not a step checkpoint")
    moved = tmp_path / "moved"
    subprocess.run(["cp", "-r", str(first), str(moved)], check=True, timeout=60)

    main(compose(*TINY, *RUN, f"run.root={moved}", "trainer.max_steps=25", "checkpoint.keep_last=2"))
    kept = moved / "smoke/checkpoints"
    assert sorted(p.name for p in kept.glob("step-*.ckpt")) == [
        "step-20.ckpt",
        "step-25.ckpt",
        "step-abc.ckpt",
    ]
    assert (kept / "notes.txt").read_text() == "a user's file"
    assert (kept / "last.ckpt").resolve().name == "step-25.ckpt"


def test_rotation_keeps_the_newest_past_steps_the_link_and_foreign_files(tmp_path):
    for step in range(1, 10):
        (tmp_path / f"step-{step}.ckpt").write_bytes(b"x")
    for name in ("notes.txt", "step-abc.ckpt", "step-3.ckpt.tmp-99"):
        (tmp_path / name).write_bytes(b"y")
    (tmp_path / "last.ckpt").symlink_to("step-2.ckpt")
    # Present: step 6 (a run resumed from step 2 left steps 7-9 behind, a future it will overwrite).
    deleted = rotate(tmp_path, keep_last=2, present=6)
    assert sorted(p.name for p in deleted) == ["step-1.ckpt", "step-3.ckpt", "step-4.ckpt"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "last.ckpt", "notes.txt", "step-2.ckpt", "step-3.ckpt.tmp-99", "step-5.ckpt", "step-6.ckpt",
        "step-7.ckpt", "step-8.ckpt", "step-9.ckpt", "step-abc.ckpt",
    ]  # fmt: skip
    assert rotate(tmp_path, keep_last=-1, present=9) == []
