"""RunCheckpoint: when a run saves, which checkpoints it keeps, and the `last.ckpt` link a restart reads.

Built on Lightning's public API only: a plain `Callback` that calls `trainer.save_checkpoint` (which builds the
checkpoint dict, every callback's `on_save_checkpoint` included, and hands it to the strategy and the run's
CheckpointIO plugin), not a `ModelCheckpoint` subclass: lm saves by step, keeps files by step number and
links `last.ckpt` itself, so nothing of ModelCheckpoint's monitoring or top-k bookkeeping is used.

Every decision about a save is agreed by all ranks before any acts on it (the run's `Consensus.agree`: each
rank's problem gathered, the first raised on every rank): whether the run directory is still this run's and the checkpoint
fits (before any rank writes), whether the write failed (after Lightning's barrier, which a rank that raised
inside it would leave the others waiting in), whether the previous background write completed. Failures found
between saves (a background write's, the run directory's loss) are this rank's votes at the step boundary
(`lm.callbacks.step`), which agrees on them across ranks before `fail_between_saves` acts.

The step boundary drives it at every optimizer step (`poll`: a finished background write) and asks it for the
saves it decides (`save_now`: the scheduled one, a stop's, a slow host's, the final one); its own hooks set it
up and finish a background write on the way out.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

import lightning.pytorch as pl

from lm.base.exits import CheckpointSaveError, RunDirRemoved, report_progress
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
from lm.store.atomic import check_owned, deferred, lost_run_dir, removed_message

log = logging.getLogger(__name__)

OWNER_CHECK_S = 2.0
"""How often (seconds, at most) rank 0 checks between saves that the run directory is still this run's."""


class Agreement(Protocol):
    """How the ranks agree (a save's problems, the step each resumed at): the run's
    `lm.callbacks.consensus.Consensus`, the one mechanism of the whole run (handed in: it lives a wing above)."""

    def agree(self, trainer: pl.Trainer, error: BaseException | None) -> None:
        """Every rank raises the first rank's problem if any rank has one."""

    def gather(self, trainer: pl.Trainer, value: object) -> list:
        """Every rank's `value`, in rank order, on every rank."""


class Alone:
    """The agreement of one process: its own problem, its own value is the answer."""

    def agree(self, trainer: pl.Trainer, error: BaseException | None) -> None:
        self.gather(trainer, error)
        if error is not None:
            raise error

    def gather(self, trainer: pl.Trainer, value: object) -> list:
        if trainer.world_size > 1:
            raise RuntimeError("a run on several ranks needs the run's Consensus to agree through")
        return [value]


