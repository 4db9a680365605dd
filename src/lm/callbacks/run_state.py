"""KeepRunState: the one owner of a checkpoint's `RunState`: snapshotted when a save is staged, restored on
resume, before any other part of the step reads it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.nonfinite import NonFiniteGuard
from lm.callbacks.spike import SpikeGuard
from lm.checkpoint.resume_check import ResumeCheck
from lm.checkpoint.run_state import RUN_STATE, from_checkpoint, rng_state, set_rng_state


class KeepRunState(pl.Callback):
    """Writes `checkpoint["run_state"]` (Lightning's `on_save_checkpoint`, called as the checkpoint dict is
    built, i.e. when a save is staged) and restores it (`on_load_checkpoint`). Listed right after the resume
    check, so every later callback's load hook sees the restored record.

    At a save, in order: the meter starts charging checkpoint time; the guards settle the verdict of the step
    just taken (a checkpoint holds the counts up to its own step); then the deep snapshot with this moment's
    RNG and stream settings. A background write pickles that snapshot, never the live record."""

    def __init__(self, meter: CostMeter, guards: tuple[NonFiniteGuard | SpikeGuard, ...] = ()) -> None:
        self.meter = meter
        self.state = meter.run
        self.guards = guards

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.meter.switch("checkpoint")  # what follows is checkpoint time
        for guard in self.guards:
            guard.settle()
        settings = ResumeCheck.run_settings(trainer, pl_module)
        checkpoint[RUN_STATE] = self.state.snapshot(rng=rng_state(), settings=settings)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        record = from_checkpoint(checkpoint)
        if record is None:
            return
        startup = self.meter.before_restore()
        self.state.load(record)
        self.meter.restored(startup)
        if self.state.rng is not None:
            set_rng_state(self.state.rng)
