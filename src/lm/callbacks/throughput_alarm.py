"""ThroughputAlarm: a host that slows down is often about to go; save a checkpoint while it still can."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import lightning.pytorch as pl

from lm.callbacks.consensus import Consensus
from lm.callbacks.steps import StepWatch
from lm.checkpoint.callback import RunCheckpoint

log = logging.getLogger(__name__)


class ThroughputAlarm(pl.Callback):
    """Tokens/s below `ratio` x the run's own baseline for `window_s` seconds: save a checkpoint and warn.

    The seed's spot monitor used 60% for 2 minutes. The baseline is the median of `baseline_steps` steps after
    `warmup` steps of each invocation (a restart may land on a different GPU). Intervals that contain a
    validation or a checkpoint write are not throughput and are ignored. The save is collective, so ranks
    agree on it through `consensus` (under DDP/FSDP the alarm acts one step after a rank raised it).
    """

    def __init__(
        self,
        ratio: float = 0.6,
        window_s: float = 120.0,
        baseline_steps: int = 20,
        warmup: int = 5,
        consensus: Consensus | None = None,
        saver: RunCheckpoint | None = None,
    ):
        self.saver = saver
        """The run's saver: the alarm's checkpoint (None: warn only)."""
        self.ratio, self.window_s = ratio, window_s
        self.baseline_steps, self.warmup = baseline_steps, warmup
        self.baseline: float | None = None
        self.alarms = 0
        self._samples: list[float] = []
        self._t: float | None = None
        self.steps = StepWatch()
        self._slow_since: float | None = None
        self._interrupted = False
        self._saved_step = -1
        self._rate: float | None = None  # the last throughput observed, for the alarm's message
        self.consensus = consensus or Consensus()
        self.consensus.register("slow")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.consensus.attach(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._interrupted = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.steps.ended(trainer):
            return
        now = time.monotonic()
        saved = self.saver.saved_step if self.saver is not None else None
        interrupted = self._interrupted or saved != self._saved_step
        self._interrupted, self._saved_step = False, saved
        last, self._t = self._t, now
        if last is None or interrupted:
            if self.baseline is not None and self.consensus.decide(trainer, "slow", False):
                self.alarm(trainer)  # another rank's alarm (or this one's, agreed a step late)
            return
        tokens = batch.numel() * trainer.accumulate_grad_batches * trainer.world_size
        self.observe(tokens / max(now - last, 1e-9), now, trainer)

    def observe(self, tokens_per_s: float, now: float, trainer: pl.Trainer) -> None:
        """Feed one step's throughput; fires the alarm when it has been low for the whole window."""
        if self.baseline is None:
            self._samples.append(tokens_per_s)
            if len(self._samples) >= self.warmup + self.baseline_steps:
                self.baseline = statistics.median(self._samples[self.warmup :])
                log.info("throughput baseline: %.0f tokens/s", self.baseline)
            return
        fire = False
        if tokens_per_s >= self.ratio * self.baseline:
            self._slow_since = None
        else:
            self._slow_since = self._slow_since or now
            fire = now - self._slow_since >= self.window_s
        self._rate = tokens_per_s
        # The save below is collective: every rank acts on the agreed flag (Consensus: no host sync).
        if self.consensus.decide(trainer, "slow", fire):
            self.alarm(trainer)

    def alarm(self, trainer: pl.Trainer) -> None:
        """Save a checkpoint now, on every rank, and re-arm: another full window before the next alarm."""
        self._slow_since = None
        self.alarms += 1
        log.warning(
            "throughput (%.0f tokens/s here) has been below %.0f%% of the %.0f tokens/s baseline for %g s on "
            "a rank: saving a checkpoint now (the host may be failing or about to be reclaimed)",
            self._rate or 0.0,
            100 * self.ratio,
            self.baseline or 0.0,
            self.window_s,
        )
        if self.saver is not None:
            self.saver.save_now(trainer)
