"""`Checkpointer`: the one object a run asks about its checkpoints, and where a run starts.

A run either continues its newest checkpoint that loads (`find_resume_point`: a truncated or corrupted one is
moved to `corrupt/`, the bucket's newest is fetched when newer than every local one) or starts over with the
old run moved aside (`archive_run`); `run.resume` picks one, each is its own function. Behind the class, one
module per concern, each usable alone:

    files.py         names and reading (`last.ckpt`, `step-<N>.ckpt`, `read`, `loadable`)
    formats.py       how one checkpoint is laid out (`CheckpointFormat`; `FullFile` today, a sharded one later)
    local.py         writing on the local disk: `AtomicCheckpointIO`, the `last.ckpt` link, rotation, disk guard
    resume_check.py  whether this config may continue the checkpoint (`check_resumable`, `ResumeCheck`)
    remote.py        the bucket mirror: pointer protocol, background uploads, fetching a newer checkpoint
    callback.py      `RunCheckpoint`: when a run saves, which files it keeps, uploads
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_only

from lm.checkpoint import resume_check
from lm.checkpoint.callback import Agreement, RunCheckpoint
from lm.checkpoint.files import LAST, STEP_GLOB, loadable, read_meta, remove
from lm.checkpoint.formats import FORMATS, FULL_FILE, TMP_MARK, AsyncShardedFolder, CheckpointFormat
from lm.checkpoint.local import AtomicCheckpointIO, replace_symlink
from lm.checkpoint.remote import RemoteCheckpoints, fetch_newer, remote_behind, remote_checkpoints
from lm.config import CheckpointConfig, DataConfig, RunConfig
from lm.model import ModelConfig
from lm.store import rundir
from lm.store.lock import LOCK

log = logging.getLogger(__name__)


class Checkpointer:
    """A run directory's checkpoints: the resume point or the archive of an old run, the check that this config
    may continue a checkpoint, the Trainer's writer and save callbacks, and the bucket mirror.

    `fmt` is the layout every save is written in (`lm.checkpoint.formats`; `checkpoint.format` by default);
    every reader takes either layout.
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        remote: RemoteCheckpoints | None = None,
        fmt: CheckpointFormat | None = None,
    ) -> None:
        self.run_dir, self.cfg, self.remote = run_dir, cfg, remote
        if fmt is None:
            fmt = AsyncShardedFolder() if cfg.async_save else FORMATS[cfg.format]
        self.format = fmt
        self._io: AtomicCheckpointIO | None = None
        self._saver: RunCheckpoint | None = None

    @classmethod
    def open(
        cls, cfg: CheckpointConfig, run: RunConfig, run_dir: Path, identity: dict[str, Any]
    ) -> Checkpointer:
        """The run's checkpointer, its bucket (with checkpoint.remote) probed and claimed for the run
        (`remote_checkpoints`: another run's folder is refused), before the run directory changes."""
        return cls(run_dir, cfg, remote_checkpoints(cfg, identity, run, run_dir))

    @property
    def dir(self) -> Path:
        """`<run dir>/checkpoints`."""
        return self.run_dir / rundir.CHECKPOINTS

    def resume_point(self) -> Path | None:
        """The checkpoint to continue from (the bucket's when newer), repaired if broken; None: start fresh."""
        return find_resume_point(self.run_dir, self.remote)

    def archive_run(self) -> None:
        """Move the previous run aside (`run.resume=false`), and the bucket's pointer with it."""
        archive_run(self.run_dir, self.remote)

    def check_resumable(
        self, ckpt_path: Path | None, model: ModelConfig, optimizer: str, data: DataConfig
    ) -> None:
        """Refuse to continue `ckpt_path` with another architecture, optimizer or data stream (exit 78)."""
        resume_check.check_resumable(ckpt_path, model, optimizer, data)

    def io(self) -> AtomicCheckpointIO:
        """The Trainer's checkpoint plugin, writing this checkpointer's format atomically (one per run: the
        saver reads its space guard and background writer)."""
        if self._io is None:
            self._io = AtomicCheckpointIO(fmt=self.format)
        return self._io

    def saver(self, consensus: Agreement | None = None) -> RunCheckpoint:
        """The run's save callback (when to save, `last.ckpt`, rotation, uploads), made once and handed to
        every part of the step that asks for a save or reads the newest saved step; `consensus`: the run's
        agreement across ranks."""
        if self._saver is None:
            self._saver = RunCheckpoint(self.dir, self.cfg, self.remote, self.io(), consensus)
        return self._saver

    def callbacks(self, meter=None, consensus: Agreement | None = None) -> list[pl.Callback]:
        """The resume check (first of all callbacks) and the save callback (last but the progress bar)."""
        return [resume_check.ResumeCheck(meter, consensus), self.saver(consensus)]

    def mirror_behind(self) -> str | None:
        """At the end of a run: None when there is no bucket or it holds the latest checkpoint, else what it
        lacks (`remote_behind`)."""
        return remote_behind(self.remote, self.run_dir) if self.remote is not None else None


def resume_candidates(ckpt_dir: Path, fmt: CheckpointFormat = FULL_FILE) -> list[Path]:
    """last.ckpt, then the step checkpoints newest first (by step number, never by name)."""
    last = ckpt_dir / LAST
    return ([last] if last.exists() else []) + fmt.list(ckpt_dir)


