"""How one checkpoint is laid out on disk: the seam where a second format plugs in.

`CheckpointFormat` is what the rest of `lm.checkpoint` asks of a format: save a training state under a path,
load it back, say whether one is there, list a folder's step checkpoints newest first. `FullFile` is the one
format today: one `torch.save` file per step, gathered on rank 0 (FSDP included), written atomically. A
sharded, asynchronous format (torch.distributed.checkpoint: a folder per step, every rank writing its shards)
is a second implementation of the same four calls; rotation, the `last.ckpt` link and resume then need no
third path through the code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch

from lm.checkpoint import files
from lm.store.atomic import discard

TMP_MARK = ".tmp-"  # `<name>.tmp-<pid>`: a write in progress, or the remains of one that was interrupted


class CheckpointFormat(Protocol):
    """A checkpoint layout: what writing, resume and rotation need of it."""

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


FULL_FILE = FullFile()
"""The format every run writes today."""
