"""Loss spikes: a finite loss far above its running median is skipped like a NaN step; repeated spikes roll
back and skip the data that caused them. Real tiny runs with faults from `tests/faults_spike.py`."""

import json
import math
import shutil
from pathlib import Path

import pytest

from lm.base.exits import EXIT_DIVERGED, EXIT_PREEMPTED, Refused
from lm.callbacks.spike import SpikeDetector
from lm.checkpoint.run_state import RunState
from lm.config import GuardConfig
from lm.data.dataset import StepSampler
from lm.run import build
from lm.run import train as lm_train

from ..conftest import train_in_process as train
from ..engine import test_distributed as distributed
from . import test_sync as sync
from .test_stop_signals import assert_same, fault, last, overrides

SPIKES = ["guards.spike_window=5"]  # armed from step 5 of a 20-step run (the default 50 would never arm)


def spike_fault(root: Path, action: str, step: int, count: int = 1, rank: int | None = None) -> list[str]:
    node = "+callbacks.spike"
    return [
        f"{node}._target_=tests.faults_spike.SpikeFault",
        f"{node}.action={action}",
        f"{node}.step={step}",
        f"{node}.count={count}",
        f"{node}.marker={root / f'spike-{action}-{step}.fired'}",
        *([f"{node}.rank={rank}"] if rank is not None else []),
    ]


def guard_state(ckpt: dict) -> dict:
    return ckpt["run_state"]["guards"]


# -- the detector and the sampler, on synthetic numbers --------------------------------------------------


def feed(detector: SpikeDetector, losses: list[float], start: int = 0) -> list[tuple[int, bool, bool]]:
    """(step, spike, roll back) per loss, judged as the guard judges it: the threshold first, then observe."""
    out = []
    for step, loss in enumerate(losses, start):
        threshold = detector.threshold()
        spike = threshold is not None and math.isfinite(loss) and loss > threshold
        out.append((step, spike, detector.observe(step, loss, spike)))
    return out


def test_detector_is_silent_until_its_window_is_full_and_on_a_falling_noisy_loss():
    detector = SpikeDetector(factor=2.0, window=5, max_spikes=3)
    assert feed(detector, [100.0, 1.0, 1.0, 1.0])[0][1] is False  # no threshold yet, whatever the loss
    assert detector.threshold() is None
    noisy = [6.2 - 0.02 * i + (0.3 if i % 3 == 0 else -0.2) for i in range(200)]
    assert not any(spike for _, spike, _ in feed(SpikeDetector(2.0, 5, 3), noisy))


def test_detector_flags_a_spike_keeps_it_out_of_the_window_and_ignores_nan():
    detector = SpikeDetector(factor=2.0, window=5, max_spikes=3)
    judged = feed(detector, [3.0, 3.1, 2.9, 3.0, 3.05, 9.0, float("nan"), 3.0])
    assert [spike for _, spike, _ in judged] == [False] * 5 + [True, False, False]
    assert detector.spikes == 1 and 9.0 not in detector.losses and len(detector.losses) == 5
    assert detector.threshold() == pytest.approx(2.0 * 3.0)


def test_detector_rolls_back_on_max_spikes_within_its_window_only():
    in_a_row = feed(SpikeDetector(2.0, 5, 3), [3.0] * 5 + [50.0] * 3)
    assert [roll for _, _, roll in in_a_row] == [False] * 7 + [True]
    # Three spikes, but never three within any 5 steps: skipped, no rollback.
    spread = feed(SpikeDetector(2.0, 5, 3), [3.0] * 5 + [50.0, 3.0, 3.0, 50.0, 3.0, 3.0, 3.0, 50.0])
    assert sum(spike for _, spike, _ in spread) == 3 and not any(roll for _, _, roll in spread)