class RunCheckpoint(pl.Callback):
    """`step-<N>.ckpt` when the step boundary asks (`save_now`: every N steps, the last step of an invocation, a
    stop signal, a slow host); the newest `keep_last` kept by step number; `last.ckpt` linking the newest.

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
        consensus: Agreement | None = None,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.consensus = consensus or Alone()
        """The run's agreement across ranks (the step boundary's), for every decision about a save."""
        self._owner_checked = time.monotonic()
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

    def poll(self) -> None:
        """At each optimizer step, last in the step boundary: a finished background write becomes the run's
        newest checkpoint."""
        if self.background is not None:
            self.background.poll()

    def due(self, trainer: pl.Trainer) -> bool:
        """Whether this step is one `checkpoint.every_n_steps` asks to save."""
        every = self.cfg.every_n_steps
        return bool(every) and trainer.global_step % every == 0

    def between_saves(self) -> tuple[bool, BaseException | None]:
        """This rank's votes between saves: the run directory gone or taken over (rank 0's lock, checked at
        most every `OWNER_CHECK_S`), and a background write's failure or an upload the bucket refused."""
        lost = False
        now = time.monotonic()
        if now - self._owner_checked >= OWNER_CHECK_S:  # rank 0's lock (lm.store.atomic.own)
            self._owner_checked, lost = now, lost_run_dir(self.dirpath) is not None
        if self.background is not None and self.background.failure is not None:
            return lost, self.background.failure
        return lost, self.upload_refused()

    def upload_refused(self) -> CheckpointSaveError | None:
        """The bucket refused an upload (access denied, the bucket deleted: `Refused`, not an outage, which the
        uploader retries): the run would train on with no mirror, so it stops (74) unless
        `checkpoint.remote_best_effort` keeps it going with the failure logged."""
        if self.uploader is None or self.cfg.remote_best_effort:
            return None
        refusal = self.uploader.refusal
        if refusal is None:
            return None
        error = CheckpointSaveError(
            f"the bucket refused the checkpoint upload ({refusal}); the run stops rather than train on with no "
            f"mirror. The local checkpoints are intact: fix the bucket's permissions (or set "
            f"checkpoint.remote_best_effort=true to train on with the failure logged) and rerun the same "
            f"command to resume"
        )
        error.__cause__ = refusal
        return error

    def fail_between_saves(self, lost: bool, failed: bool, failure: BaseException | None) -> None:
        """On the agreed flags, every rank stops together (exit 74): the run directory is not this run's any
        more, or a background write or an upload failed (here, or `failure` is None: on another rank)."""
        if lost:
            raise RunDirRemoved(removed_message(self.dirpath.parent))
        if failed and isinstance(failure, CheckpointSaveError):
            raise failure  # the upload's refusal says what it is
        if failed:
            where = failure or "on another rank"
            raise CheckpointSaveError(
                f"the checkpoint written in the background (or its upload) failed ({where}). The previous "
                "checkpoints are intact; fix the cause (disk full? quota?) and rerun the same command to resume"
            ) from failure

    def write_problem(self, trainer: pl.Trainer, path: Path) -> OSError | None:
        """This rank's reason not to write the checkpoint at `path` (None: go ahead), a run file that rank 0
        could not write since the last step boundary included (validation's, the train end's)."""
        try:
            check_owned(path)  # rank 0's lock still the run directory's
        except RunDirRemoved as e:
            return e
        if (unwritten := deferred(self.dirpath.parent)) is not None:
            return unwritten
        if trainer.is_global_zero or self.io.format.collective:  # the ranks that write
            return self.io.space_problem(path)
        return None

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
        if (
            self.background is not None and self.background.pending is not None
        ):  # fit ended before on_train_end
            self.finish_or_fail(trainer)
        self.wait_for_upload()

    # --- saving ------------------------------------------------------------------------------------------

    def save_now(self, trainer: pl.Trainer) -> bool:
        """Write a step checkpoint and move last.ckpt now (all ranks call it); False if this step is saved
        (or is step 0, or a sanity check runs)."""
        step = trainer.global_step
        if step == 0 or step == self.saved_step or trainer.sanity_checking:
            return False
        path = self.dirpath / step_name(step)
        self.settle_background(trainer)  # at most one in flight: the previous one is complete, or all stop
        self.consensus.agree(trainer, self.write_problem(trainer, path))  # before any rank writes
        self.io.defer = True  # the checks are agreed: the plugin writes without checking again on its own
        try:
            # Every rank: the dict, the strategy, the CheckpointIO, a barrier. weights_only=False says *what* is
            # saved (the full training state, not the weights alone); left unset, Lightning logs "`weights_only`
            # was not set, defaulting to `False`" at every save, which reads like an unsafe load. Every read of
            # a checkpoint is as data (lm.checkpoint.files.load).
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self.io.defer = False
        self.consensus.agree(trainer, self.io.take_failure())
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

    def settle_background(self, trainer: pl.Trainer) -> None:
        """Every rank: wait for the save in flight; if it failed on any rank, every rank stops (exit 74)."""
        if self.background is None:
            return
        failure = self.background.failure
        try:
            self.finish_background_save()
        except OSError as e:
            failure = e
        self.background.failure = None
        problem = None
        if failure is not None:
            problem = CheckpointSaveError(
                f"the checkpoint written in the background failed ({failure}). The previous checkpoints are "
                "intact; fix the cause (disk full? quota?) and rerun the same command to resume"
            )
            problem.__cause__ = failure
        self.consensus.agree(trainer, problem)

    def finish_or_fail(self, trainer: pl.Trainer) -> None:
        """Finish the background save; a failed one ends the run on every rank with exit 74."""
        self.settle_background(trainer)

    def wait_for_upload(self) -> None:
        """Block until the newest checkpoint is on object storage (a no-op without checkpoint.remote)."""
        if self.uploader is not None:
            self.uploader.wait(self.cfg.upload_timeout_s)
