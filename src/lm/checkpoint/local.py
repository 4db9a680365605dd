"""Writing checkpoints on the local disk: atomic saves, the `last.ckpt` link, rotation, the disk guard.

Two guarantees, because every crash in the seed's list of eight was infrastructure (when a run saves is
`lm.checkpoint.callback.RunCheckpoint`; file names and the loader are `lm.checkpoint.files`; the file layout
is `lm.checkpoint.formats`; finding what to resume is `lm.checkpoint.checkpointer`):
- a checkpoint file is either complete or absent (`AtomicCheckpointIO`, through the format's atomic save);
- a save that cannot fit is refused before it starts, and a failed save leaves the previous checkpoints
  intact and says what happened (`CheckpointSaveError`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from lm.base.exits import UNWRITABLE, CheckpointSaveError, Refused, RunDirRemoved, report_progress
from lm.base.findings import Finding
from lm.checkpoint.files import LAST, checkpoint_step, is_sharded, load, read, remove, step_files
from lm.checkpoint.formats import FULL_FILE, TMP_MARK, CheckpointFormat, fsync_dir, temporary_path
from lm.numbers.scale_out import recommend_format, save_plans
from lm.store import rundir
from lm.store.atomic import check_owned, nearest_folder, unwritable_cause, unwritable_fix

log = logging.getLogger(__name__)

SAFETY = 1.05  # free space asked for beyond the expected checkpoint size (the optimizer state grows a little)

# fp32 weights (4 bytes) + AdamW's two fp32 moments (8 bytes) per parameter; Lightning's metadata is noise.
BYTES_PER_PARAM = 12


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def estimate_checkpoint_bytes(n_params: int) -> int:
    """Size of a full training checkpoint: weights plus AdamW moments, all fp32."""
    return n_params * BYTES_PER_PARAM


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint plugin, saving through a `CheckpointFormat` (the full file by default: temporary,
    fsync, rename, fsync the directory).

    A kill at any moment leaves either the old checkpoint or the new one, never half of one. Before writing,
    the free space is checked against the last checkpoint's size (or `expected_bytes` before the first save).
    Replaces TorchCheckpointIO's save because its fsspec transaction neither fsyncs nor checks free space.
    """

    def __init__(self, expected_bytes: int = 0, fmt: CheckpointFormat = FULL_FILE) -> None:
        self.expected_bytes = expected_bytes
        """Bytes the next checkpoint is expected to take; updated to the real size after each save."""
        self.format = fmt
        self.defer = False
        """Keep a failed save (`failure`) instead of raising it: the saver sets it while Lightning's
        `save_checkpoint` runs, whose barrier the other ranks would otherwise wait in for ever."""
        self.failure: OSError | None = None

    @staticmethod
    def temporary_path(path: Path) -> Path:
        return temporary_path(path)

    def space_problem(self, path: Path) -> CheckpointSaveError | None:
        """Why a save at `path` would not fit (None: it fits), before touching the disk."""
        need = int(self.expected_bytes * SAFETY)
        free = free_space(nearest_folder(path.parent))
        if need <= free:
            return None
        return CheckpointSaveError(
            f"not saving {path.name}: it needs ~{gib(need)} and {path.parent} has {gib(free)} free. "
            f"The previous checkpoints are intact; free space (or lower checkpoint.keep_last) and rerun "
            f"the same command to resume from the last one"
        )

    def check_space(self, path: Path) -> None:
        """Refuse a save that would not fit, before touching the disk."""
        if (problem := self.space_problem(path)) is not None:
            raise problem

    def take_failure(self) -> OSError | None:
        """The failure a deferred save kept (cleared)."""
        failure, self.failure = self.failure, None
        return failure

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        try:
            # Deferred: the saver agreed the ownership and space checks across ranks just before; checked
            # again here, one rank alone could fail the second check and pair the wrong collectives.
            self.save(checkpoint, path, storage_options, checked=self.defer)
        except (CheckpointSaveError, RunDirRemoved) as e:
            if not self.defer:
                raise
            self.failure = e

    def save(
        self, checkpoint: dict[str, Any], path, storage_options: Any | None = None, *, checked: bool = False
    ) -> None:
        """`save_checkpoint`, raising its failure; `checked`: ownership and space were checked (and agreed)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        if not checked:
            check_owned(path)  # a run directory removed or taken over is never written into
            self.check_space(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            size = self.format.save(checkpoint, path)
        except OSError as e:
            raise CheckpointSaveError(
                f"saving {path} failed ({save_failure(e, path)}). The previous checkpoints "
                f"are intact; {save_fix(e)} and rerun the same command to resume"
            ) from e
        self.expected_bytes = max(self.expected_bytes, size)
        if getattr(self.format, "pending", None) is not None:
            if rank_zero_only.rank == 0:
                log.info("writing %s in the background", path.name)
            return
        report_progress(f"saved {path}")  # `lm supervise` starts its count of crashes in a row again

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None):
        """A resume's checkpoint read as data whatever `weights_only` says (`lm.checkpoint.files.load`: a file
        whose pickle would run code is refused): a file on the CPU, not memory-mapped (the optimizer keeps
        the loaded tensors), or a sharded folder assembled whole (a resume on one process or under DDP: FSDP2
        reads its shards through the strategy instead). Replaces TorchCheckpointIO's load, which unpickles
        in full unless told otherwise."""
        path = Path(path)
        return read(path) if is_sharded(path) else load(path, mmap=False)


def save_failure(error: OSError, path: Path) -> str:
    """What went wrong with a checkpoint write, with the free space."""
    if error.errno in UNWRITABLE:
        return unwritable_cause(error, path)
    return f"{error.strerror or error}; {gib(free_space(nearest_folder(path)))} free in {path.parent}"


def save_fix(error: OSError) -> str:
    return unwritable_fix(error) if error.errno in UNWRITABLE else "fix the cause (disk full? quota?)"


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
        remove(path)
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
    return keep, need, free_space(probe)


def free_space(folder: Path) -> int:
    """Bytes free on `folder`'s filesystem: this module's one reading of the host's disk (the rotation check
    before a run, the guard before each save, a failed save's message). The doctor's tests pin it, so that the
    seed's plan is judged the same on any test machine."""
    return shutil.disk_usage(folder).free


