"""RunState: a checkpoint resumes weights, optimizer and scheduler (Lightning's keys) and one record of everything
else, snapshotted when the save is staged; nothing is saved under a callback's key.

The staging case is the one that broke before RunState: an asynchronous sharded save of step 6 whose write
finished after the run moved on held the phase row closed at step 8 and the stop decided at step 9, so a rerun
that lost the final save resumed at step 6 and stopped at once, mid-run, with that phase counted twice.
"""

import dataclasses
import shutil

from lm.checkpoint import files
from lm.checkpoint.run_state import RUN_STATE, RunState, from_checkpoint
from lm.store import rundir

from ..conftest import TINY
from ..harness import fault, run

LIGHTNING_KEYS = {
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "state_dict",
    "loops",
    "optimizer_states",
    "lr_schedulers",
    "hparams_name",
    "hyper_parameters",
    "callbacks",
}
"""What Lightning itself writes (weights, optimizer, scheduler, loops, hyper-parameters, and the callbacks'
states, which must be empty)."""

RUN = [
    "trainer.max_steps=12",
    "optim.total_steps=12",
    "optim.warmup_steps=2",
    "trainer.val_every_steps=9",
    "trainer.limit_val_batches=1",
    "checkpoint.every_n_steps=6",
    "+trainer.extra.num_sanity_val_steps=0",
    "phases.phases=[{name: first, end_step: 8}, {name: second, end_step: 12}]",
    "early_stopping.target_loss=100",  # met at the first validation (step 9): the run stops there
    "early_stopping.cooldown_fraction=0",
    "sampling=off",
]
ASYNC = [
    "trainer=fsdp",
    "trainer.devices=1",
    "trainer.accelerator=cpu",
    "checkpoint.format=sharded",
    "checkpoint.async_save=true",
]


def args(root, cache, name, *extra):
    return [*TINY, f"run.root={root}", f"data.cache_dir={cache}", f"run.name={name}", *RUN, *extra]


def test_a_checkpoint_holds_lightnings_keys_and_run_state_alone(tmp_path, data_cache):
    outcome = run(args(tmp_path, data_cache, "plain"))
    assert outcome.code == 0, outcome.tail()
    ckpt = files.read(tmp_path / "plain" / "checkpoints" / files.LAST)
    assert set(ckpt) - LIGHTNING_KEYS == {RUN_STATE}, sorted(set(ckpt) - LIGHTNING_KEYS)
    assert ckpt["callbacks"] == {}  # no callback saves state of its own
    assert set(ckpt[RUN_STATE]) == {f.name for f in dataclasses.fields(RunState)}
    state = ckpt[RUN_STATE]
    assert state["meter"]["step"] == ckpt["global_step"] == 9  # stopped by the target loss at step 9
    assert state["stopper"]["decision"]["stopped"] and state["stopper"]["decision"]["step"] == 9
    assert [row["end_step"] for row in state["phases"]["rows"]] == [8]
    assert state["rng"] is not None and state["settings"]["trainer.gradient_clip_val"] is not None


def test_an_async_save_finished_after_the_run_moved_on_holds_its_own_steps_state(tmp_path, data_cache):
    """Step 6's background write is held until the stop at step 9 was decided (and the phase closed at 8);
    its checkpoint holds step 6's state. Losing the final save, the rerun resumes at 6, trains on and stops
    at 9 again, with phase `first` counted once."""
    hold = fault(tmp_path, "hold_shard_write", step=6, seconds=3)  # released after step 9's validation
    outcome = run(args(tmp_path, data_cache, "async", *ASYNC, *hold))
    assert outcome.code == 0, outcome.tail()
    ckpt_dir = tmp_path / "async" / "checkpoints"
    step6 = files.read_meta(ckpt_dir / "step-6.ckpt")
    state = step6[RUN_STATE]
    assert step6["global_step"] == 6 and state["meter"]["step"] == 6
    assert state["stopper"]["decision"] is None, state["stopper"]["decision"]
    assert state["phases"]["rows"] == [] and state["phases"]["start"]["step"] == 0
    final = files.read_meta(ckpt_dir / files.LAST)[RUN_STATE]
    assert final["stopper"]["decision"]["step"] == 9 and len(final["phases"]["rows"]) == 1

    # The final save is lost (preempted mid-write, a full disk): the rerun resumes at step 6.
    shutil.rmtree(ckpt_dir / "step-9.ckpt")
    (ckpt_dir / files.LAST).unlink()
    (tmp_path / "async" / rundir.STOP).unlink()
    outcome = run(args(tmp_path, data_cache, "async", *ASYNC))
    assert outcome.code == 0, outcome.tail()
    assert "resuming from" in outcome.stdout + outcome.stderr
    again = files.read_meta(ckpt_dir / files.LAST)
    assert again["global_step"] == 9 and again[RUN_STATE]["stopper"]["decision"]["step"] == 9
    assert [row["end_step"] for row in again[RUN_STATE]["phases"]["rows"]] == [8]
    done = [r for r in rundir.read_phases(tmp_path / "async") if r["status"] == "done"]
    assert [int(r["end_step"]) for r in done] == [8]


def test_a_checkpoint_from_before_run_state_resumes_its_callbacks_state():
    legacy = {
        "callbacks": {
            "CostMeter": {"seconds": {"train": 3.0}, "tokens": 512, "step": 4, "restarts": 1},
            "NonFiniteGuard{'max_in_a_row': 3}": {"skipped": 2, "in_a_row": 1},
            "SpikeGuard": {
                "detector": {"losses": [4.0], "recent": [3], "spikes": 1},
                "skip_windows": [[1, 2]],
            },
            "EarlyStopper": {"points": [], "best": 4.5, "since_best": 1, "decision": None},
            "PhaseTracker": {"rows": [{"phase": 1}], "start": {"step": 4}},
            "MilestoneSampler": {"done": [2, 4]},
        },
        "lr_cooldown": (3, 2),
        "resume_settings": {"trainer.gradient_clip_val": 1.0},
    }
    state = RunState()
    state.load(from_checkpoint(legacy))
    assert (state.meter.tokens, state.meter.step, state.meter.seconds["train"]) == (512, 4, 3.0)
    assert (state.guards.skipped, state.guards.in_a_row, state.guards.spikes) == (2, 1, 1)
    assert list(state.guards.spike_losses) == [4.0] and state.guards.skip_windows == [(1, 2)]
    assert state.stopper.best == 4.5 and state.phases.rows == [{"phase": 1}] and state.samples == {2, 4}
    assert state.lr_cooldown == (3, 2) and state.settings == {"trainer.gradient_clip_val": 1.0}
