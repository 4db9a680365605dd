"""RunCheckpoint: when a run saves, which checkpoints it keeps, and the `last.ckpt` link a restart reads."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lm.base.exits import CheckpointSaveError, report_progress
from lm.checkpoint.files import LAST, LAST_STEM, STEP_TEMPLATE, SUFFIX, checkpoint_step
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


class RunCheckpoint(ModelCheckpoint):
    """`step-<N>.ckpt` every N steps, the newest `keep_last` by step number, and `last.ckpt` linking the newest.

    Lightning's ModelCheckpoint saves only at interval steps; this one also saves the final step of an
    invocation (why: the next phase or a rerun must resume from where this one stopped, not from the last
    interval) and on demand (`save_now`, for a signal or a health alarm). `last.ckpt` is a symlink moved only
    after the step file is complete, so a checkpoint is written once, not twice. Rotation is ours
    (`local.rotate`, from the files on disk; Lightning's top-k list forgets the files of a copied or
    moved run directory) and deletes old files only after `last.ckpt` points at the new one, so the only good
    checkpoint is never deleted.
    """

    # Lightning's own defaults, named from `lm.checkpoint.files` so the files it writes are the ones resume finds.
    CHECKPOINT_NAME_LAST = LAST_STEM
    FILE_EXTENSION = SUFFIX

    def __init__(self, dirpath: Path, cfg: CheckpointConfig, remote: RemoteCheckpoints | None = None) -> None:
        super().__init__(
            dirpath=dirpath,
            filename=STEP_TEMPLATE,
            auto_insert_metric_name=False,
            every_n_train_steps=cfg.every_n_steps,
            save_top_k=-1,  # Lightning deletes nothing: `rotate` does, after each save
            monitor="step",  # kept for the state key that existing checkpoints were saved under
            mode="max",
            save_last="link",
            # A resumed run owns its folder: never write `last-v1.ckpt` beside the `last.ckpt` a rerun reads.
            enable_version_counter=False,
        )
        self.cfg = cfg
        self.background: AsyncShardedFolder | None = None
        """The run's background writer (checkpoint.async_save), known once the Trainer is set up."""
        self.uploader = CheckpointUploader(remote) if remote is not None else None
        """Mirrors every step checkpoint to object storage in the background (rank 0), when configured."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        expected = estimate_checkpoint_bytes(sum(p.numel() for p in pl_module.parameters()))
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO):
            io.expected_bytes = max(io.expected_bytes, expected)
            if isinstance(io.format, AsyncShardedFolder):
                self.background = io.format
                io.format.on_complete = self.completed if trainer.is_global_zero else None
        if trainer.is_global_zero:
            check_run_fits(Path(self.dirpath), expected, self.cfg.keep_last)

    def state_dict(self) -> dict[str, Any]:
        # Nothing of ModelCheckpoint's top-k bookkeeping is resumed (rotation reads the files on disk): what a
        # checkpoint resumes beyond weights, optimizer and scheduler is RunState alone.
        return {}

    def completed(self, path: Path) -> None:
        """Rank 0, once a background save is complete and in place: `last.ckpt` moves to it, then rotation."""
        replace_symlink(path, Path(self.dirpath) / LAST)
        report_progress(f"saved {path}")
        if self.uploader is not None:
            self.uploader.submit(path, checkpoint_step(path) or 0)
        for old in rotate(Path(self.dirpath), self.cfg.keep_last, checkpoint_step(path) or 0):
            self.best_k_models.pop(str(old), None)

    def finish_background_save(self) -> None:
        """Wait for the checkpoint being written in the background, if any (checkpoint.async_save)."""
        if self.background is not None:
            self.background.wait()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.background is not None:
            self.background.poll()  # a finished background write becomes the run's newest checkpoint

    def _link_checkpoint(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        # Lightning removes the old link and then creates the new one: a kill in between leaves no last.ckpt.
        # A background save links when it is complete (`completed`), never to a folder still being written.
        if (
            self.background is None
            and trainer.is_global_zero
            and os.path.abspath(filepath) != os.path.abspath(linkpath)
        ):
            replace_symlink(Path(filepath), Path(linkpath))
        trainer.strategy.barrier()

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)  # last.ckpt now points at the new file
        if trainer.is_global_zero and self.background is None:
            for path in rotate(Path(self.dirpath), self.cfg.keep_last, trainer.global_step):
                self.best_k_models.pop(str(path), None)  # the checkpoint state lists only files that exist

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        step_file = checkpoint_step(Path(filepath)) is not None
        # A background save uploads once it is complete (`completed`).
        if self.uploader is not None and trainer.is_global_zero and step_file and self.background is None:
            self.uploader.submit(Path(filepath), trainer.global_step)

    def wait_for_upload(self) -> None:
        """Block until the newest checkpoint is on object storage (a no-op without checkpoint.remote)."""
        if self.uploader is not None:
            self.uploader.wait(self.cfg.upload_timeout_s)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        super().on_exception(trainer, pl_module, exception)
        # A stop signal's save (exit 75) or a crash: finish the save and the upload in flight before the
        # process ends (a failed background write is logged; the exception in flight is what the run exits on).
        try:
            self.finish_background_save()
        except OSError as e:
            log.error("the checkpoint written in the background failed (%s); the previous one is intact", e)
        self.wait_for_upload()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self.finish_or_fail()
        self.wait_for_upload()

    def save_now(self, trainer: pl.Trainer) -> bool:
        """Write a step checkpoint and move last.ckpt now (all ranks call it); False if this step is saved."""
        if self._last_global_step_saved == trainer.global_step or trainer.global_step == 0:
            return False
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        return True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.ckpt_path is not None:  # this step is on disk already: it is what the run resumed from
            self._last_global_step_saved = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save_now(trainer)
        self.finish_or_fail()  # while every rank's process group is still up for the writer's collectives
        super().on_train_end(trainer, pl_module)

    def finish_or_fail(self) -> None:
        """Finish the background save; a failed one ends the run with exit 74 (CheckpointSaveError)."""
        try:
            self.finish_background_save()
        except OSError as e:
            raise CheckpointSaveError(
                f"the checkpoint written in the background failed ({e}). The previous checkpoints are intact; "
                "fix the cause (disk full? quota?) and rerun the same command to resume"
            ) from e
