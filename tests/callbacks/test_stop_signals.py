"""Fault injection in this process: every interrupted run must end bitwise equal to an uninterrupted one (CPU,
tiny model, DataLoader workers > 0). Faults come from `tests/faults.py`, the shared helpers (and the
subprocess runner with its hang bound) from `tests/harness.py`; the full matrix is `tests/test_faults.py`."""

import os
import signal

import pytest
import torch

from lm.base.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_SAVE_FAILED, Refused
from lm.callbacks.nonfinite import NonFiniteGuard
from lm.checkpoint.formats import TMP_MARK
from lm.checkpoint.local import AtomicCheckpointIO, CheckpointSaveError, check_run_fits
from lm.checkpoint.run_state import RunState, from_checkpoint
from lm.tools.supervise import backoff_s, supervise

from ..conftest import TINY
from ..conftest import train_in_process as train
from ..harness import (
    assert_matches_reference,
    assert_same,
    fault,
    last,
    marker,
    overrides,
    run,
)
from ..run.test_train import scalars


@pytest.fixture(scope="module")
def reference(root, data_cache) -> dict:
    """The uninterrupted run every fault case must reproduce."""
    assert train(overrides(root, data_cache, "reference")) == 0
    ckpts = root / "reference/checkpoints"
    # Rotation keeps the newest two by step number (string order would keep step-6 over step-20).
    assert sorted(p.name for p in ckpts.glob("step-*.ckpt")) == ["step-18.ckpt", "step-20.ckpt"]
    assert (ckpts / "last.ckpt").is_symlink() and (ckpts / "last.ckpt").resolve().name == "step-20.ckpt"
    return last(root, "reference")


@pytest.mark.parametrize(
    ("action", "saved_at"),
    # A signal before step 9's forward saves step 10; in validation after step 16, step 17; while step 12's
    # checkpoint is being written, step 13.
    [("sigterm", 10), ("sigusr1", 10), ("sigterm_in_val", 17), ("sigterm_in_save", 13)],
)
@pytest.mark.slow
def test_stop_signal_saves_at_the_next_step_exits_75_and_resumes_exactly(
    root, data_cache, reference, action, saved_at
):
    name = f"signal-{action}"
    args = overrides(root, data_cache, name, *fault(root / name, action, step=9))
    (root / name).mkdir(parents=True)
    assert train(args) == EXIT_PREEMPTED
    assert last(root, name)["global_step"] == saved_at
    assert train(args) == 0  # the same command again continues
    assert_matches_reference(root, name, reference)


@pytest.mark.slow
def test_sigterm_at_the_final_step_saves_and_still_measures_the_final_loss(root, data_cache, reference):
    """A stop that lands on the run's last step saves it, runs the last validation and ends the run (exit 0):
    exiting 75 there would leave a checkpoint at max_steps whose resume ends without validating."""
    name = "signal-final"
    (root / name).mkdir(parents=True)
    # Validation every 10 steps: the last one is due at the final step (20); the signal arrives before step 19's
    # forward, so the step it is acted on is the last.
    args = overrides(
        root, data_cache, name, "trainer.val_every_steps=10", *fault(root / name, "sigterm", step=19)
    )
    assert train(args) == 0
    assert marker(root / name, "sigterm", 19).exists()  # the signal was sent
    # Validation after steps 10 and 20, logged at Lightning's step index (global_step - 1).
    assert [s for s, _ in scalars(root / name, "val/loss")] == [9, 19]
    assert_matches_reference(root, name, reference)


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_keeps_workers_alive_for_the_save(root, data_cache, reference):
    name = "signal-group"
    (root / name).mkdir(parents=True)
    args = overrides(root, data_cache, name, *fault(root / name, "sigterm_group", step=9))
    first = run(args)
    assert first.code == EXIT_PREEMPTED, first.tail()
    assert "exited unexpectedly" not in first.stderr
    assert last(root, name)["global_step"] == 10
    assert run(args).code == 0
    assert_matches_reference(root, name, reference)


@pytest.mark.slow
def test_supervised_run_survives_sigkill_mid_step_and_mid_checkpoint_write(root, data_cache, reference):
    name = "sigkill"
    (root / name).mkdir(parents=True)
    faults = [
        *fault(root / name, "sigkill", step=8, key="a"),
        *fault(root / name, "sigkill_in_save", 10, "b"),
    ]
    result = run(overrides(root, data_cache, name, *faults), supervised=True)
    assert result.code == 0, result.tail()
    assert result.stderr.count("signal SIGKILL") == 2
    assert (
        "interrupted checkpoint write" in result.stdout + result.stderr
    )  # the half-written temporary was cleaned up
    assert not list((root / name / "checkpoints").glob(f"*{TMP_MARK}*"))
    assert_matches_reference(root, name, reference)


