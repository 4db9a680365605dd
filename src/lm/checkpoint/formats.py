"""How one checkpoint is laid out on disk: the seam where a second format plugs in.

`CheckpointFormat` is what the rest of `lm.checkpoint` asks of a format: save a training state under a path,
load it back, say whether one is there, list a folder's step checkpoints newest first. Two formats:

- `FullFile` (checkpoint.format=full, the default): one `torch.save` file per step, gathered on rank 0 (FSDP
  included), written atomically by rename.
- `ShardedFolder` (checkpoint.format=sharded, FSDP2 only): torch.distributed.checkpoint, every rank writing its
  own shards in parallel into `<path>.tmp-shards/`; rank 0 writes `meta.pt` once DCP's index is written (after
  every rank finished) and renames the folder to `<path>`, so a folder is visible (rotation, `last.ckpt`, the
  corruption check, resume) only when complete.

Both are listed, loaded and rotated the same way (`lm.checkpoint.files` reads either), so a run may switch
format between invocations and resume from whichever is newest.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from lm.checkpoint import files
from lm.store.atomic import discard

TMP_MARK = ".tmp-"  # `<name>.tmp-<pid>`: a write in progress, or the remains of one that was interrupted


class CheckpointFormat(Protocol):
    """A checkpoint layout: what writing, resume and rotation need of it."""

    collective: bool
    """Whether every rank calls `save` (its shards), or rank 0 alone (a full state it gathered)."""

    def save(self, checkpoint: dict[str, Any], path: Path) -> int:
        """Write `checkpoint` at `path` completely or not at all; returns the bytes written. An OSError leaves
        nothing of this write behind (the caller says what it means for the run)."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """The training state at `path`, on the CPU."""
        ...

    def exists(self, path: Path) -> bool:
        """Whether a (complete) checkpoint is at `path`."""
        ...

    def list(self, ckpt_dir: Path) -> list[Path]:
        """The folder's step checkpoints, newest first by step number."""
        ...


def temporary_path(path: Path) -> Path:
    """`<path>.tmp-<pid>`: where a write goes before its rename."""
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


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


