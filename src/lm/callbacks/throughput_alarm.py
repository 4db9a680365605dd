"""ThroughputAlarm: a host that slows down is often about to go; save a checkpoint while it still can."""

from __future__ import annotations

import logging
import statistics
import time

import lightning.pytorch as pl
import torch

log = logging.getLogger(__name__)


class ThroughputAlarm:
    """Tokens/s below `ratio` x the run's own baseline for `window_s` seconds: save a checkpoint and warn.

    The seed's spot monitor used 60% for 2 minutes. The baseline is the median of `baseline_steps` steps after
    `warmup` steps of each invocation (a restart may land on a different GPU). Intervals that contain a
    validation or a checkpoint write are not throughput and are ignored. The step boundary asks for this
    rank's vote (`vote`) at every optimizer step and, once the ranks agree (the save is collective), calls
    `alarm` and saves.
    """

    def __init__(
        self, ratio: float = 0.6, window_s: float = 120.0, baseline_steps: int = 20, warmup: int = 5
    ):
        self.ratio, self.window_s = ratio, window_s
        self.baseline_steps, self.warmup = baseline_steps, warmup
        self.baseline: float | None = None
        self.alarms = 0
        self._samples: list[float] = []
        self._t: float | None = None
        self._slow_since: float | None = None
        self._interrupted = False
        self._saved_step: int | None = -1
        self._rate: float | None = None  # the last throughput observed, for the alarm's message

    def interrupt(self) -> None:
        """A validation started: the interval it falls in is not throughput."""
        self._interrupted = True

    def vote(self, trainer: pl.Trainer, batch: torch.Tensor, saved_step: int | None) -> bool:
        """This rank's vote at the end of an optimizer step: slow for the whole window. `saved_step`: the
        saver's newest step (a save since the last step interrupted this interval)."""
        now = time.monotonic()
        interrupted = self._interrupted or saved_step != self._saved_step
        self._interrupted, self._saved_step = False, saved_step
        last, self._t = self._t, now
        if last is None or interrupted:
            return False
        tokens = batch.numel() * trainer.accumulate_grad_batches * trainer.world_size
        return self.observe(tokens / max(now - last, 1e-9), now)

    def observe(self, tokens_per_s: float, now: float) -> bool:
        """Feed one step's throughput; True when it has been low for the whole window."""
        if self.baseline is None:
            self._samples.append(tokens_per_s)
            if len(self._samples) >= self.warmup + self.baseline_steps:
                self.baseline = statistics.median(self._samples[self.warmup :])
                log.info("throughput baseline: %.0f tokens/s", self.baseline)
            return False
        self._rate = tokens_per_s
        if tokens_per_s >= self.ratio * self.baseline:
            self._slow_since = None
            return False
        self._slow_since = self._slow_since or now
        return now - self._slow_since >= self.window_s

    def alarm(self) -> None:
        """The ranks agreed on a slow window (the step boundary saves next): warn and re-arm, another full
        window before the next alarm."""
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