def check_run_fits(dirpath: Path, ckpt_bytes: int, keep_last: int) -> None:
    """Refuse to start a run whose rotation cannot fit on its disk."""
    dirpath.mkdir(parents=True, exist_ok=True)
    keep, need, free = checkpoint_space(dirpath, ckpt_bytes, keep_last)
    if need > free:
        raise Refused(
            f"checkpoints will not fit: keeping {keep} of ~{gib(ckpt_bytes)} each (plus one being written) "
            f"needs {gib(need)} more in {dirpath}, which has {gib(free)} free. Free space, move "
            f"run.root to a bigger disk, or lower checkpoint.keep_last"
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


def host_memory_bytes() -> int | None:
    """This machine's physical memory, None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def format_findings(
    n_params: int, world: int, strategy: str, fmt: str, async_save: bool, host_bytes: int | None
) -> list[Finding]:
    """The doctor's checkpoint-format line for a sharded run (FSDP2 on more than one process): which format
    the save should use and why (`lm.numbers.scale_out.recommend_format`: the full file while its gathered
    copy is at most a quarter of rank 0's host memory, else sharded), and the host memory each takes, the
    pinned staging of async saves included. Nothing to say for one process or DDP (every rank has it all)."""
    if strategy != "fsdp" or world <= 1:
        return []
    best, why = recommend_format(n_params, world, host_bytes)
    plans = {p.format: p for p in save_plans(n_params, world)}
    chosen = plans["async" if async_save else fmt]
    node = f" of {gib(host_bytes)}" if host_bytes else ""
    what = (
        f"checkpoint.format={fmt}{' async' if async_save else ''}: {gib(chosen.host_bytes_per_node)} host "
        f"memory per save on the busiest node{node}{', pinned for the run' if async_save else ''}; "
        f"{best} recommended: {why}"
    )
    if host_bytes and chosen.host_bytes_per_node > 0.5 * host_bytes:
        fix = "checkpoint.format=sharded" if fmt == "full" else "more nodes (a smaller shard each)"
        return [Finding("checkpoint", "error", what, "no host out-of-memory at the first save", fix)]
    if best != fmt:
        fix = (
            "checkpoint.format=sharded checkpoint.async_save=true"
            if best == "sharded"
            else "checkpoint.format=full"
        )
        return [Finding("checkpoint", "warn", what, "the cheaper save for this size", fix)]
    return [Finding("checkpoint", "ok", what)]