def find_good_checkpoint(ckpt_dir: Path, fmt: CheckpointFormat = FULL_FILE) -> Path | None:
    """The newest checkpoint that loads; broken ones are moved to `corrupt/` with a warning."""
    for path in resume_candidates(ckpt_dir, fmt):
        if not path.exists():
            continue  # a step file already moved aside because last.ckpt pointed at it
        why = loadable(path)
        if why is None:
            return path
        target = path.resolve()
        aside = ckpt_dir / "corrupt" / f"{target.name}.{time.strftime('%Y%m%d-%H%M%S')}"
        aside.parent.mkdir(exist_ok=True)
        target.rename(aside)
        if path.is_symlink():
            path.unlink()
        log.warning("checkpoint %s does not load (%s); moved it to %s, trying an older one", path, why, aside)
    return None


def remove_all_temporaries(ckpt_dir: Path) -> None:
    """Delete every `*.tmp-*` in the checkpoint folder, whatever process wrote it: rank 0 calls this under the
    run lock before anything saves, so each is the remains of an interrupted write (never renamed, so never
    used). Elsewhere in the run directory `lm.store.atomic.remove_orphaned_temporaries` removes only those
    whose process is gone."""
    for tmp in ckpt_dir.glob(f"*{TMP_MARK}*"):
        log.info("removing %s, left by an interrupted checkpoint write", tmp)
        remove(tmp)  # a file, or a sharded save's folder


def fetch_remote(ckpt_dir: Path, remote: RemoteCheckpoints) -> Path | None:
    """The bucket's newest checkpoint, downloaded when no local one that loads is as new; None otherwise."""
    good = None
    if ckpt_dir.is_dir():
        remove_all_temporaries(ckpt_dir)
        good = find_good_checkpoint(ckpt_dir)
    local_step = read_meta(good)["global_step"] if good is not None else -1
    return fetch_newer(ckpt_dir, remote, local_step, have_local=good is not None)


def find_resume_point(run_dir: Path, remote: RemoteCheckpoints | None = None) -> Path | None:
    """The checkpoint to continue from (`run.resume=true`), or None to start fresh.

    This is `checkpoints/last.ckpt` when it loads; when it does not (truncated, corrupted, written by an
    interrupted save) the newest step checkpoint that loads takes its place and last.ckpt is re-pointed at it.
    With `remote` (checkpoint.remote), the newest remote checkpoint is downloaded first when it is newer than
    every local one, verified against the pointer's size and sha256.
    """
    ckpt_dir = run_dir / rundir.CHECKPOINTS
    if rank_zero_only.rank == 0 and remote is not None:
        fetch_remote(ckpt_dir, remote)
    if not ckpt_dir.is_dir():
        return None
    last = ckpt_dir / LAST
    if rank_zero_only.rank != 0:
        # Under torchrun or srun every rank starts at once and may look while rank 0 re-points the link
        # (a dangling moment). Each rank reads the checkpoint only after the process-group rendezvous,
        # i.e. after rank 0's repairs: resume whenever there is anything to resume, never start fresh
        # beside a resuming rank 0 (if rank 0 found nothing loadable, this rank fails loudly instead).
        candidates = last.is_symlink() or last.exists() or any(ckpt_dir.glob(STEP_GLOB))
        return last if candidates else None
    # Rank 0 repairs; the other ranks wait for it in Lightning's first barrier.
    remove_all_temporaries(ckpt_dir)
    good = find_good_checkpoint(ckpt_dir)
    if good is None:
        if any(ckpt_dir.glob("corrupt/*")):
            log.warning("no checkpoint in %s loads; starting from scratch", ckpt_dir)
        return None
    if good != last:
        replace_symlink(good.resolve(), last)
    if last.exists():
        log.info("resuming from %s (-> %s)", last, last.resolve().name)
        return last
    return None


def archive_run(run_dir: Path, remote: RemoteCheckpoints | None = None) -> None:
    """`run.resume=false`: move an existing run aside into `archive/<time>/` rather than delete it or mix it
    with the new run's checkpoints (or its cost ledger): starting over never destroys a user's run. The
    bucket's pointer is set aside as `archive-<time>.json` (its checkpoints are kept). Rank 0 only; the other
    ranks only need to start fresh."""
    if rank_zero_only.rank != 0:
        return
    if remote is not None and (aside := remote.archive_pointer()):
        log.warning("run.resume=false: set the remote pointer aside as %s (its checkpoints are kept)", aside)
    # Everything the run produced (checkpoints, tb, cost ledger, phases, report) but the invocation logs and
    # the lock this process holds (moved, it would leave the directory unlocked).
    kept = ("hydra", "archive", LOCK)
    produced = sorted(p for p in run_dir.iterdir() if p.name not in kept) if run_dir.is_dir() else []
    if produced:
        archive = run_dir / "archive" / time.strftime("%Y-%m-%d_%H-%M-%S")
        archive.mkdir(parents=True, exist_ok=True)
        for path in produced:
            path.rename(archive / path.name)
        log.warning(
            "run.resume=false: moved the previous run's %s to %s", [p.name for p in produced], archive
        )
