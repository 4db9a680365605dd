"""Checkpoint writing and resume discovery for a run directory.

Three guarantees, because every crash in the seed's list of eight was infrastructure (the callback that
decides when to save is `lm.checkpoint.callback.RunCheckpoint`; file names and the loader are
`lm.checkpoint.files`):
- a checkpoint file is either complete or absent (`AtomicCheckpointIO`: temporary file, fsync, rename);
- a run resumes from the newest checkpoint that loads, skipping a truncated or corrupted one
  (`resume_checkpoint`);
- a save that cannot fit is refused before it starts, and a failed save leaves the previous checkpoints
  intact and says what happened (`CheckpointSaveError`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from lm.base.exits import UNWRITABLE, CheckpointSaveError, report_progress
from lm.base.findings import Finding
from lm.checkpoint.files import LAST, STEP_GLOB, checkpoint_step, loadable, read, step_files
from lm.checkpoint.remote import RemoteCheckpoints, new_run_id
from lm.config import CheckpointConfig, RunConfig
from lm.store import rundir
from lm.store.atomic import discard, nearest_folder, unwritable_cause, unwritable_fix
from lm.store.lock import LOCK
from lm.store.objects import check_writable

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"  # `<name>.tmp-<pid>`: a write in progress, or the remains of one that was interrupted
SAFETY = 1.05  # free space asked for beyond the expected checkpoint size (the optimizer state grows a little)

# fp32 weights (4 bytes) + AdamW's two fp32 moments (8 bytes) per parameter; Lightning's metadata is noise.
BYTES_PER_PARAM = 12


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def estimate_checkpoint_bytes(n_params: int) -> int:
    """Size of a full training checkpoint: weights plus AdamW moments, all fp32."""
    return n_params * BYTES_PER_PARAM


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into `<path>.tmp-<pid>` in the same directory, fsync, rename over `path`, fsync the directory.

    A kill at any moment leaves either the old file or the new one, never half of one. Before writing, the free
    space is checked against the last checkpoint's size (or `expected_bytes` before the first save).
    Replaces TorchCheckpointIO's save because its fsspec transaction neither fsyncs nor checks free space.
    """

    def __init__(self, expected_bytes: int = 0) -> None:
        self.expected_bytes = expected_bytes
        """Bytes the next checkpoint is expected to take; updated to the real size after each save."""

    @staticmethod
    def temporary_path(path: Path) -> Path:
        return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")

    def check_space(self, path: Path) -> None:
        """Refuse a save that would not fit, before touching the disk."""
        need = int(self.expected_bytes * SAFETY)
        free = shutil.disk_usage(path.parent).free
        if need > free:
            raise CheckpointSaveError(
                f"not saving {path.name}: it needs ~{gib(need)} and {path.parent} has {gib(free)} free. "
                f"The previous checkpoints are intact; free space (or lower checkpoint.keep_last) and rerun "
                f"the same command to resume from the last one"
            )

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.check_space(path)
        tmp = self.temporary_path(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            size = tmp.stat().st_size
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
            fsync_dir(path.parent)  # make the rename itself durable
        except OSError as e:
            discard(tmp)  # never a second error over this one (a read-only filesystem refuses the unlink too)
            raise CheckpointSaveError(
                f"saving {path} failed ({save_failure(e, path)}). The previous checkpoints "
                f"are intact; {save_fix(e)} and rerun the same command to resume"
            ) from e
        self.expected_bytes = max(self.expected_bytes, size)
        report_progress(f"saved {path}")  # `lm supervise` starts its count of crashes in a row again


def save_failure(error: OSError, path: Path) -> str:
    """What went wrong with a checkpoint write, with the free space."""
    if error.errno in UNWRITABLE:
        return unwritable_cause(error, path)
    return f"{error.strerror or error}; {gib(shutil.disk_usage(nearest_folder(path)).free)} free in {path.parent}"


def save_fix(error: OSError) -> str:
    return unwritable_fix(error) if error.errno in UNWRITABLE else "fix the cause (disk full? quota?)"


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_symlink(target: Path, link: Path) -> None:
    """Point `link` at `target` (relative) atomically: there is never a moment with no `link`."""
    tmp = link.with_name(f"{link.name}{TMP_MARK}{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def rotate(ckpt_dir: Path, keep_last: int, present: int) -> list[Path]:
    """Delete the step checkpoints beyond the newest `keep_last` of steps <= `present`; returns what went.

    Works from the files on disk, not Lightning's in-memory top-k list, which restarts empty when a run
    directory is copied or moved (its `dirpath` changed) and would then keep every file it brought along.
    Call it only once the new checkpoint is complete and `last.ckpt` points at it. Never deleted: the file
    `last.ckpt` points at, files of a step after `present` (the abandoned future of a run resumed from an
    older checkpoint: this run overwrites them as it gets there), and anything not named `step-<N>.ckpt`.
    """
    if keep_last < 0:  # -1 keeps everything
        return []
    last = ckpt_dir / LAST
    linked = last.resolve() if last.exists() else None
    steps = [p for p in step_files(ckpt_dir) if checkpoint_step(p) <= present]
    doomed = [p for p in steps[keep_last:] if p.resolve() != linked]
    for path in doomed:
        path.unlink(missing_ok=True)
        log.info("rotation (checkpoint.keep_last=%d): deleted %s", keep_last, path.name)
    return doomed


def checkpoint_space(dirpath: Path, ckpt_bytes: int, keep_last: int) -> tuple[int, int, int]:
    """(checkpoints kept, bytes still needed with the safety margin, bytes free) for a run's rotation.

    At peak, `keep_last` step files exist plus the one being written; files already there count as used.
    `dirpath` need not exist yet: free space is read on its nearest existing parent.
    """
    existing = step_files(dirpath)
    have = sum(p.stat().st_size for p in existing)
    keep = keep_last if keep_last > 0 else len(existing) + 1  # -1 keeps everything: at least one more
    need = int(((keep + 1) * ckpt_bytes - have) * SAFETY)
    probe = dirpath
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return keep, need, shutil.disk_usage(probe).free


def check_run_fits(dirpath: Path, ckpt_bytes: int, keep_last: int) -> None:
    """Refuse to start a run whose rotation cannot fit on its disk."""
    dirpath.mkdir(parents=True, exist_ok=True)
    keep, need, free = checkpoint_space(dirpath, ckpt_bytes, keep_last)
    if need > free:
        raise ValueError(
            f"checkpoints will not fit: keeping {keep} of ~{gib(ckpt_bytes)} each (plus one being written) "
            f"needs {gib(need)} more in {dirpath}, which has {gib(free)} free. Free space, move "
            f"run.root to a bigger disk, or lower checkpoint.keep_last"
        )


def resume_candidates(ckpt_dir: Path) -> list[Path]:
    """last.ckpt, then the step checkpoints newest first (by step number, never by name)."""
    last = ckpt_dir / LAST
    return ([last] if last.exists() else []) + step_files(ckpt_dir)


def find_good_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that loads; broken ones are moved to `corrupt/` with a warning."""
    for path in resume_candidates(ckpt_dir):
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


def remove_stale_temporaries(ckpt_dir: Path) -> None:
    """Delete the remains of writes that a kill interrupted (they were never renamed, so never used)."""
    for tmp in ckpt_dir.glob(f"*{TMP_MARK}*"):
        log.info("removing %s, left by an interrupted checkpoint write", tmp)
        tmp.unlink(missing_ok=True)


def resume_checkpoint(run_dir: Path, resume: bool, remote: RemoteCheckpoints | None = None) -> Path | None:
    """The checkpoint to continue from, or None to start fresh.

    With `resume=True` this is `checkpoints/last.ckpt` when it loads; when it does not (truncated, corrupted,
    written by an interrupted save) the newest step checkpoint that loads takes its place and last.ckpt is
    re-pointed at it. With `resume=False` an existing run is moved aside into `archive/<time>/` rather than
    deleted or mixed with the new run's checkpoints (or its cost ledger): starting over never destroys a user's run.

    With `remote` (checkpoint.remote), the newest remote checkpoint is downloaded first when it is newer than
    every local one (a new machine has none), verified against the pointer's size and sha256; with
    `resume=False` the remote pointer is set aside as `archive-<time>.json`.
    """
    ckpt_dir = run_dir / rundir.CHECKPOINTS
    if resume:
        if rank_zero_only.rank == 0 and remote is not None:
            fetch_remote(ckpt_dir, remote)
        if not ckpt_dir.is_dir():
            return None
        if rank_zero_only.rank == 0:  # other ranks wait for rank 0's repairs in Lightning's first barrier
            remove_stale_temporaries(ckpt_dir)
            good = find_good_checkpoint(ckpt_dir)
            if good is None:
                if any(ckpt_dir.glob("corrupt/*")):
                    log.warning("no checkpoint in %s loads; starting from scratch", ckpt_dir)
                return None
            last = ckpt_dir / LAST
            if good != last:
                replace_symlink(good.resolve(), last)
        last = ckpt_dir / LAST
        if rank_zero_only.rank != 0:
            # Under torchrun or srun every rank starts at once and may look while rank 0 re-points the link
            # (a dangling moment). Each rank reads the checkpoint only after the process-group rendezvous,
            # i.e. after rank 0's repairs: resume whenever there is anything to resume, never start fresh
            # beside a resuming rank 0 (if rank 0 found nothing loadable, this rank fails loudly instead).
            candidates = last.is_symlink() or last.exists() or any(ckpt_dir.glob(STEP_GLOB))
            return last if candidates else None
        if last.exists():
            log.info("resuming from %s (-> %s)", last, last.resolve().name)
            return last
        return None
    if rank_zero_only.rank != 0:
        return None  # rank 0 moves the old run aside; the others only need to start fresh
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
    return None


def fetch_remote(ckpt_dir: Path, remote: RemoteCheckpoints) -> Path | None:
    """Download the newest remote checkpoint when no local one is as new; returns it, or None."""
    good = None
    if ckpt_dir.is_dir():
        remove_stale_temporaries(ckpt_dir)
        good = find_good_checkpoint(ckpt_dir)
    local_step = -1
    if good is not None:
        local_step = read(good)["global_step"]
    fetched = remote.download_newest(ckpt_dir, newer_than=local_step, loads=loadable)
    if fetched is not None:
        replace_symlink(fetched, ckpt_dir / LAST)
        log.info(
            "resuming from %s (step %s), newer than any local checkpoint",
            remote.url,
            checkpoint_step(fetched),
        )
    elif good is None and remote.read_pointer():
        log.warning("no checkpoint in %s verifies; starting without one", remote.url)
    return fetched


def remote_checkpoints(
    c: CheckpointConfig, identity: dict[str, Any], run: RunConfig, run_dir: Path
) -> RemoteCheckpoints | None:
    """The run's remote checkpoint folder, `<checkpoint.remote>/<run dir under run.root>/checkpoints`, after a
    write probe (credentials, bucket, permissions) so that a bad URL fails before training, and claimed for
    this run (`RemoteCheckpoints.claim`: another run's folder, told by its `identity` (`run_identity`), is
    refused before anything is downloaded); None if off."""
    if c.remote is None:
        return None
    url = f"{c.remote.rstrip('/')}/{run_dir.relative_to(Path(run.root)).as_posix()}/checkpoints"
    check_writable(url, c.storage_options, c.retry_window_s)
    remote = RemoteCheckpoints(url, c.storage_options, c.keep_last, c.retry_window_s)
    if run.resume:
        remote.claim(rundir.read_run_id(run_dir), identity, c.run_id)
    else:  # starting over: the bucket's pointer is archived by resume_checkpoint
        remote.run_id, remote.identity = c.run_id or new_run_id(), identity
    return remote


def remote_behind(remote: RemoteCheckpoints, run_dir: Path) -> str | None:
    """At the end of a run: None when the bucket holds the run's latest checkpoint, else a message naming the
    step, the bucket and what is missing. The verdict goes to remote.json, for the report."""
    last = run_dir / rundir.CHECKPOINTS / LAST
    if not last.exists():
        return None
    step, size = checkpoint_step(last.resolve()), last.stat().st_size
    why = remote.holds(step, size)
    rundir.write_record(
        run_dir / rundir.REMOTE, {"url": remote.url, "step": step, "holds": why is None, "why": why}
    )
    if why is None:
        return None
    return (
        f"{remote.url} does not hold this run's latest checkpoint, step {step}: {why}. The local checkpoint "
        f"{last.resolve()} is intact and continues the run on this machine; a new machine would start from an "
        f"older step, or from scratch, until a later save is uploaded. Check the bucket (the upload errors "
        f"above say why)"
    )


def disk_findings(run_dir: Path, n_params: int, keep_last: int) -> list[Finding]:
    """The doctor's disk check: free space for keep_last + 1 checkpoints (the save guard's own arithmetic)."""
    ckpt = estimate_checkpoint_bytes(n_params)
    keep, need, free = checkpoint_space(run_dir / rundir.CHECKPOINTS, ckpt, keep_last)
    what = f"{keep}+1 checkpoints of ~{gib(ckpt)} need {gib(max(need, 0))}; {gib(free)} free at {run_dir}"
    if need > free:
        return [
            Finding(
                "disk",
                "error",
                what,
                "no crash at the first save",
                f"checkpoint.keep_last={max(1, int(free / (ckpt * 1.05)) - 1)} or run.root=<bigger disk>",
            )
        ]
    return [Finding("disk", "ok", what)]