def test_detector_state_round_trips_and_null_factor_never_fires():
    run = RunState()
    detector = SpikeDetector(2.0, 5, 3, run.guards)
    feed(detector, [3.0] * 5 + [40.0])
    again = RunState()
    restored = SpikeDetector(2.0, 5, 3, again.guards)
    again.load(run.snapshot())  # in place: the detector holding the section sees the restored window
    assert feed(restored, [40.0], start=6) == feed(detector, [40.0], start=6)
    assert not any(spike for _, spike, _ in feed(SpikeDetector(None, 5, 3), [3.0] * 5 + [1e6]))


def test_spot_config_refuses_a_factor_that_flags_ordinary_losses():
    with pytest.raises(Refused, match=r"guards.spike_factor=0.9 .* above 1 .* guards.spike_factor=null"):
        GuardConfig(spike_factor=0.9)
    with pytest.raises(Refused, match="window of at least 3"):
        GuardConfig(spike_window=2)


def batches(sampler: StepSampler, n: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_skips_a_data_window_as_a_pure_function_of_seed_step_and_skips():
    plain = batches(StepSampler(1000, 4, seed=3, accumulate=2), 40)  # 20 steps of 2 micro-batches
    skipped = batches(StepSampler(1000, 4, seed=3, accumulate=2, skips=[(6, 11)]), 40)
    assert skipped[:12] == plain[:12]  # steps 0-5 unchanged
    assert skipped[12:14] == plain[24:26]  # step 6 trains on what step 12 would have: 6-11 are never seen
    resumed = batches(StepSampler(1000, 4, seed=3, accumulate=2, skips=[(6, 11)], start_step=8), 4)
    assert resumed == skipped[16:20]
    with pytest.raises(ValueError, match="first <= last"):
        StepSampler(1000, 4, skips=[(5, 4)])


# -- real runs ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_healthy_run_counts_zero_spikes_and_reports_them(root, data_cache):
    name = "healthy"
    assert train(overrides(root, data_cache, name, *SPIKES)) == 0
    state = guard_state(last(root, name))
    assert state["spikes"] == 0 and len(state["spike_losses"]) == 5  # armed, silent
    assert "| loss spikes skipped | 0 " in (root / name / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["direct", "on-device"])
def test_single_spike_is_skipped_like_dropping_that_steps_gradients(root, data_cache, fused):
    skipped, dropped = f"spike-skipped-{fused}", f"spike-reference-{fused}"
    for name, faults in [
        (skipped, spike_fault(root / skipped, "once", step=9)),
        (dropped, fault(root / dropped, "drop_grads", step=9)),
    ]:
        (root / name).mkdir(parents=True)
        assert train(overrides(root, data_cache, name, *SPIKES, f"optim.fused={fused}", *faults)) == 0
    ckpt = last(root, skipped)
    assert guard_state(ckpt)["spikes"] == 1
    assert_same(ckpt["state_dict"], last(root, dropped)["state_dict"], "weights")
    assert_same(ckpt["optimizer_states"], last(root, dropped)["optimizer_states"], "optimizer")
    assert "| loss spikes skipped | 1 " in (root / skipped / "report.md").read_text()


def test_spikes_from_bad_data_roll_back_skip_that_data_and_resume_exactly(root, data_cache):
    name = "spike-data"
    (root / name).mkdir(parents=True)
    # The batches of steps 9-11 are bad data: they spike in any process that trains on them.
    args = overrides(root, data_cache, name, *SPIKES, *spike_fault(root / name, "data", step=9, count=3))
    assert train(args) == EXIT_PREEMPTED  # three spikes within 5 steps: roll back to step 6
    assert last(root, name)["global_step"] == 6
    rollbacks = root / name / "checkpoints/rollbacks.json"
    assert '"skip_windows"' in rollbacks.read_text()
    # The rerun starts at step 6 on the data of step 12: the bad batches never come back, so it finishes
    # (without the skip it would meet them again and exit 65).
    assert train(args) == 0
    final = last(root, name)
    assert final["global_step"] == 20
    assert guard_state(final)["skip_windows"] == [[6, 11]]
    assert guard_state(final)["spikes"] == 0
    assert "skipped the data of steps 6-11" in (root / name / "report.md").read_text()

    # Resuming again from a later checkpoint reproduces the weights bit for bit: the skip is in the
    # checkpoint (rollbacks.json is not copied).
    again = "spike-data-again"
    (root / again / "checkpoints").mkdir(parents=True)
    shutil.copy(root / name / "checkpoints/step-18.ckpt", root / again / "checkpoints")
    assert train(overrides(root, data_cache, again, *SPIKES)) == 0
    assert_same(last(root, again)["state_dict"], final["state_dict"], "weights")
    assert_same(last(root, again)["optimizer_states"], final["optimizer_states"], "optimizer")


@pytest.mark.slow
def test_spikes_that_skipping_data_cannot_cure_stop_after_one_rollback(root, data_cache):
    name = "spike-always"
    (root / name).mkdir(parents=True)
    args = overrides(root, data_cache, name, *SPIKES, *spike_fault(root / name, "always", step=9))
    assert train(args) == EXIT_PREEMPTED
    assert train(args) == EXIT_DIVERGED  # the same checkpoint again, though the data was skipped
    assert last(root, name)["global_step"] == 6
    assert json.loads((root / name / "checkpoints/rollbacks.json").read_text()) == {
        "6": 1,
        "skip_windows": [[6, 11]],
    }


@pytest.mark.slow
def test_armed_guard_skips_a_spike_without_reading_the_device_between_logging_steps(tiny_cfg, monkeypatch):
    """As on a GPU (fused AdamW): the spike is judged and skipped on the device, and read a step later from a
    staged host copy; the probe of tests/callbacks/test_sync.py sees no other read."""
    root = Path(tiny_cfg().run.root)
    cfg = tiny_cfg(*sync.HOT_PATH, *SPIKES, *spike_fault(root, "once", step=12))  # 12: not a logging step
    reads = sync.HostReads()
    factory = build.build_callbacks
    monkeypatch.setattr(build, "build_callbacks", lambda *a, **k: [sync.StepMarker(reads), *factory(*a, **k)])
    with reads:
        lm_train.main(cfg)
    assert not sync.hot_reads(reads.reads), f"host reads inside training steps: {sync.hot_reads(reads.reads)}"
    assert guard_state(last(root, cfg.run.name))["spikes"] == 1


@pytest.mark.slow
def test_a_spike_on_one_rank_is_skipped_by_every_rank(root, data_cache):
    """DDP (2 gloo ranks): rank 1's batch spikes at step 4. The guard judges the global batch's loss (averaged
    over ranks), so rank 0 skips too; judged on its own loss, rank 0 would apply the averaged gradient that
    rank 1's x50 loss dominates."""
    window = ["guards.spike_window=3", f"trainer.max_steps={distributed.STEPS}"]
    ddp = [
        "trainer=ddp",
        "trainer.accelerator=cpu",
        f"trainer.devices={distributed.W}",
        f"data.batch_size={distributed.B}",
    ]
    spiked = [*window, *ddp, *spike_fault(root, "once", step=4, rank=1)]
    distributed.launch(
        [*distributed.torchrun(distributed.W), *distributed.overrides(root, data_cache, "ddp-spike", *spiked)]
    )
    (root / "one").mkdir()
    one = [
        *window,
        "trainer=cpu",
        f"data.batch_size={distributed.W * distributed.B}",
        *fault(root / "one", "drop_grads", 4),
    ]
    assert train(distributed.overrides(root, data_cache, "one", *one)) == 0
    ckpt = distributed.last(root / "ddp-spike")
    assert guard_state(ckpt)["spikes"] == 1
    distributed.assert_close_weights(ckpt["state_dict"], distributed.last(root / "one")["state_dict"])