@pytest.mark.slow
def test_supervised_run_survives_sigkill_at_random_moments(root, data_cache, reference):
    name = "sigkill-random"
    (root / name).mkdir(parents=True)
    # Two kills, each at a seeded random moment up to 2 s after its process set up (startup, a step,
    # validation or a checkpoint write), one per process until both have fired.
    faults = [a for k in range(2) for a in fault(root / name, "sigkill_random", k, f"k{k}", seconds=2.0)]
    result = run(overrides(root, data_cache, name, *faults), supervised=True)
    assert result.code == 0, result.tail()
    assert result.stderr.count("signal SIGKILL") == 2
    assert_matches_reference(root, name, reference)


@pytest.mark.slow
def test_truncated_last_checkpoint_falls_back_to_the_previous_good_one(root, data_cache, reference):
    name = "truncated"
    assert train(overrides(root, data_cache, name, "trainer.max_steps=14")) == 0
    newest = (root / name / "checkpoints/last.ckpt").resolve()
    assert newest.name == "step-14.ckpt"
    with open(newest, "r+b") as f:  # what a kill mid-write leaves without an atomic rename
        f.truncate(newest.stat().st_size // 2)
    assert train(overrides(root, data_cache, name)) == 0
    assert list((root / name / "checkpoints/corrupt").glob("step-14.ckpt.*"))
    assert_matches_reference(root, name, reference)


@pytest.mark.slow
def test_full_disk_mid_write_keeps_previous_checkpoints_and_a_rerun_resumes(root, data_cache, reference):
    name = "disk-full"
    (root / name).mkdir(parents=True)
    args = overrides(root, data_cache, name, *fault(root / name, "disk_full", step=9))
    with pytest.raises(CheckpointSaveError, match="previous checkpoints are intact"):
        train(args)
    ckpts = root / name / "checkpoints"
    assert not list(ckpts.glob(f"*{TMP_MARK}*"))
    assert last(root, name)["global_step"] == 6  # the previous checkpoint is untouched and still loads
    assert train(args) == 0
    assert_matches_reference(root, name, reference)


def test_save_that_cannot_fit_is_refused_before_writing(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    io = AtomicCheckpointIO(expected_bytes=free + 2**30)
    with pytest.raises(CheckpointSaveError, match="GiB free"):
        io.save_checkpoint({"x": torch.zeros(1)}, tmp_path / "step-1.ckpt")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(Refused, match=r"keeping 3 of ~.* GiB each .* lower checkpoint.keep_last"):
        check_run_fits(tmp_path / "ckpts", ckpt_bytes=free // 3, keep_last=3)
    check_run_fits(tmp_path / "ckpts", ckpt_bytes=1000, keep_last=3)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["direct", "on-device"])
def test_nan_loss_step_is_skipped_without_touching_weights_or_optimizer(root, data_cache, fused):
    # fused AdamW (the GPU default) skips on the device through `found_inf` and is read a step later
    skipped, dropped = f"nan-skipped-{fused}", f"nan-reference-{fused}"
    for name, action in [(skipped, "nan"), (dropped, "drop_grads")]:
        (root / name).mkdir(parents=True)
        args = overrides(root, data_cache, name, f"optim.fused={fused}", *fault(root / name, action, step=9))
        assert train(args) == 0
    ckpt = last(root, skipped)
    assert all(torch.isfinite(t).all() for t in ckpt["state_dict"].values())
    assert ckpt["run_state"]["guards"]["skipped"] == 1
    # Skipping equals dropping that step's gradients: nothing else about the run changes.
    assert_same(ckpt["state_dict"], last(root, dropped)["state_dict"], "weights")
    assert_same(ckpt["optimizer_states"], last(root, dropped)["optimizer_states"], "optimizer")


def test_transient_nan_rolls_back_and_replays_exactly(root, data_cache, reference):
    name = "nan-rollback"
    (root / name).mkdir(parents=True)
    args = overrides(root, data_cache, name, "guards.max_nonfinite=1", *fault(root / name, "nan", step=9))
    assert train(args) == EXIT_PREEMPTED  # rolled back: nothing saved after the NaN
    assert last(root, name)["global_step"] == 6
    assert train(args) == 0
    assert_matches_reference(root, name, reference)


def test_deterministic_divergence_stops_after_one_rollback(root, data_cache):
    name = "nan-always"
    (root / name).mkdir(parents=True)
    args = overrides(
        root, data_cache, name, "guards.max_nonfinite=2", *fault(root / name, "nan_always", step=9)
    )
    assert train(args) == EXIT_PREEMPTED
    assert train(args) == EXIT_DIVERGED
    assert last(root, name)["global_step"] == 6


@pytest.mark.slow
def test_slow_host_gets_an_early_checkpoint(root, data_cache):
    name = "slow"
    (root / name).mkdir(parents=True)
    args = overrides(
        root,
        data_cache,
        name,
        "checkpoint.keep_last=-1",
        "checkpoint.every_n_steps=100",  # no scheduled save before the end: any other file is the alarm's
        "guards.baseline_warmup=2",
        "guards.baseline_steps=5",
        "guards.slow_window_s=0.5",
        *fault(root / name, "slow", step=14, seconds=0.3),  # >= 4x the median step time from step 14
    )
    assert train(args) == 0
    steps = sorted(int(p.stem.split("-")[1]) for p in (root / name / "checkpoints").glob("step-*.ckpt"))
    assert [s for s in steps if s != 20], steps  # a save before the final step: the alarm's


# -- lm supervise ---------------------------------------------------------------------------------------


def sh(script: str) -> list[str]:
    return ["bash", "-c", script]


def test_supervise_restarts_on_75_and_stops_on_success(tmp_path):
    log = tmp_path / "runs.txt"
    code = supervise(sh(f'echo "$LM_RESTARTS" >> {log}; [ "$LM_RESTARTS" -ge 2 ] || exit 75'))
    assert code == 0 and log.read_text().split() == ["0", "1", "2"]


@pytest.mark.parametrize("final", [EXIT_CONFIG, EXIT_DIVERGED, EXIT_SAVE_FAILED])
def test_supervise_never_restarts_a_refusal(tmp_path, final):
    log = tmp_path / "runs.txt"
    assert supervise(sh(f"echo x >> {log}; exit {final}")) == final
    assert log.read_text().split() == ["x"]


def test_supervise_restarts_crashes_with_backoff_then_gives_up(tmp_path):
    log = tmp_path / "runs.txt"
    code = supervise(sh(f"echo x >> {log}; kill -9 $$"), max_failures=2, backoff=0.01)
    assert code == 128 + signal.SIGKILL and log.read_text().split() == ["x"] * 3
    assert [backoff_s(n, 5, 60) for n in (1, 2, 3, 5)] == [5, 10, 20, 60]


def test_supervise_counts_every_crash_until_the_child_saves_a_checkpoint(tmp_path):
    """Crashes count however long the child ran; only progress (a checkpoint saved, reported through
    $LM_PROGRESS_FILE as lm's checkpoint writer does) starts the count again."""
    log = tmp_path / "runs.txt"
    script = (
        f'echo "$LM_RESTARTS" >> {log}; [ "$LM_RESTARTS" -eq 1 ] && echo saved > "$LM_PROGRESS_FILE"; exit 1'
    )
    code = supervise(sh(script), max_failures=2, backoff=0.01)
    assert code == 1 and log.read_text().split() == ["0", "1", "2", "3"]  # 1 crash, progress, then 2 more


def test_supervise_gives_up_after_max_restarts_even_when_each_run_progresses(tmp_path):
    log = tmp_path / "runs.txt"
    code = supervise(
        sh(f'echo x >> {log}; echo saved > "$LM_PROGRESS_FILE"; exit 1'), max_restarts=3, backoff=0.01
    )
    assert code == 1 and log.read_text().split() == ["x"] * 4


def test_config_refusal_exits_78_so_supervise_stops(tmp_path, data_cache):
    args = [*TINY, f"run.root={tmp_path}", f"data.cache_dir={data_cache}", "precision=fp16"]
    result = run(args, supervised=True)
    assert result.code == EXIT_CONFIG, result.tail()
    assert "needs a CUDA GPU" in result.stderr and "not restarting" in result.stderr


def test_resume_candidates_are_ordered_by_step_number_not_by_name(tmp_path):
    from lm.checkpoint.checkpointer import resume_candidates

    for step in (9, 10, 100, 99):
        (tmp_path / f"step-{step}.ckpt").write_bytes(b"")
    (tmp_path / "step-100.ckpt.tmp-123").write_bytes(b"")  # a write in progress is never a candidate
    assert [p.name for p in resume_candidates(tmp_path)] == [f"step-{s}.ckpt" for s in (100, 99, 10, 9)]


def test_nonfinite_guard_checkpoint_keeps_a_streak_of_skipped_steps():
    """A save inside a streak of skipped steps (2 of 3 before a rollback) resumes inside it, as the
    uninterrupted run would: the third in a row still rolls back."""
    state, again = RunState(), RunState()
    saved = NonFiniteGuard(3, None, state)
    saved.guards.skipped, saved.guards.in_a_row = 5, 2
    resumed = NonFiniteGuard(3, None, again)
    again.load(state.snapshot())
    assert (resumed.guards.skipped, resumed.guards.in_a_row) == (5, 2)
    # A checkpoint written before the streak was saved (its state in the guard's callback key, before RunState).
    again.load(from_checkpoint({"callbacks": {"NonFiniteGuard": {"skipped": 4}}}))
    assert (resumed.guards.skipped, resumed.guards.in_a_row) == (4, 0)
