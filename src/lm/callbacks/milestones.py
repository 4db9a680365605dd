"""Milestones: the steps at which a run stops to look at its model (samples, benchmarks).

A milestone is an explicit step, every N steps (where the config has `every_n_steps`), each phase boundary,
and the last step of an invocation. The callbacks that act at milestones differ only in what they do there;
when is decided here once, so samples and benchmarks of one run always fall on the same steps.

What they do there is optional: a failure (an out-of-memory in generation, a benchmark file changed under the
run) is recorded (the log, `failures.jsonl`, TensorBoard's text tab, the report) and training goes on
(`attempt`). Work with a collective in it agrees on its failures across ranks before that collective (the
evaluator), so no rank is left in it alone.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lm.callbacks.cost_meter import CostMeter
from lm.config import PhaseConfig
from lm.engine.parallel import is_sharded
from lm.numbers.run_plan import phase_at
from lm.store import rundir

log = logging.getLogger(__name__)


class MilestoneCallback(Callback):
    """Calls `at_milestone(trainer, pl_module)` once per milestone step; `done` holds the steps handled.

    `cfg` needs `steps`, `at_phase_ends` and `at_last_step` (and may have `every_n_steps`)."""

    what = "milestone work"
    """What a failure record calls this work (`failures.jsonl`'s `what`)."""

    def __init__(self, cfg: Any, phases: list[PhaseConfig], meter: CostMeter, run_dir: Path) -> None:
        self.cfg = cfg
        self.phases = phases
        self.meter = meter
        self.run_dir = run_dir
        self.done: set[int] = set()

    def is_milestone(self, step: int, tokens: int) -> bool:
        """Whether optimizer step `step` (with `tokens` trained) is a milestone other than the last step."""
        every = getattr(self.cfg, "every_n_steps", None)
        if step in self.cfg.steps or (every and step % every == 0):
            return True
        if self.cfg.at_phase_ends and self.phases and step > 0:
            before = tokens - self.meter.ramp.tokens_of(step - 1)
            return phase_at(step, tokens, self.phases) != phase_at(step - 1, before, self.phases)
        return False

    def phase_name(self, step: int, tokens: int) -> str | None:
        """The phase the trained steps belong to (at a boundary: the phase that just ended); None without
        phases, "after the plan" past the last one."""
        if not self.phases:
            return None
        index = phase_at(step - 1, tokens - self.meter.ramp.tokens_of(step - 1), self.phases)
        return self.phases[index].name if index < len(self.phases) else "after the plan"

    def claim(self, trainer: pl.Trainer, what: str, instead: str) -> bool:
        """Marks this step done on every rank; True on the rank that should act (rank 0, unsharded weights)."""
        self.done.add(trainer.global_step)
        if not trainer.is_global_zero:
            return False
        if is_sharded(trainer.strategy):
            # Sharded weights need every rank in each forward; a rank-0-only forward would hang.
            log.warning("%s are skipped under FSDP; %s", what, instead)
            return False
        return True

    def at_milestone(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def attempt(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """This milestone's work; a failure on this rank is recorded and training goes on (it never ends a
        paid-for run). Rank-0-only work fails on rank 0 alone; the evaluator's collective agrees first."""
        try:
            self.at_milestone(trainer, pl_module)
        except Exception as e:
            self.meter.switch("train")  # the failed work's time was the eval bucket's
            record_failure(trainer, self.run_dir, self.what, e)

    # --- called by the step boundary ---------------------------------------------------------------------

    def at_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At each optimizer step, once the step boundary has counted it: act if it is a milestone."""
        step = trainer.global_step
        if step not in self.done and self.is_milestone(step, self.meter.state.tokens):
            self.attempt(trainer, pl_module)

    def at_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At train end, once the last step is saved: the last step's milestone."""
        if self.cfg.at_last_step and trainer.global_step > 0 and trainer.global_step not in self.done:
            self.attempt(trainer, pl_module)


def record_failure(trainer: pl.Trainer, run_dir: Path, what: str, error: BaseException) -> None:
    """Optional work that failed on this rank, recorded where a user looks: the log (with the traceback), and
    on rank 0 `failures.jsonl` (which the report lists) and TensorBoard's text tab."""
    step = trainer.global_step
    log.error(
        "%s at step %d failed on rank %d; training goes on without it:\n%s",
        what,
        step,
        trainer.global_rank,
        "".join(traceback.format_exception(error)),
    )
    if not trainer.is_global_zero:
        return
    why = f"{type(error).__name__}: {error}"
    rundir.append_failure(run_dir, {"step": step, "what": what, "rank": trainer.global_rank, "error": why})
    experiment = getattr(trainer.logger, "experiment", None)
    if hasattr(experiment, "add_text"):
        experiment.add_text("failures", f"{what} at step {step} failed: `{why}`", global_step=step)
