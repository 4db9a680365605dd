"""The run's callbacks run in the order `build_callbacks` lists them, written there with the reasons: the resume
check and RunState's keeper first, the cost meter before its readers, the consensus after its voters,
`cfg.callbacks` after lm's own and before the saver, the progress bar last. No `priority` integers."""

import ast
from pathlib import Path

import pytest

from lm.callbacks.cost_meter import CostMeter
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
            ["ResumeCheck", "KeepRunState", "CostMeter", "PhaseTracker", "MilestoneSampler", *GUARDS, "KeepTokenizer",
             "RunCheckpoint"],
        ),
        (
            ["sampling=off", "phases.phases=[]", "trainer.enable_progress_bar=true"],
            False,
            ["ResumeCheck", "KeepRunState", "CostMeter", *GUARDS, "KeepTokenizer", "RunCheckpoint", "LossProgressBar"],
        ),
        (
            ["phases=smoke", "evals=small", "trainer.enable_progress_bar=true", LR, TIMER],
            True,
            ["ResumeCheck", "KeepRunState", "CostMeter", "ActivationCheckpointingStride", "PhaseTracker", "MilestoneSampler",
             "BenchmarkEvaluator", *GUARDS, "KeepTokenizer", "LearningRateMonitor", "Timer", "RunCheckpoint",
             "LossProgressBar"],
        ),
        (
            [TIMER, LR, "sampling=off"],
            True,
            ["ResumeCheck", "KeepRunState", "CostMeter", "ActivationCheckpointingStride", "PhaseTracker", *GUARDS, "KeepTokenizer", "Timer",
             "LearningRateMonitor", "RunCheckpoint"],
        ),
    ],
)  # fmt: skip
def test_callbacks_run_in_the_order_the_run_listed_them(tiny_cfg, tmp_path, overrides, deferred, expected):
    assert callback_names(tiny_cfg(*overrides), tmp_path, deferred) == expected


def test_no_callback_orders_itself_by_a_priority_integer():
    src = Path(__file__).resolve().parents[2] / "src" / "lm"
    found = [
        f"{path.relative_to(src)}:{node.lineno}"
        for path in src.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "priority" for t in node.targets)
    ]
    assert found == []
