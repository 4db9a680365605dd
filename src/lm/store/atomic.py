"""The one way lm writes a run's files: a crash or a full disk leaves the old file or the whole new one.

Every writer of a run file (`lm.store.rundir`, the report) goes through here, so a full disk (ENOSPC, or EDQUOT
for a quota) or a read-only filesystem (EROFS) is met in one place: the temporary is removed where the filesystem
allows it and `DiskFull` (exit 74: a restart would only fail again) names the file and the fix. Temporaries are
`.<name>.tmp-<pid>`; `remove_orphaned_temporaries` clears those whose process is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from lm.base.exits import DISK_FULL, UNWRITABLE, DiskFull, RunDirRemoved

log = logging.getLogger(__name__)

TMP = re.compile(r"\.tmp-(\d+)$")
"""`<name>.tmp-<pid>`: a write in progress, or the remains of one whose process was killed."""


_owned: dict[str, Callable[[], bool]] = {}
"""Run directories this process holds (`RunLock`), each with the check that it still does."""


def own(run_dir: Path, still_ours: Callable[[], bool]) -> None:
    """Before every write under `run_dir`, ask `still_ours()`: a folder removed or taken over by another
    trainer is never written into (`RunDirRemoved`, exit 74)."""
    _owned[os.path.abspath(run_dir)] = still_ours


def disown(run_dir: Path) -> None:
    _owned.pop(os.path.abspath(run_dir), None)


def lost_run_dir(path: Path) -> Path | None:
    """The run directory holding `path` that this process held and no longer does (removed, or taken over by
    another trainer); None when `path` is under none of them or it is still ours."""
    where = os.path.abspath(path)
    for root, still_ours in _owned.items():
        if (where == root or where.startswith(root + os.sep)) and not still_ours():
            return Path(root)
    return None


def check_owned(path: Path) -> None:
    """Refuse a write under a run directory this process held and no longer does."""
    if (root := lost_run_dir(path)) is not None:
        raise RunDirRemoved(removed_message(root, Path(path).name))


def removed_message(run_dir: Path, not_written: str | None = None) -> str:
    """What a run whose directory was removed (or taken over by another trainer) says as it stops."""
    what = f"; {not_written} was not written" if not_written else ""
    return (
        f"the run directory {run_dir} was removed while the run was training (or replaced: its .lock is gone "
        f"or another trainer's); nothing to save to{what} (its checkpoints and logs went with it, and this "
        f"process stops rather than write a partial copy into a folder that may now be another run's). "
        f"Restore the folder to resume, or start over with run.resume=false or another run.name"
    )


_deferred: dict[str, list[OSError]] = {}
"""Run directories whose write failures are kept instead of raised (`defer`), each with those kept."""


def defer(run_dir: Path) -> None:
    """From now on, a run file under `run_dir` that cannot be written (a full disk, a read-only filesystem,
    the directory removed) is kept for `deferred` instead of raised: the training step's boundary makes it
    this rank's vote, so every rank stops together (74) instead of this one alone, leaving the others in a
    collective. The file keeps its previous version (the write is atomic)."""
    _deferred.setdefault(os.path.abspath(run_dir), [])


def undefer(run_dir: Path) -> OSError | None:
    """Stop deferring under `run_dir`; the first failure kept and not yet taken, if any."""
    kept = _deferred.pop(os.path.abspath(run_dir), [])
    return kept[0] if kept else None


def deferred(run_dir: Path) -> OSError | None:
    """The first failure kept under `run_dir` (it stays kept: the run stops on it)."""
    kept = _deferred.get(os.path.abspath(run_dir))
    return kept[0] if kept else None


def keep(path: Path, error: OSError) -> None:
    """Keep `error`, a failed write of `path`, when its run directory defers failures (`defer`); else raise
    it. For the writers that do not go through this module (TensorBoard's event file)."""
    where = os.path.abspath(path)
    root = next((r for r in _deferred if where == r or where.startswith(r + os.sep)), None)
    if root is None:
        raise error
    if not _deferred[root]:
        log.error("%s; the run stops on it at the next step boundary, on every rank", error)
    _deferred[root].append(error)


@contextlib.contextmanager
def kept_if_deferred(path: Path) -> Iterator[None]:
    """Raise a failed write of `path`, or keep it when its run directory defers failures (`defer`)."""
    try:
        yield
    except OSError as e:
        keep(path, e)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` (text is UTF-8 encoded) to `path`: a hidden temporary beside it, fsync, then rename."""
    with kept_if_deferred(path), open_atomic(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def open_atomic(path: Path) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block ends (fsync, rename); on any error it is removed and
    `path` keeps its old content. For writers that want a file object (`savefig`)."""
    check_owned(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        discard(tmp)
        raise_unwritable(e, path)
        raise


def append_atomic(path: Path, data: bytes | str) -> None:
    """Append `data` to `path` whole or not at all: a failed append is cut back to the old end, so the next
    append never continues a torn line."""
    with kept_if_deferred(path):
        _append(path, data)


def _append(path: Path, data: bytes | str) -> None:
    check_owned(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    view = memoryview(data.encode("utf-8") if isinstance(data, str) else data)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only filesystem refuses the open itself
        raise_unwritable(e, path)
        raise
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):  # a read-only filesystem refuses the cut too
                os.ftruncate(fd, end)
            raise_unwritable(e, path)
            raise
    finally:
        os.close(fd)


def raise_unwritable(error: BaseException, path: Path) -> None:
    """Re-raise a full disk or a read-only filesystem as `DiskFull` naming the file, the cause and the fix;
    anything else returns."""
    if not isinstance(error, OSError) or error.errno not in UNWRITABLE or isinstance(error, DiskFull):
        return
    raise DiskFull(
        error.errno,
        f"writing {path} failed: {unwritable_cause(error, path)}. The file's previous version and the "
        f"checkpoints are intact; {unwritable_fix(error)} and rerun the same command to resume",
    ) from error


def unwritable_cause(error: OSError, path: Path) -> str:
    """Why `path` cannot be written, in words: the disk or quota is full (with the free space), or read-only."""
    if error.errno not in DISK_FULL:
        return f"{nearest_folder(path)} is on a read-only filesystem"
    folder = nearest_folder(path)
    free = shutil.disk_usage(folder).free
    what = "the quota" if error.errno == DISK_FULL[1] else "the disk"
    return f"{what} is full ({free / 2**20:.1f} MiB free in {folder})"


def unwritable_fix(error: OSError) -> str:
    """What to do about a full or read-only run root."""
    if error.errno not in DISK_FULL:
        return "remount it read-write (or point run.root at a writable disk)"
    return "free space (or point run.root at a bigger disk)"


def nearest_folder(path: Path) -> Path:
    """`path`'s folder, or its nearest ancestor that exists (where a write that failed early would have gone)."""
    folder = path.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    return folder


def discard(tmp: Path) -> None:
    """Remove a temporary that will never be renamed; where that fails too (a read-only filesystem refuses the
    unlink as it refused the write) it is left for `remove_orphaned_temporaries`, never raised over the error
    that matters."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not remove %s (%s); a later start removes it", tmp, e.strerror or e)


def remove_orphaned_temporaries(root: Path, skip: tuple[str, ...] = ()) -> list[Path]:
    """Delete `*.tmp-<pid>` files under `root` whose process is no longer alive (a kill or a full disk
    interrupted their write: they were never renamed, so never read); top-level folders in `skip` are left
    alone. Returns what was removed."""
    removed = []
    if not root.is_dir():
        return removed
    for top in root.iterdir():
        if top.name in skip:
            continue
        for path in [top, *top.rglob("*")] if top.is_dir() else [top]:
            m = TMP.search(path.name)
            if m and path.is_file() and not alive(int(m.group(1))):
                log.info("removing %s, left by an interrupted write", path)
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def alive(pid: int) -> bool:
    """Whether a process with this id runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
