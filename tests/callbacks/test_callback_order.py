"""The run's callbacks run in the order their `priority` gives (lm.callbacks.order), which is the order the
run listed them in before order was data: the cost meter before its readers, the consensus after its voters,
`cfg.callbacks` after lm's own, the checkpoint callback and the progress bar last."""

import lightning.pytorch as pl
import pytest

from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.order import DEFAULT_PRIORITY, by_priority
from lm.config import to_objects
from lm.engine.activation_checkpointing import Decision
from lm.engine.module import LMModule
from lm.numbers import run_plan
from lm.run.build import build_callbacks

GUARDS = [
    "EarlyStopper",
    "SpotGuard",
    "ThroughputAlarm",
    "NonFiniteGuard",
    "SpikeGuard",
    "Consensus",
]
LR = "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"
TIMER = "+callbacks.timer._target_=lightning.pytorch.callbacks.Timer"


def callback_names(cfg, run_dir, deferred: bool = False) -> list[str]:
    """The class names of the run's callbacks, in the order `build_callbacks` hands them to the Trainer."""
    cfg = to_objects(cfg)
    meter = CostMeter(
        tokens_per_device_step=1, flops_per_token=1.0, peak_flops=None, price_per_hour=0.0, log_every=1
    )
    decide = (lambda: Decision(0, "test")) if deferred else None
    module = LMModule(cfg.model, cfg.optim)
    plan = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, cfg.phases.phases)
    callbacks = build_callbacks(cfg, plan, meter, run_dir, module, resumed=False, decide=decide)
    return [type(c).__name__ for c in callbacks]


@pytest.mark.parametrize(
    ("overrides", "deferred", "expected"),
    [
        (
            [],
            False,
            ["ResumeCheck", "CostMeter", "PhaseTracker", "MilestoneSampler", *GUARDS, "KeepTokenizer",
             "RunCheckpoint"],
        ),
        (
            ["sampling=off", "phases.phases=[]", "trainer.enable_progress_bar=true"],
            False,
            ["ResumeCheck", "CostMeter", *GUARDS, "KeepTokenizer", "RunCheckpoint", "LossProgressBar"],
        ),
        (
            ["phases=smoke", "evals=small", "trainer.enable_progress_bar=true", LR, TIMER],
            True,
            ["ResumeCheck", "CostMeter", "ActivationCheckpointingStride", "PhaseTracker", "MilestoneSampler",
             "BenchmarkEvaluator", *GUARDS, "KeepTokenizer", "LearningRateMonitor", "Timer", "RunCheckpoint",
             "LossProgressBar"],
        ),
        (
            [TIMER, LR, "sampling=off"],
            True,
            ["ResumeCheck", "CostMeter", "ActivationCheckpointingStride", "PhaseTracker", *GUARDS, "KeepTokenizer", "Timer",
             "LearningRateMonitor", "RunCheckpoint"],
        ),
    ],
)  # fmt: skip
def test_callbacks_run_in_the_order_the_run_listed_them(tiny_cfg, tmp_path, overrides, deferred, expected):
    assert callback_names(tiny_cfg(*overrides), tmp_path, deferred) == expected


def test_a_callback_of_ones_own_takes_its_place_from_its_priority():
    class Early(pl.Callback):
        priority = 195  # between the ResumeCheck (200) and the CostMeter (190)

    class Plain(pl.Callback):
        pass

    first, second = Plain(), Plain()
    meter = CostMeter(
        tokens_per_device_step=1, flops_per_token=1.0, peak_flops=None, price_per_hour=0.0, log_every=1
    )
    ordered = by_priority([first, meter, second, Early()])
    assert [type(c).__name__ for c in ordered] == ["Early", "CostMeter", "Plain", "Plain"]
    assert ordered[2] is first and ordered[3] is second  # equal priorities keep their listed order
    assert DEFAULT_PRIORITY < 10  # below every lm callback that runs at step boundaries
