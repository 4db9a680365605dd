"""Test-only loss spikes, added to a run as `+callbacks.spike._target_=tests.faults_spike.SpikeFault ...`.

The loss of a spiking step is multiplied by `factor` (finite: the non-finite guard does not see it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import lightning.pytorch as pl


class SpikeFault(pl.Callback):
    """action:
    once    step `step` spikes, once across restarts (a transient fault);
    data    steps [step, step + count) of the first run spike, and their batches are remembered in `marker`:
            from then on any batch equal to one of them spikes, in any process (bad data, which only
            skipping it cures);
    always  every step from `step` on spikes (broken weights: skipping data cannot help).
    `rank`: spike on that rank only (under torchrun; every rank when None)."""

    def __init__(
        self,
        action: str,
        marker: str,
        step: int = 0,
        count: int = 1,
        factor: float = 50.0,
        rank: int | None = None,
    ) -> None:
        self.action, self.marker, self.step, self.count = action, Path(marker), step, count
        self.factor, self.rank = factor, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return
        if self.action == "once":
            spike = step == self.step and not self.marker.exists()
            if spike:
                self.marker.write_text("fired")
        elif self.action == "data":
            spike = self.poisoned(batch, step)
        elif self.action == "always":
            spike = step >= self.step
        else:
            raise ValueError(f"unknown SpikeFault action {self.action!r}")
        if spike:
            loss, factor = type(pl_module).loss, self.factor
            pl_module.loss = lambda b: loss(pl_module, b) * factor  # this batch only

    def setup(self, trainer, pl_module, stage) -> None:
        self.first_run = not self.marker.exists()  # only the first process picks the bad batches
        if self.first_run and self.action == "data":
            self.marker.write_text("[]")

    def poisoned(self, batch, step: int) -> bool:
        """Whether `batch` is bad data: one of the batches at the first run's steps [step, step + count)."""
        digest = hashlib.sha256(batch.cpu().numpy().tobytes()).hexdigest()
        bad = json.loads(self.marker.read_text())
        if self.first_run and self.step <= step < self.step + self.count:
            bad.append(digest)
            self.marker.write_text(json.dumps(bad))
        return digest in bad

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.__dict__.pop("loss", None)
