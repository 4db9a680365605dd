"""`Checkpointer`: the one object a run asks about its checkpoints.

Behind it, one module per concern, each usable alone:

    files.py         names and reading (`last.ckpt`, `step-<N>.ckpt`, `read`, `loadable`)
    formats.py       how one checkpoint is laid out (`CheckpointFormat`; `FullFile` today, a sharded one later)
    local.py         writing on the local disk: `AtomicCheckpointIO`, the `last.ckpt` link, rotation, disk guard
    resume.py        where a run starts: `find_resume_point` or `archive_run`
    resume_check.py  whether this config may continue the checkpoint (`check_resumable`, `ResumeCheck`)
    remote.py        the bucket mirror: pointer protocol, background uploads, fetching a newer checkpoint
    callback.py      `RunCheckpoint`: when a run saves, which files it keeps, uploads
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lm.checkpoint import resume, resume_check
from lm.checkpoint.callback import RunCheckpoint
from lm.checkpoint.formats import FULL_FILE, CheckpointFormat
from lm.checkpoint.local import AtomicCheckpointIO
from lm.checkpoint.remote import RemoteCheckpoints, remote_behind, remote_checkpoints
from lm.config import CheckpointConfig, DataConfig, RunConfig
from lm.model import ModelConfig
from lm.store import rundir


class Checkpointer:
    """A run directory's checkpoints: the resume point or the archive of an old run, the check that this config
    may continue a checkpoint, the Trainer's writer and save callbacks, and the bucket mirror.

    `fmt` is the file layout every part reads and writes through (`lm.checkpoint.formats`).
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        remote: RemoteCheckpoints | None = None,
        fmt: CheckpointFormat = FULL_FILE,
    ) -> None:
        self.run_dir, self.cfg, self.remote, self.format = run_dir, cfg, remote, fmt

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
        return resume.find_resume_point(self.run_dir, self.remote)

    def archive_run(self) -> None:
        """Move the previous run aside (`run.resume=false`), and the bucket's pointer with it."""
        resume.archive_run(self.run_dir, self.remote)

    def check_resumable(
        self, ckpt_path: Path | None, model: ModelConfig, optimizer: str, data: DataConfig
    ) -> None:
        """Refuse to continue `ckpt_path` with another architecture, optimizer or data stream (exit 78)."""
        resume_check.check_resumable(ckpt_path, model, optimizer, data)

    def io(self) -> AtomicCheckpointIO:
        """The Trainer's checkpoint plugin, writing this checkpointer's format atomically."""
        return AtomicCheckpointIO(fmt=self.format)

    def callbacks(self, meter=None) -> list[pl.Callback]:
        """The resume check (first of all callbacks) and the save callback (last but the progress bar)."""
        return [resume_check.ResumeCheck(meter), RunCheckpoint(self.dir, self.cfg, self.remote)]

    def mirror_behind(self) -> str | None:
        """At the end of a run: None when there is no bucket or it holds the latest checkpoint, else what it
        lacks (`remote_behind`)."""
        return remote_behind(self.remote, self.run_dir) if self.remote is not None else None
