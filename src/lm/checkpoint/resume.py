"""Where a run starts: the checkpoint to resume (`find_resume_point`), or a fresh start with the old run moved
aside (`archive_run`). `run.resume` picks one; each is its own function.

A run resumes from the newest checkpoint that loads, skipping a truncated or corrupted one (moved to
`corrupt/`), and from the bucket's newest when it is newer than every local one (a new machine has none).
Whether the checkpoint may be continued with this config is `lm.checkpoint.resume_check`'s.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from lm.checkpoint.files import LAST, STEP_GLOB, loadable, read
from lm.checkpoint.formats import FULL_FILE, TMP_MARK, CheckpointFormat
from lm.checkpoint.local import replace_symlink
from lm.checkpoint.remote import RemoteCheckpoints, fetch_newer
from lm.store import rundir
from lm.store.lock import LOCK

log = logging.getLogger(__name__)


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
        tmp.unlink(missing_ok=True)


def fetch_remote(ckpt_dir: Path, remote: RemoteCheckpoints) -> Path | None:
    """The bucket's newest checkpoint, downloaded when no local one that loads is as new; None otherwise."""
    good = None
    if ckpt_dir.is_dir():
        remove_all_temporaries(ckpt_dir)
        good = find_good_checkpoint(ckpt_dir)
    local_step = read(good)["global_step"] if good is not None else -1
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
