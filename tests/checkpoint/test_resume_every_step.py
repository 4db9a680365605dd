"""Resuming is exact wherever the run stops: a micro run stopped at optimizer step K and rerun ends bitwise equal
(weights, AdamW moments and step counts, LR schedule, the guards' state) to the uninterrupted run, for every K.

The run crosses everything a resume must carry state over: the LR warm-up, a milestone sample, a validation, a
periodic checkpoint, a skipped loss spike judged against the spike detector's window, and the start of the LR
decay. Stops come from inside the process (`tests.faults.Fault`), so K is exact and the case is deterministic:
SIGTERM at the start of step K saves step K+1 and exits 75 (0 at the final step, which it finishes); SIGKILL at the start of step K loses the steps
since the last periodic checkpoint, which the rerun trains again. Every process runs under the fault harness's
wall-clock bound (`tests.harness.run`).

A few cut points run by default (one before the warm-up ends, the throughput baseline forms and the first
sample is taken, one whose save lands on the validation step, one SIGKILL that replays steps); the sweep over
every step is `slow`.
"""

import signal
from pathlib import Path

import pytest

from lm.base.exits import EXIT_PREEMPTED

from ..conftest import TINY
from ..harness import assert_matches_reference, assert_same, fault, last, run

STEPS = 16
SPIKE_STEP = 11
RUN = [
    f"trainer.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",  # one schedule for every invocation, however early it stops
    "optim.warmup_steps=4",  # warm-up over steps 0-3
    "optim.decay_fraction=0.25",  # the LR decays from step 12
    "sampling.steps=[6]",  # a milestone sample at step 6 (and one at the last step)
    "trainer.val_every_steps=10",
    "trainer.limit_val_batches=2",
    "checkpoint.every_n_steps=8",  # a periodic checkpoint at step 8: what a SIGKILL after it resumes from
    "checkpoint.keep_last=2",
    "guards.baseline_warmup=1",  # the throughput baseline forms by step ~5 (the default: step ~25)
    "guards.baseline_steps=3",
    "guards.spike_window=4",  # the spike detector is armed from step 4 (the default: step 50)
]
SIGTERM_FAST = (2, 9)
"""Step 2: in the warm-up, before the throughput baseline and the first sample (issue 30's early cuts, at steps
10 and 19 of the default run). Step 9: the save lands on step 10, whose validation runs only after the rerun
resumes."""
SIGKILL_STEPS = (3, 9, 13)
"""Before the first checkpoint (the rerun starts over), and after it (steps 8.. are trained again, across the
validation, the spike and the start of the decay)."""
SIGKILL_FAST = (13,)


def args(root: Path, cache: Path, name: str, *extra: str) -> list[str]:
    """The micro run `name`, its batch at SPIKE_STEP spiking in every process (bad data, as a replay sees it)."""
    spike = "+callbacks.spike"
    return [
        *TINY,
        f"run.root={root}",
        f"data.cache_dir={cache}",
        f"run.name={name}",
        *RUN,
        f"{spike}._target_=tests.faults_spike.SpikeFault",
        f"{spike}.action=data",
        f"{spike}.step={SPIKE_STEP}",
        f"{spike}.marker={root / 'spike-batches.json'}",  # written by the reference, read by every case
        *extra,
    ]


def run_state(ckpt: dict, section: str):
    """A section of the checkpoint's RunState (the one record of what it resumes beyond weights and
    optimizer)."""
    return ckpt["run_state"][section]


@pytest.fixture(scope="module")
def reference(root, data_cache) -> dict:
    """The uninterrupted run; it also picks the spiking batch, so it runs before any case."""
    outcome = run(args(root, data_cache, "reference"))
    assert outcome.code == 0, outcome.tail()
    ckpt = last(root, "reference")
    guards = run_state(ckpt, "guards")
    assert guards["spikes"] == 1 and guards["spike_recent"] == [
        SPIKE_STEP
    ]  # the detector judged and skipped it
    assert 6 in run_state(ckpt, "samples")  # the milestone sample was taken
    return ckpt


def assert_resumed_exactly(root: Path, name: str, reference: dict) -> None:
    ckpt = assert_matches_reference(root, name, reference, steps=STEPS)
    for section in ("guards", "samples", "lr_cooldown"):  # the rest holds wall-clock seconds and dollars
        assert_same(run_state(ckpt, section), run_state(reference, section), section)


def sweep(steps, fast) -> list:
    return [k if k in fast else pytest.param(k, marks=pytest.mark.slow) for k in steps]


@pytest.mark.parametrize("step", sweep(range(STEPS), SIGTERM_FAST))
def test_sigterm_at_any_step_saves_the_next_and_resumes_bitwise_equal(root, data_cache, reference, step):
    name = f"sigterm-{step}"
    (root / name).mkdir()
    cmd = args(root, data_cache, name, *fault(root / name, "sigterm", step=step))
    first = run(cmd)
    # A stop on the final step saves it, runs the last validation and ends the run (exit 0): nothing to resume.
    assert first.code == (0 if step == STEPS - 1 else EXIT_PREEMPTED), first.tail()
    assert last(root, name)["global_step"] == step + 1
    again = run(cmd)  # the same command continues (a finished run: it ends at once)
    assert again.code == 0, again.tail()
    assert_resumed_exactly(root, name, reference)


@pytest.mark.parametrize("step", sweep(SIGKILL_STEPS, SIGKILL_FAST))
def test_sigkill_at_a_step_replays_from_the_last_checkpoint_bitwise_equal(root, data_cache, reference, step):
    name = f"sigkill-{step}"
    (root / name).mkdir()
    cmd = args(root, data_cache, name, *fault(root / name, "sigkill", step=step))
    first = run(cmd)
    assert first.code == -signal.SIGKILL, first.tail()
    saved = root / name / "checkpoints/last.ckpt"
    assert (last(root, name)["global_step"] if saved.exists() else None) == (8 if step >= 8 else None)
    again = run(cmd)
    assert again.code == 0, again.tail()
    assert_resumed_exactly(root, name, reference)
