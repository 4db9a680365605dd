"""Test-only fault injection, added to a run as `+callbacks.fault._target_=tests.faults.Fault ...`.

Each fault fires once per `marker` file (so the restarted run trains undisturbed) at optimizer step `step`.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lm.checkpointing import TMP_MARK


class Fault(pl.Callback):
    """action: sigterm | sigusr1 | sigkill | sigterm_group | sigterm_in_val | sigterm_in_save |
    sigkill_in_save | disk_full | nan | nan_always | drop_grads | sigkill_random | slow |
    sigkill_after_upload (at `step`, once a checkpoint is on object storage). `rank`: fire on that rank only
    (under torchrun; every rank when None)."""

    def __init__(
        self, action: str, marker: str, step: int = 0, seconds: float = 0.0, rank: int | None = None
    ) -> None:
        self.action, self.marker, self.step, self.seconds = action, Path(marker), step, seconds
        self.rank = rank

    def fire(self) -> bool:
        """True the first time across restarts (on `rank` only, when one is named)."""
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return False
        if self.marker.exists():
            return False
        self.marker.write_text(self.action)
        return True

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.action in ("sigterm_in_save", "sigkill_in_save", "disk_full"):
            self.wrap_save(trainer)
        if self.action == "sigkill_random" and not self.marker.exists():
            # A kill at a random moment (in a step, in validation, in a checkpoint write, in data loading).
            delay = random.Random(self.step).uniform(0.0, self.seconds)
            threading.Timer(delay, self.kill_now).start()

    def kill_now(self) -> None:
        if self.fire():
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap_save(self, trainer: pl.Trainer) -> None:
        io = trainer.strategy.checkpoint_io
        original_save = io.save_checkpoint
        fault = self

        def save(checkpoint: dict[str, Any], path, storage_options=None) -> None:
            if checkpoint["global_step"] < fault.step or not fault.fire():
                return original_save(checkpoint, path, storage_options)
            if fault.action == "sigterm_in_save":
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint is being written
                return original_save(checkpoint, path, storage_options)
            if fault.action == "sigkill_in_save":
                tmp = io.temporary_path(Path(path))
                with open(tmp, "wb") as f:  # half a checkpoint on disk, then the process is gone
                    torch.save(checkpoint, f)
                    f.truncate(f.tell() // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            # disk_full: the disk fills up half-way through the write, inside AtomicCheckpointIO.
            real_save = torch.save

            def full_disk_save(obj, f, *args, **kwargs):
                if TMP_MARK in getattr(f, "name", ""):
                    f.write(b"\0" * 1000)
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_save(obj, f, *args, **kwargs)

            torch.save = full_disk_save
            try:
                return original_save(checkpoint, path, storage_options)
            finally:
                torch.save = real_save

        io.save_checkpoint = save

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.action == "nan_always" and trainer.global_step >= self.step:
            self.poison(pl_module)  # bad data or diverged weights: every step from here on
            return
        if self.action == "sigkill_after_upload" and trainer.global_step >= self.step and self.fire():
            uploader = trainer.checkpoint_callback.uploader
            deadline = time.monotonic() + 120
            while uploader.uploaded_step is None and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        at_step = ("sigterm", "sigusr1", "sigkill", "sigterm_group", "nan", "drop_grads")
        if self.action not in at_step or trainer.global_step != self.step or not self.fire():
            return
        if self.action == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step: the forward and backward are still to run
        elif self.action == "sigusr1":
            os.kill(os.getpid(), signal.SIGUSR1)
        elif self.action == "sigterm_group":
            os.killpg(os.getpgid(0), signal.SIGTERM)  # like a shutdown: the DataLoader workers get it too
        elif self.action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "nan":
            self.poison(pl_module)  # a transient fault: this step only, and only once
        elif self.action == "drop_grads":
            self._drop = True

    def poison(self, pl_module) -> None:
        loss = type(pl_module).loss
        pl_module.loss = lambda batch: loss(pl_module, batch) * float("nan")  # this step only

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.__dict__.pop("loss", None)
        if self.action != "slow":
            return
        now, last = time.monotonic(), getattr(self, "_last", None)
        self._last = now
        if trainer.global_step < self.step:
            if last is not None:
                self._intervals = [*getattr(self, "_intervals", []), now - last]
            return
        # A host several times slower than this run's own pace and than the alarm's baseline, so the test
        # holds however the machine's load changed between the baseline and now.
        intervals = sorted(getattr(self, "_intervals", [0.1]))
        alarm = next((c for c in trainer.callbacks if type(c).__name__ == "ThroughputAlarm"), None)
        tokens = batch.numel() * trainer.accumulate_grad_batches * trainer.world_size
        baseline_step = tokens / alarm.baseline if alarm is not None and alarm.baseline else 0.0
        time.sleep(max(self.seconds, 4 * intervals[len(intervals) // 2], 4 * baseline_step))
        self._last = time.monotonic()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if getattr(self, "_drop", False):  # the reference for a skipped step: what skipping must equal
            self._drop = False
            for p in pl_module.parameters():
                p.grad = None

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if (
            self.action == "sigterm_in_val"
            and not trainer.sanity_checking
            and trainer.global_step >= self.step
            and self.fire()
        ):
            os.kill(os.getpid(), signal.SIGTERM)
