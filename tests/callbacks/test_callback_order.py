"""The run's callbacks run in the order `build_callbacks` lists them, written there with the reasons: the resume
check first, then the step boundary (RunState's owner and the step's one written sequence), the meter's
clock, the observers and the stopper, `cfg.callbacks` after lm's own and before the saver, the progress bar
last. No `priority` integers, and no other callback of lm's acts around the optimizer step."""

import ast
from pathlib import Path

import pytest

from lm.callbacks.consensus import Consensus
from lm.callbacks.cost_meter import CostMeter
from lm.checkpoint.run_state import RunState
from lm.config import to_objects
from lm.engine.module import LMModule
from lm.numbers import run_plan
from lm.run.build import build_callbacks

LR = "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"
TIMER = "+callbacks.timer._target_=lightning.pytorch.callbacks.Timer"


def callback_names(cfg, run_dir) -> list[str]:
    """The class names of the run's callbacks, in the order `build_callbacks` hands them to the Trainer."""
    cfg = to_objects(cfg)
    meter = CostMeter(
        tokens_per_device_step=1,
        flops_per_token=1.0,
        peak_flops=None,
        price_per_hour=0.0,
        log_every=1,
        run_state=RunState(),
    )
    module = LMModule(cfg.model, cfg.optim)
    plan = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, cfg.phases.phases)
    callbacks = build_callbacks(cfg, plan, meter, run_dir, module, resumed=False, consensus=Consensus())
    return [type(c).__name__ for c in callbacks]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [],
            ["ResumeCheck", "StepBoundary", "CostMeter", "PhaseTracker", "MilestoneSampler", "EarlyStopper", "KeepTokenizer",
             "AfterOthers", "RunCheckpoint"],
        ),
        (
            ["sampling=off", "phases.phases=[]", "trainer.enable_progress_bar=true"],
            ["ResumeCheck", "StepBoundary", "CostMeter", "EarlyStopper", "KeepTokenizer", "AfterOthers", "RunCheckpoint", "LossProgressBar"],
        ),
        (
            ["phases=smoke", "evals=small", "trainer.enable_progress_bar=true", LR, TIMER],
            ["ResumeCheck", "StepBoundary", "CostMeter", "BenchmarkEvaluator", "PhaseTracker",
             "MilestoneSampler", "EarlyStopper", "KeepTokenizer", "LearningRateMonitor", "Timer", "AfterOthers", "RunCheckpoint",
             "LossProgressBar"],
        ),
        (
            [TIMER, LR, "sampling=off"],
            ["ResumeCheck", "StepBoundary", "CostMeter", "PhaseTracker", "EarlyStopper", "KeepTokenizer", "Timer",
             "LearningRateMonitor", "AfterOthers", "RunCheckpoint"],
        ),
    ],
)  # fmt: skip
def test_callbacks_run_in_the_order_the_run_listed_them(tiny_cfg, tmp_path, overrides, expected):
    assert callback_names(tiny_cfg(*overrides), tmp_path) == expected


def test_no_callback_orders_itself_by_a_priority_integer():
    src = Path(__file__).resolve().parents[2] / "src" / "lm"
    found = [
        f"{path.relative_to(src)}:{node.lineno}"
        for path in src.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "priority" for t in node.targets)
    ]
    assert found == []


STEP_HOOKS = {"on_train_batch_end", "on_before_optimizer_step", "on_before_backward", "on_after_backward"}


def test_the_step_is_written_in_one_callback():
    """Of the training core's callbacks, only StepBoundary acts around an optimizer step (the progress bar only
    draws); the guards, the stop signals, the alarm and the consensus are plain objects it calls."""
    src = Path(__file__).resolve().parents[2] / "src" / "lm"
    found = sorted(
        f"{path.relative_to(src)}:{cls.name}.{fn.name}"
        for path in [*(src / "callbacks").glob("*.py"), *(src / "checkpoint").glob("*.py")]
        for cls in ast.walk(ast.parse(path.read_text()))
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and fn.name in STEP_HOOKS
    )
    assert found == [
        "callbacks/progress.py:LossProgressBar.on_train_batch_end",
        "callbacks/step.py:StepBoundary.on_before_backward",
        "callbacks/step.py:StepBoundary.on_before_optimizer_step",
        "callbacks/step.py:StepBoundary.on_train_batch_end",
    ]