class FullFile:
    """One file per step (`step-<N>.ckpt`, Lightning's format): torch.save into `<path>.tmp-<pid>` in the same
    directory, fsync, rename over `path`, fsync the directory. A kill at any moment leaves either the old file
    or the new one, never half of one."""

    collective = False

    def save(self, checkpoint: dict[str, Any], path: Path) -> int:
        tmp = temporary_path(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            size = tmp.stat().st_size
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
            fsync_dir(path.parent)  # make the rename itself durable
        except OSError:
            discard(tmp)  # never a second error over this one (a read-only filesystem refuses the unlink too)
            raise
        return size

    def load(self, path: Path) -> dict[str, Any]:
        return files.read(path)

    def exists(self, path: Path) -> bool:
        return path.is_file()

    def list(self, ckpt_dir: Path) -> list[Path]:
        return files.step_files(ckpt_dir)


class ShardedFolder:
    """A folder per step (`step-<N>.ckpt/`): every rank writes its shards with torch.distributed.checkpoint.

    Called on every rank with the sharded state dicts (`state_dict`, `optimizer_states`: DTensor shards) and
    Lightning's other keys. The write goes to `<path>.tmp-shards/`; DCP's coordinator writes its index there
    only after every rank's shards are written (and fsynced); rank 0 then writes `meta.pt` and renames the
    folder into place. A kill at any moment leaves the old checkpoints and, at worst, a `*.tmp-shards` folder
    that the next start deletes. A rank that fails (disk full, quota) fails the save on every rank: DCP
    gathers the error, each rank raises it as the OSError it was, and the previous checkpoints are intact.
    """

    collective = True
    SUFFIX = f"{TMP_MARK}shards"

    @classmethod
    def begin(cls, checkpoint: dict[str, Any], path: Path) -> tuple[bool, bool, Path, dict[str, Any]]:
        """(distributed, rank 0, the empty temporary folder, the tensors DCP writes) for a write at `path`;
        every rank returns once rank 0 has made the folder."""
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        rank0 = not distributed or dist.get_rank() == 0
        tmp = path.with_name(path.name + cls.SUFFIX)
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # the remains of a write this run abandoned
            tmp.mkdir(parents=True)
        if distributed:
            dist.barrier()
        tensors = {"state_dict": checkpoint["state_dict"]}
        tensors |= {f"optimizer_{i}": s for i, s in enumerate(checkpoint.get("optimizer_states", []))}
        return distributed, rank0, tmp, tensors

    def save(self, checkpoint: dict[str, Any], path: Path) -> int:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        distributed, rank0, tmp, tensors = self.begin(checkpoint, path)
        try:
            with warnings.catch_warnings():  # one process without a process group: "assuming" it is meant
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(tensors, checkpoint_id=tmp)
        except CheckpointException as e:  # raised on every rank when any rank failed
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise first_os_error(e) from e
        size, failed = 0, None
        if rank0:
            try:
                size = self.finish(checkpoint, tmp, path)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                failed = e
        if distributed:  # rank 0's failure is every rank's: none goes on to the next step's collectives
            box = [None if failed is None else (failed.errno, failed.strerror or str(failed), str(path))]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None and failed is None:
                failed = OSError(*box[0])
        if failed is not None:
            raise failed
        return size

    @staticmethod
    def finish(checkpoint: dict[str, Any], tmp: Path, path: Path) -> int:
        """Rank 0, once every shard and the index are written: `meta.pt`, then the folder renamed into place."""
        meta = {k: v for k, v in checkpoint.items() if k not in files.TENSOR_KEYS}
        with open(tmp / files.SHARDED_META, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        size = sum(p.stat().st_size for p in tmp.iterdir())
        if path.exists():  # the same step written before (a run resumed from an older checkpoint)
            files.remove(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return size

    def load(self, path: Path) -> dict[str, Any]:
        return files.read(path)

    def exists(self, path: Path) -> bool:
        return (path / files.SHARD_INDEX).is_file() and (path / files.SHARDED_META).is_file()

    def list(self, ckpt_dir: Path) -> list[Path]:
        return files.step_files(ckpt_dir)


class AsyncShardedFolder(ShardedFolder):
    """`ShardedFolder` written in the background (checkpoint.async_save): `save` stages every rank's shards into
    host memory (pinned on CUDA, reused from save to save) and returns; a thread writes them while training
    goes on. At most one save is in flight: the next `save` first finishes the previous one, and so does
    `wait` (the end of a run, a stop signal's exit, an exception). The folder becomes `<path>` and
    `on_complete(path)` runs (the `last.ckpt` link, rotation) on rank 0 only once every rank's shards and the
    index are written: until then the run's newest visible checkpoint is the previous one. A kill while the
    thread writes leaves only `<path>.tmp-shards`, which the next start deletes.

    The background thread's collectives run on a gloo group of their own, created at the first save (every
    rank saves together), so they never interleave with training's collectives on the default group.
    """

    def __init__(self) -> None:
        self.pending: tuple[Any, dict[str, Any], Path, Path] | None = None
        """(the write's future, the non-tensor state, the temporary folder, the final path)."""
        self.on_complete: Any = None
        """Rank 0's callable(path) once a checkpoint is complete and in place (set by the save callback)."""
        self.stager: Any = None
        self.group: Any = None
        self.failure: OSError | None = None
        """A failed background write (or rank 0's finish) found by `poll`, kept for the ranks to agree on
        (a vote at the step boundary) instead of raised on this rank alone."""

    def save(self, checkpoint: dict[str, Any], path: Path) -> int:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.wait()  # at most one in flight: its staging buffers are reused below
        distributed, _, tmp, tensors = self.begin(checkpoint, path)
        if self.stager is None:  # every rank together, at its first save
            self.stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))
            self.group = dist.new_group(backend="gloo") if distributed else None
        future = dcp.async_save(
            tensors, checkpoint_id=tmp, process_group=self.group, async_stager=self.stager
        )  # returns once the shards are staged: training may change the live tensors from here on
        # Copied now, while it is this step's: `meta.pt` is written when the shards are, steps later.
        meta = copy.deepcopy({k: v for k, v in checkpoint.items() if k not in files.TENSOR_KEYS})
        self.pending = (future, meta, tmp, path)
        return 0  # the size is known once written (`wait`)

    def poll(self) -> None:
        """Finish the save in flight if its write is done (rank 0 renames and links), without waiting. Its
        write is done on the ranks at different steps: a failure is kept in `failure`, never raised here, so
        no rank leaves the others in the next step's collectives."""
        if self.pending is not None and self.pending[0].done():
            try:
                self.wait()
            except OSError as e:
                self.failure = e

    def wait(self) -> int:
        """Block until the save in flight is written and in place; returns its size on rank 0 (else 0).
        A failed write raises the OSError on every rank (each rank's future carries DCP's gathered error)."""
        if self.pending is None:
            return 0
        import torch.distributed as dist
        from torch.distributed.checkpoint.api import CheckpointException

        future, meta, tmp, path = self.pending
        self.pending = None
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        try:
            future.result()
        except CheckpointException as e:
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise first_os_error(e) from e
        if not rank0:
            return 0
        try:
            size = self.finish(meta, tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.on_complete is not None:
            self.on_complete(path)
        return size


def first_os_error(e: Exception) -> OSError:
    """The OSError behind a failed DCP save (DCP gathers each rank's exception into one), so the caller says
    disk full or read-only as for a file; another cause becomes an OSError naming it."""
    failures = getattr(e, "failures", {}) or {}
    for cause in failures.values():
        if isinstance(cause, tuple):  # (exception, its traceback's frames), as DCP gathers it
            cause = cause[0]
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, OSError):
            return cause
    return OSError(f"sharded save failed: {e}")


FULL_FILE = FullFile()
"""The default format."""
SHARDED = ShardedFolder()

FORMATS = {"full": FULL_FILE, "sharded": SHARDED}
"""`checkpoint.format` -> its layout (`AsyncShardedFolder()` with checkpoint.async_save: one per run, it holds
the save in flight)."""
