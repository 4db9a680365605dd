"""SpikeGuard: a finite loss far above its running median is skipped like a NaN step; spikes that keep coming
roll back to the checkpoint and skip the data trained on since it.

Lightning's `SpikeDetection` (and llm-foundry's `KillLossSpike`) compare each loss with a running *mean* and
stop the run. Neither is reused here: both read the loss on the host at every batch (Lightning adds a
barrier and an all-reduce read on top), a mean is dragged up by the outlier it should flag, they judge
micro-batches rather than optimizer steps, and stopping is all they do; nothing skips the step or the data.
What is kept from them is the shape of the rule: a multiple of a running statistic (llm-foundry's 2x),
silent until its window is full.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lm.base.private_api import loss_scale
from lm.callbacks.host_copy import HostCopy
from lm.callbacks.nonfinite import resume_step, roll_back, skip_update, skips_on_device
from lm.checkpoint.callback import RunCheckpoint
from lm.checkpoint.run_state import GuardState, RunState
from lm.engine.module import DeviceScalar
from lm.store import rundir

log = logging.getLogger(__name__)


class SpikeDetector:
    """The rule, on host numbers: a loss above `factor` x the median of the last `window` accepted losses is a
    spike; `max_spikes` spikes within `window` steps call for a rollback. `factor=None` never calls one.

    Off until the window is full (the first steps' loss falls fast and its median means little). Spikes and
    non-finite losses never enter the window, so a run of spikes cannot raise the bar it is judged against.
    """

    def __init__(
        self, factor: float | None, window: int, max_spikes: int, guards: GuardState | None = None
    ) -> None:
        self.factor, self.window, self.max_spikes = factor, window, max_spikes
        self.guards = guards if guards is not None else GuardState()
        """The window, the recent spikes and the count live in RunState's guard section."""

    @property
    def losses(self) -> deque[float]:
        return self.guards.spike_losses

    @property
    def recent(self) -> deque[int]:
        """Steps of the spikes within the last `window` steps."""
        return self.guards.spike_recent

    @property
    def spikes(self) -> int:
        return self.guards.spikes

    def threshold(self) -> float | None:
        """The loss above which the next step is a spike; None while the window fills."""
        if self.factor is None or len(self.losses) < self.window:
            return None
        return self.factor * statistics.median(self.losses)

    def observe(self, step: int, loss: float, spike: bool) -> bool:
        """Account for step `step` (its loss, and whether it was judged a spike); True to roll back."""
        if not spike:
            if math.isfinite(loss):  # a NaN step is the non-finite guard's
                self.losses.append(loss)
                while len(self.losses) > self.window:
                    self.losses.popleft()
            return False
        self.guards.spikes += 1
        self.recent.append(step)
        while self.recent[0] <= step - self.window:
            self.recent.popleft()
        return len(self.recent) >= self.max_spikes


class SpikeGuard:
    """Skip optimizer steps whose loss spikes; `max_spikes` within the window roll back and skip their data.

    The step's loss (the global batch's: summed over micro-batches, averaged over ranks, so every rank takes
    the same decision) is compared on the device with a threshold the host computed from earlier steps, so
    no step waits for its own loss. With a fused AdamW the verdict joins the non-finite guard's `found_inf`
    (either skips the update on the device); otherwise the gradients are dropped (a host read, as the
    non-finite guard's unfused path makes). The loss and verdict are staged to host memory and read one step
    later, when the device has long finished them, to update the window and count.

    The step boundary (`lm.callbacks.step`) calls it: `add` at each backward, `judge` before each optimizer
    step, `settle` a step later. A rollback exits 75 without saving and records the data window [checkpoint step, last spike step] in
    `checkpoints/rollbacks.json`; the restart reads it before its data loader is built, the sampler moves the
    stream past that window, and every later checkpoint carries the list. A second rollback to the same
    checkpoint exits 65 (counted with the non-finite guard's: skipping the data did not help). With
    `factor=None` (`guards.spike_factor=null`) nothing is judged, but skipped windows still apply: a run that
    rolled back keeps its data order.
    """

    def __init__(
        self,
        factor: float | None,
        window: int,
        max_spikes: int,
        ckpt_dir: str | Path,
        run_state: RunState,
        saver: RunCheckpoint | None = None,
    ) -> None:
        self.saver = saver
        """The run's saver: the newest checkpoint, which a rollback returns to."""
        self.guards = run_state.guards
        self.detector = SpikeDetector(factor, window, max_spikes, self.guards)
        self.spikes_scalar = DeviceScalar()  # train/spikes at every step, without a host-to-device copy
        self.ckpt_dir = Path(ckpt_dir)
        self._loss: torch.Tensor | None = None  # this optimizer step's loss so far
        self._pending: tuple[int, float | None, HostCopy] | None = None  # (step, threshold, [loss, spike])
        self._trainer: pl.Trainer | None = None
        self._start_step = 0

    def attach(self, trainer: pl.Trainer) -> None:
        """At setup, and again once a checkpoint's RunState is restored (which holds the checkpoint's windows;
        a rollback since it recorded its window in rollbacks.json only): hand the data module every window."""
        self._trainer = trainer
        self.use_skips(self.recorded_skips())

    def recorded_skips(self) -> list[list[int]]:
        """The data windows rollbacks.json lists (a rollback writes it before its exit)."""
        return (rundir.read_record(self.ckpt_dir / rundir.ROLLBACKS) or {}).get("skip_windows", [])

    @property
    def skip_windows(self) -> list[tuple[int, int]]:
        return self.guards.skip_windows

    def use_skips(self, windows: Iterable[Sequence[int]] = ()) -> None:
        """Add skipped data windows and hand them to the data module (after setup and the checkpoint restore,
        before the training loader is built: the sampler is made with them)."""
        self.guards.skip_windows = sorted(set(self.skip_windows) | {(int(a), int(b)) for a, b in windows})
        if self._trainer is not None and self._trainer.datamodule is not None:
            self._trainer.datamodule.skip_windows = list(self.skip_windows)

    def start(self, trainer: pl.Trainer) -> None:
        """At train start: the step a rollback returns to unless this process saves a later one."""
        self._start_step = trainer.global_step

    def add(self, trainer: pl.Trainer, loss: torch.Tensor) -> None:
        """A micro-batch's loss, at its backward: summed into the step's."""
        loss = loss.detach()  # already divided by the accumulation: the micro-batches sum to the step's mean
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # fp16: the hook sees the scaled loss; the scale tensor stays on the device
            loss = loss / loss_scale(scaler)
        self._loss = loss if self._loss is None else self._loss + loss

    def judge(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """This step's verdict, just before its optimizer step, on the device: skip it if its loss spikes."""
        pl_module.log("train/spikes", self.spikes_scalar(self.detector.spikes, pl_module.device))
        loss, self._loss = self._loss, None
        if loss is None:
            return
        loss = global_mean(trainer, loss.float())
        threshold = self.detector.threshold()
        spike = torch.isfinite(loss) & (loss > (math.inf if threshold is None else threshold))
        if threshold is not None:
            if skips_on_device(trainer, optimizer):
                skip_update(optimizer, trainer.global_step, spike)
            elif spike:  # a host read, only on the unfused path (CPU, fp16) and once the window is full
                for p in pl_module.parameters():
                    p.grad = None  # AdamW skips parameters without gradients: no update, no moment change
        self._pending = (trainer.global_step, threshold, HostCopy(torch.stack([loss, spike.float()])))

    def settle(self) -> None:
        """Read the staged loss and verdict of the last step: log a spike, update the window, roll back."""
        if self._pending is None or self._trainer is None:
            return
        (step, threshold, staged), self._pending = self._pending, None
        loss, spike = staged.value().tolist()
        roll = self.detector.observe(step, loss, bool(spike))
        if spike:
            log.warning(
                "step %d: loss %.4g is above %g x the median of the last %d losses (%.4g): a spike, step "
                "skipped (%d in this run)",
                step,
                loss,
                self.detector.factor,
                self.detector.window,
                threshold / self.detector.factor,
                self.detector.spikes,
            )
        if roll:
            start = resume_step(self.saver, self._start_step)
            what = f"{len(self.detector.recent)} loss spikes within {self.detector.window} steps"
            roll_back(self._trainer, self.ckpt_dir, start, what, skip=(start, step))


def global_mean(trainer: pl.Trainer, loss: torch.Tensor) -> torch.Tensor:
    """The mean of `loss` over ranks: one scalar all-reduce, queued on the device without a host wait (unlike
    `strategy.reduce`, which puts a barrier first)."""
    if trainer.world_size == 1 or not dist.is_initialized():
        return loss
    total = loss.clone()
    dist.all_reduce(total)
    return total / trainer.world_size