def test_callbacks_return_decisions_instead_of_setting_the_module_or_trainer():
    """No callback of lm's sets an attribute of the module, its model or the trainer, except Lightning's public
    `trainer.should_stop`: the LR cooldown lives in RunState, the activation checkpointing stride is the module's
    own decision (`LMModule.decide_activation_checkpointing`)."""
    src = Path(__file__).resolve().parents[2] / "src" / "lm"
    found = set()
    for path in [*(src / "callbacks").glob("*.py"), *(src / "checkpoint").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(target, ast.Attribute) and getattr(base, "id", None) in (
                    "pl_module",
                    "trainer",
                    "model",
                ):
                    found.add(ast.unparse(target))
    assert found == {"trainer.should_stop"}


DECISIONS = {"save_now", "save_checkpoint"}
"""Calls that save; assigning `trainer.should_stop` stops; raising `Preempted` or `Diverged` exits or rolls back."""


def decisions_of(cls: ast.ClassDef) -> list[str]:
    """The stops, saves and exits a class's methods decide, as `method: what`."""
    found = []
    for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef)):
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in DECISIONS:
                found.append(f"{fn.name}: {node.func.attr}")
            targets = node.targets if isinstance(node, ast.Assign) else []
            found += [f"{fn.name}: should_stop" for t in targets if getattr(t, "attr", None) == "should_stop"]
            if isinstance(node, ast.Raise) and node.exc is not None:
                name = getattr(getattr(node.exc, "func", node.exc), "id", None)
                if name in ("Preempted", "Diverged"):
                    found.append(f"{fn.name}: raise {name}")
    return found


def test_only_the_step_boundary_decides_a_stop_a_save_or_a_rollback():
    """Issue 54: the stopper stopped on its own at validation, the final save was RunCheckpoint's. Of lm's
    callbacks only StepBoundary (and `AfterOthers`, its hooks listed last) stops, saves or exits; the saver only
    carries a save out (`save_now` writes through `trainer.save_checkpoint`), and the guards and stop signals
    that roll back or exit are plain objects the boundary calls."""
    src = Path(__file__).resolve().parents[2] / "src" / "lm"
    found = sorted(
        f"{path.relative_to(src)}:{cls.name}.{what}"
        for path in src.rglob("*.py")
        for cls in ast.walk(ast.parse(path.read_text()))
        if isinstance(cls, ast.ClassDef) and any("Callback" in ast.unparse(b) for b in cls.bases)
        for what in decisions_of(cls)
    )
    assert found == [
        "callbacks/step.py:StepBoundary.final_save: save_now",
        "callbacks/step.py:StepBoundary.on_train_batch_end: save_now",
        "callbacks/step.py:StepBoundary.on_train_batch_end: save_now",
        "callbacks/step.py:StepBoundary.on_train_batch_end: save_now",
        "callbacks/step.py:StepBoundary.on_train_batch_end: should_stop",
        "callbacks/step.py:StepBoundary.stop_if_decided: should_stop",
        "checkpoint/callback.py:RunCheckpoint.save_now: save_checkpoint",
    ]


def test_run_state_is_constructed_in_one_place():
    """Issue 54: RunState was held by seven parts, four constructors making their own when none was passed.
    The run makes it once (`lm.run.train`) and hands it to every part that reads it; `run_state.py` itself
    only builds one from a checkpoint."""
    src = Path(__file__).resolve().parents[2] / "src" / "lm"
    found = sorted(
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if path.name != "run_state.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "RunState"
    )
    assert found == ["run/train.py"]
