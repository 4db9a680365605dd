"""Test-only fault injection, added to a run as `+callbacks.fault._target_=tests.faults.Fault ...`
(`tests.harness.fault` writes the overrides).

Each fault fires once per `marker` file (so the restarted run trains undisturbed) at optimizer step `step`.
The marker is written when the fault fires: its mtime is the moment the harness measures the exit from.
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
import numpy as np
import torch

from lm.checkpoint.callback import RunCheckpoint
from lm.checkpoint.formats import TMP_MARK

STOP_SIGNALS = {"sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1, "sigint": signal.SIGINT}
PHASES = ("val", "save", "upload")


def stop_signal(action: str, phase: str | None) -> signal.Signals | None:
    """The signal of `<signal>` (phase None) or `<signal>_in_<phase>` actions, e.g. sigint_in_upload."""
    name, _, where = action.partition("_in_")
    if name not in STOP_SIGNALS or (where or None) != phase:
        return None
    return STOP_SIGNALS[name]


def rank() -> int:
    """This process's rank: torchrun sets RANK, Lightning's launcher LOCAL_RANK (one machine)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def saver(trainer: pl.Trainer) -> RunCheckpoint:
    """The run's save callback."""
    return next(c for c in trainer.callbacks if isinstance(c, RunCheckpoint))


