"""RunCheckpoint: when a run saves, which checkpoints it keeps, and the `last.ckpt` link a restart reads.

Built on Lightning's public API only: a plain `Callback` that calls `trainer.save_checkpoint` (which builds the
checkpoint dict, every callback's `on_save_checkpoint` included, and hands it to the strategy and the run's
CheckpointIO plugin), not a `ModelCheckpoint` subclass: lm saves by step, keeps files by step number and
links `last.ckpt` itself, so nothing of ModelCheckpoint's monitoring or top-k bookkeeping is used.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl

from lm.base.exits import CheckpointSaveError, report_progress
from lm.checkpoint.files import LAST, checkpoint_step, step_name
from lm.checkpoint.formats import AsyncShardedFolder
from lm.checkpoint.local import (
    AtomicCheckpointIO,
    check_run_fits,
    estimate_checkpoint_bytes,
    replace_symlink,
    rotate,
)
from lm.checkpoint.remote import CheckpointUploader, RemoteCheckpoints
from lm.config import CheckpointConfig

log = logging.getLogger(__name__)


class RunCheckpoint(pl.Callback):
    """`step-<N>.ckpt` every N steps, at the last step of an invocation and on demand (`save_now`: a stop
    signal, a slow host); the newest `keep_last` kept by step number; `last.ckpt` linking the newest.

    The final step is saved so that the next phase or a rerun resumes where this invocation stopped, not at
    the last interval. `last.ckpt` is a symlink moved only once the step file is complete (a background save:
    once its folder is in place), so a checkpoint is written once, and rotation (from the files on disk)
    deletes old files only after that, so the only good checkpoint is never deleted.
    """

    def __init__(
        self,
        dirpath: Path,
        cfg: CheckpointConfig,
        remote: RemoteCheckpoints | None = None,
        io: AtomicCheckpointIO | None = None,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.cfg = cfg
        self.io = io if io is not None else AtomicCheckpointIO()
        """The run's checkpoint plugin (the Trainer writes through it): its format and its space guard."""
        self.background = self.io.format if isinstance(self.io.format, AsyncShardedFolder) else None
        """The run's background writer (checkpoint.async_save)."""
        self.uploader = CheckpointUploader(remote) if remote is not None else None
        """Mirrors every step checkpoint to object storage in the background (rank 0), when configured."""
        self.saved_step: int | None = None
        """The newest step on disk from this process's point of view: saved here, or resumed from."""

    # --- Lightning hooks ---------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        expected = estimate_checkpoint_bytes(sum(p.numel() for p in pl_module.parameters()))
        self.io.expected_bytes = max(self.io.expected_bytes, expected)
        if self.background is not None:
            self.background.on_complete = self.completed if trainer.is_global_zero else None
        if trainer.is_global_zero:
            check_run_fits(self.dirpath, expected, self.cfg.keep_last)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None:  # this step is on disk already: it is what the run resumed from
            self.saved_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.cfg.every_n_steps
        if every and trainer.global_step % every == 0:
            self.save_now(trainer)  # once per optimizer step: a micro-batch within it finds the step saved
        if self.background is not None:
            self.background.poll()  # a finished background write becomes the run's newest checkpoint

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save_now(trainer)
        self.finish_or_fail()  # while every rank's process group is still up for the writer's collectives

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # A stop signal's save (exit 75) or a crash: finish the save and the upload in flight before the
        # process ends (a failed background write is logged; the exception in flight is what the run exits on).
        try:
            self.finish_background_save()
        except OSError as e:
            log.error("the checkpoint written in the background failed (%s); the previous one is intact", e)
        self.wait_for_upload()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.finish_or_fail()
        self.wait_for_upload()

    # --- saving ------------------------------------------------------------------------------------------

    def save_now(self, trainer: pl.Trainer) -> bool:
        """Write a step checkpoint and move last.ckpt now (all ranks call it); False if this step is saved
        (or is step 0, or a sanity check runs)."""
        step = trainer.global_step
        if step == 0 or step == self.saved_step or trainer.sanity_checking:
            return False
        path = self.dirpath / step_name(step)
        trainer.save_checkpoint(path)  # every rank: the dict, the strategy, the run's CheckpointIO, a barrier
        self.saved_step = step
        if self.background is None and trainer.is_global_zero:
            replace_symlink(path, self.dirpath / LAST)  # complete: the link moves, never to a partial file
            rotate(self.dirpath, self.cfg.keep_last, step)
            if self.uploader is not None:  # a background save uploads once it is complete (`completed`)
                self.uploader.submit(path, step)
        trainer.strategy.barrier()  # every rank sees the link before the next step
        return True

    def completed(self, path: Path) -> None:
        """Rank 0, once a background save is complete and in place: `last.ckpt` moves to it, then rotation."""
        replace_symlink(path, self.dirpath / LAST)
        report_progress(f"saved {path}")
        if self.uploader is not None:
            self.uploader.submit(path, checkpoint_step(path) or 0)
        rotate(self.dirpath, self.cfg.keep_last, checkpoint_step(path) or 0)

    def finish_background_save(self) -> None:
        """Wait for the checkpoint being written in the background, if any (checkpoint.async_save)."""
        if self.background is not None:
            self.background.wait()

    def finish_or_fail(self) -> None:
        """Finish the background save; a failed one ends the run with exit 74 (CheckpointSaveError)."""
        try:
            self.finish_background_save()
        except OSError as e:
            raise CheckpointSaveError(
                f"the checkpoint written in the background failed ({e}). The previous checkpoints are intact; "
                "fix the cause (disk full? quota?) and rerun the same command to resume"
            ) from e

    def wait_for_upload(self) -> None:
        """Block until the newest checkpoint is on object storage (a no-op without checkpoint.remote)."""
        if self.uploader is not None:
            self.uploader.wait(self.cfg.upload_timeout_s)
