"""Checkpoint writing and resume discovery for a run directory."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only

from lm.config import CheckpointConfig

log = logging.getLogger(__name__)

LAST = "last.ckpt"


class RunCheckpoint(ModelCheckpoint):
    """`step-<N>.ckpt` every N steps, the newest `keep_last` by step number, and `last.ckpt`.

    Lightning's ModelCheckpoint saves only at interval steps; this one also saves the final step of an
    invocation (why: the next phase or a rerun must resume from where this one stopped, not from the last
    interval).
    """

    def __init__(self, dirpath: Path, cfg: CheckpointConfig) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step-{step}",
            auto_insert_metric_name=False,
            every_n_train_steps=cfg.every_n_steps,
            save_top_k=cfg.keep_last,
            monitor="step",  # keep the newest by step number, never by file-name order
            mode="max",
            save_last=True,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)


def resume_checkpoint(run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to continue from, or None to start fresh.

    With `resume=False` an existing run is moved aside into `archive/<time>/` rather than deleted or mixed
    with the new run's checkpoints (or its cost ledger): starting over never destroys a user's run.
    """
    last = run_dir / "checkpoints" / LAST
    if resume:
        if last.is_file():
            log.info("resuming from %s", last)
            return last
        return None
    if rank_zero_only.rank != 0:
        return None  # rank 0 moves the old run aside; the others only need to start fresh
    # Everything the run produced (checkpoints, tb, cost ledger, phases, report) but the invocation logs.
    produced = (
        sorted(p for p in run_dir.iterdir() if p.name not in ("hydra", "archive")) if run_dir.is_dir() else []
    )
    if produced:
        archive = run_dir / "archive" / time.strftime("%Y-%m-%d_%H-%M-%S")
        archive.mkdir(parents=True, exist_ok=True)
        for path in produced:
            path.rename(archive / path.name)
        log.warning(
            "run.resume=false: moved the previous run's %s to %s", [p.name for p in produced], archive
        )
    return None