class Fault(pl.Callback):
    """action, at optimizer step `step`:

    - `sigterm` | `sigusr1` | `sigint`: the signal to this process at the start of the step; with `_in_val`,
      in the first validation batch after it; `_in_save`, while that step's checkpoint is written; `_in_upload`,
      while a checkpoint is being uploaded to object storage;
    - `sigkill` | `sigterm_group` | `sigkill_in_save` | `sigkill_random` (a seeded moment up to `seconds`
      after set-up) | `sigkill_after_upload` (once a checkpoint is on object storage);
    - `raise`: an exception from this callback (a bug in any callback); `raise_in_val`, in validation;
      `value_error`: a library's ValueError (numpy's reshape), the kind a user's own callback meets;
      `raise_always`: at `step` in every process, however often it is restarted (a crash a restart cannot fix),
      after `seconds` (a slow start-up);
    - `pause`: wait at the step until `<marker>.go` exists, so the test acts from outside meanwhile (stops
      the S3 server, removes a folder);
    - `sigkill_in_shard_write` | `disk_full_in_shard_write`: while a rank writes its shards of a sharded
      checkpoint (checkpoint.format=sharded; in the background thread with checkpoint.async_save);
      `finish_fails`: rank 0's last act of a sharded save (meta.pt, the rename) meets a full disk (with
      checkpoint.async_save: in the step that finds the background write done);
      `hold_shard_write`: the background write of the checkpoint of step `step` waits until training has
      ended a step `seconds` later (the save completes after the run moved on, as a slow disk makes it);
    - `fill_disk_in_save`: the checkpoint write fills its real filesystem (`<marker>.filler`) and meets ENOSPC;
      `disk_full`: the same failure simulated inside torch.save, on any filesystem;
    - `slow_upload`: every checkpoint upload `seconds` longer; `refuse_uploads`: the bucket refuses every upload
      of step >= `step` (access denied), in the process the fault fired in;
    - `nan` | `nan_always` | `drop_grads` | `slow`: numerics and a slow host.

    `rank`: fire on that rank only (under torchrun; every rank when None)."""

    def __init__(
        self, action: str, marker: str, step: int = 0, seconds: float = 0.0, rank: int | None = None
    ) -> None:
        self.action, self.marker, self.step, self.seconds = action, Path(marker), step, seconds
        self.rank = rank

    def fire(self) -> bool:
        """True the first time across restarts (on `rank` only, when one is named)."""
        if self.rank is not None and rank() != self.rank:
            return False
        if self.marker.exists():
            return False
        self.marker.write_text(self.action)
        return True

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stop_signal(self.action, "save") or self.action in (
            "sigkill_in_save",
            "disk_full",
            "fill_disk_in_save",
        ):
            self.wrap_save(trainer)
        if self.action in ("sigkill_in_shard_write", "disk_full_in_shard_write", "hold_shard_write"):
            self.wrap_shard_write()
        if self.action == "finish_fails":
            self.wrap_finish()
        if self.action == "sigkill_random" and not self.marker.exists():
            # A kill at a random moment (in a step, in validation, in a checkpoint write, in data loading).
            delay = random.Random(self.step).uniform(0.0, self.seconds)
            threading.Timer(delay, self.kill_now).start()

    def wrap_shard_write(self) -> None:
        """DCP's file writer (every rank's shards; with checkpoint.async_save, in the background thread) meets
        the fault once it has written half a shard, at the first save of step >= `step` (the folder's name)."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original = FileSystemWriter.write_data
        fault = self

        def write_data(writer, plan, planner):
            step = int(Path(str(writer.path)).name.split("-")[1].split(".")[0])
            if fault.action == "hold_shard_write":
                if step == fault.step:
                    release = fault.marker.with_suffix(".go")
                    for _ in range(600):  # at most a minute: the run releases it far sooner
                        if release.exists():
                            break
                        time.sleep(0.1)
                return original(writer, plan, planner)
            if step < fault.step or not fault.fire():
                return original(writer, plan, planner)
            shard = Path(str(writer.path)) / f"__{int(os.environ.get('RANK', '0'))}_0.distcp"
            shard.write_bytes(b"\0" * 4096)  # half a shard on disk
            if fault.action == "sigkill_in_shard_write":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, "No space left on device")

        FileSystemWriter.write_data = write_data

    def wrap_finish(self) -> None:
        """Rank 0's `ShardedFolder.finish` of the first save of step >= `step` raises ENOSPC (nothing written)."""
        from lm.checkpoint.formats import ShardedFolder

        original = ShardedFolder.finish
        fault = self

        def finish(checkpoint, tmp, path):
            if checkpoint.get("global_step", 0) >= fault.step and fault.fire():
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "meta.pt"))
            return original(checkpoint, tmp, path)

        ShardedFolder.finish = staticmethod(finish)

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
            if sig := stop_signal(fault.action, "save"):
                os.kill(os.getpid(), sig)  # arrives while the checkpoint is being written
                return original_save(checkpoint, path, storage_options)
            if fault.action == "sigkill_in_save":
                tmp = io.temporary_path(Path(path))
                with open(tmp, "wb") as f:  # half a checkpoint on disk, then the process is gone
                    torch.save(checkpoint, f)
                    f.truncate(f.tell() // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            # disk_full: the disk fills up half-way through the write, inside AtomicCheckpointIO;
            # fill_disk_in_save: another writer takes the filesystem's last byte just as the write starts.
            real_save = torch.save

            def full_disk_save(obj, f, *args, **kwargs):
                if TMP_MARK in getattr(f, "name", ""):
                    if fault.action == "fill_disk_in_save":
                        fill(fault.marker.with_name(fault.marker.name + ".filler"))
                        return real_save(obj, f, *args, **kwargs)
                    f.write(b"\0" * 1000)
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_save(obj, f, *args, **kwargs)

            torch.save = full_disk_save
            try:
                return original_save(checkpoint, path, storage_options)
            finally:
                torch.save = real_save

        io.save_checkpoint = save

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        uploader = saver(trainer).uploader
        if stop_signal(self.action, "upload") and uploader is not None:
            self.wrap_upload(uploader.store)
        if self.action in ("slow_upload", "refuse_uploads") and uploader is not None:
            self.wrap_upload_fault(uploader.store)

    def wrap_upload_fault(self, store) -> None:
        """`slow_upload`: every upload takes `seconds` longer (a stand-in for a 1B checkpoint's); with
        `refuse_uploads`, the bucket refuses every upload of step >= `step` (access denied)."""
        from lm.store.objects import explain

        original_upload = store.upload
        fault = self

        def upload(f, step: int):
            if fault.action == "slow_upload":
                time.sleep(fault.seconds)
            elif step >= fault.step and (getattr(fault, "_refusing", False) or fault.fire()):
                fault._refusing = True  # from now on, in this process only: the rerun uploads
                denied = PermissionError(errno.EACCES, "Access Denied")
                raise explain(denied, store.url, "uploading a checkpoint to") from denied
            return original_upload(f, step)

        store.upload = upload

    def wrap_upload(self, store) -> None:
        """The signal arrives while a checkpoint of step >= `step` is on its way to the bucket."""
        original_upload = store.upload
        fault = self

        def upload(f, step: int):
            if step >= fault.step and fault.fire():
                os.kill(os.getpid(), stop_signal(fault.action, "upload"))
            return original_upload(f, step)

        store.upload = upload

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.action == "nan_always" and trainer.global_step >= self.step:
            self.poison(pl_module)  # bad data or diverged weights: every step from here on
            return
        if self.action == "sigkill_after_upload" and trainer.global_step >= self.step and self.fire():
            uploader = saver(trainer).uploader
            deadline = time.monotonic() + 120
            while uploader.uploaded_step is None and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "raise_always" and trainer.global_step == self.step:
            time.sleep(self.seconds)
            raise RuntimeError(f"injected fault: a crash at step {self.step}, in every process")
        at_step = ("sigkill", "sigterm_group", "nan", "drop_grads", "raise", "value_error", "pause")
        sig = stop_signal(self.action, None)
        if not (sig or self.action in at_step) or trainer.global_step != self.step or not self.fire():
            return
        if sig:
            os.kill(os.getpid(), sig)  # mid-step: the forward and backward are still to run
        elif self.action == "raise":
            raise RuntimeError(f"injected fault: a callback raised at step {self.step}")
        elif self.action == "value_error":
            np.arange(3).reshape(2, 2)  # ValueError: cannot reshape array of size 3 into shape (2,2)
        elif self.action == "pause":
            self.hold()
        elif self.action == "sigterm_group":
            os.killpg(os.getpgid(0), signal.SIGTERM)  # like a shutdown: the DataLoader workers get it too
        elif self.action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "nan":
            self.poison(pl_module)  # a transient fault: this step only, and only once
        elif self.action == "drop_grads":
            self._drop = True

    def hold(self, timeout: float = 120.0) -> None:
        """Wait (mid-run, workers alive) until the test has acted and written `<marker>.go`."""
        release = self.marker.with_name(self.marker.name + ".go")
        deadline = time.monotonic() + timeout
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    def poison(self, pl_module) -> None:
        loss = type(pl_module).loss
        pl_module.loss = lambda batch: loss(pl_module, batch) * float("nan")  # this step only

    def on_validation_end(self, trainer, pl_module) -> None:
        # After every callback's on_validation_epoch_end (the stopper's decision): the held write may finish.
        if self.action == "hold_shard_write" and trainer.global_step >= self.step + self.seconds:
            self.marker.with_suffix(".go").touch()

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
        step = next((c for c in trainer.callbacks if type(c).__name__ == "StepBoundary"), None)
        alarm = step.alarm if step is not None else None
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
        sig = stop_signal(self.action, "val")
        in_val = sig or self.action == "raise_in_val"
        if not in_val or trainer.sanity_checking or trainer.global_step < self.step or not self.fire():
            return
        if sig:
            os.kill(os.getpid(), sig)
        else:  # with the validation loader's workers alive and the training loader's waiting
            raise RuntimeError(f"injected fault: a callback raised in validation after step {self.step}")


def fill(path: Path) -> None:
    """Write zeros to `path` until its filesystem has no byte left (ENOSPC), as another process would."""
    with open(path, "ab", buffering=0) as f:
        for size in (1 << 16, 512, 1):  # big blocks, then the last partial page
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
