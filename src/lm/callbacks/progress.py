"""A progress bar that never makes the host wait for the device."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


class LossProgressBar(TQDMProgressBar):
    """Lightning's bar with the training loss, read from the device at logging steps only.

    A metric logged with `prog_bar=True` is copied to the host at every batch end for as long as the epoch
    lasts (ours is endless), and each copy waits for the device to finish all queued work. The logger
    already pays one copy at each logging step; the bar reads the loss there and shows it until the next.
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._loss: float | None = None
        self._read_at = -1

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # already counts the step this batch completed
        every = max(1, trainer.log_every_n_steps)
        if step % every == 0 and step != self._read_at and "train/loss" in trainer.callback_metrics:
            self._loss = float(trainer.callback_metrics["train/loss"])
            self._read_at = step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if self._loss is not None:
            metrics["loss"] = f"{self._loss:.3f}"
        return metrics
