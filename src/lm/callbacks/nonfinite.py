"""NonFiniteGuard: a NaN or infinite step is skipped and counted; a run of them rolls back to the checkpoint.

The step boundary (`lm.callbacks.step`) calls it: `judge` before each optimizer step, `settle` a step later."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NoReturn

import lightning.pytorch as pl
import torch

from lm.base.exits import EXIT_DIVERGED, EXIT_PREEMPTED, Diverged
from lm.callbacks.host_copy import HostCopy
from lm.checkpoint.callback import RunCheckpoint
from lm.checkpoint.run_state import RunState
from lm.engine.parallel import grad_norm
from lm.store import rundir

log = logging.getLogger(__name__)


class NonFiniteGuard:
    """Skip optimizer steps whose gradients are NaN or infinite; roll back after `max_in_a_row` in a row.

    Checked on the gradients just before the optimizer step: a non-finite loss makes them non-finite, and in
    data-parallel runs they are already all-reduced, so every rank takes the same decision without a
    collective. A skipped step leaves weights and AdamW moments untouched; the step still counts (the data
    stream moves past the batch, the schedule advances).

    With a fused AdamW (the default on GPUs) the check costs no host-device synchronisation: the verdict is
    handed to the fused kernel as its `found_inf` (the mechanism GradScaler uses), which skips the update on
    the device, and the host reads the verdict one step later, when the device has long finished it. Other
    optimizers (and fp16's scaler, which owns `found_inf`) get the direct check: the gradients are dropped.

    A rollback exits with `EXIT_PREEMPTED` without saving, so a restart resumes from the last checkpoint: a
    transient fault (a flaky GPU) replays cleanly. If the same checkpoint is rolled back to twice, the
    divergence is deterministic and the run stops with `EXIT_DIVERGED` for a human to look at.
    """

    def __init__(
        self,
        max_in_a_row: int,
        ckpt_dir: str | Path | None,
        run_state: RunState,
        saver: RunCheckpoint | None = None,
    ) -> None:
        self.saver = saver
        """The run's saver: the newest checkpoint, which a rollback returns to."""
        self.max_in_a_row = max_in_a_row
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        self.guards = run_state.guards
        """The counters, in RunState (a save inside a streak of skipped steps resumes inside it)."""
        self._start_step = 0
        self._pending: tuple[int, HostCopy] | None = None  # (step, verdict) not yet read by the host
        self._trainer: pl.Trainer | None = None

    def start(self, trainer: pl.Trainer) -> None:
        """At train start: the step a rollback returns to unless this process saves a later one."""
        self._start_step = trainer.global_step
        self._trainer = trainer

    def judge(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """This step's verdict, just before its optimizer step: skip it if its gradients are not finite."""
        # Global: all-reduced (DDP) or combined over shards (FSDP); LMModule computes it once per step.
        norm = (
            pl_module.gradient_norm()
            if hasattr(pl_module, "gradient_norm")
            else grad_norm(pl_module.parameters())
        )
        if norm is None:
            return
        nonfinite = ~torch.isfinite(norm)
        if skips_on_device(trainer, optimizer):
            skip_update(optimizer, trainer.global_step, nonfinite)
            self._pending = (trainer.global_step, HostCopy(nonfinite))
            return
        if not nonfinite:  # a host sync, but only on the unfused path (CPU, fp16)
            self.guards.in_a_row = 0
            return
        for p in pl_module.parameters():
            p.grad = None  # AdamW skips parameters without gradients: no update, no moment change
        self.record(trainer, trainer.global_step, log_metric=True)

    def settle(self, log_metric: bool = False) -> None:
        """Read the deferred verdict of the last fused step, counting (and acting on) a skip."""
        if self._pending is None or self._trainer is None:
            return
        step, nonfinite = self._pending
        self._pending = None
        if bool(nonfinite):
            self.record(self._trainer, step, log_metric)
        else:
            self.guards.in_a_row = 0

    def record(self, trainer: pl.Trainer, step: int, log_metric: bool) -> None:
        """Count a skipped step; roll back after `max_in_a_row` of them in a row."""
        g = self.guards
        g.skipped += 1
        g.in_a_row += 1
        if log_metric:  # only from hooks where Lightning allows logging
            trainer.lightning_module.log("train/skipped_steps", float(g.skipped))
        log.warning(
            "step %d: non-finite loss/gradients, step skipped (%d in a row, %d in this run)",
            step,
            g.in_a_row,
            g.skipped,
        )
        if g.in_a_row >= self.max_in_a_row:
            what = f"{g.in_a_row} non-finite steps in a row"
            roll_back(trainer, self.ckpt_dir, resume_step(self.saver, self._start_step), what)


def skips_on_device(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.found_inf` makes this optimizer skip its update on the device (fused Adam/AdamW),
    and nothing else sets it (fp16's GradScaler does, for its own overflow checks)."""
    fused = bool(getattr(optimizer, "defaults", {}).get("fused"))
    return (
        fused
        and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        and trainer.precision != "16-mixed"
    )


def skip_update(optimizer: torch.optim.Optimizer, step: int, verdict: torch.Tensor) -> None:
    """Hand `verdict` to the fused kernel as its `found_inf`: no update (weights, moments, step count) when
    true. Guards judging the same step combine (either one skips it); an earlier step's verdict is replaced,
    never carried over."""
    verdict = verdict.float()
    if getattr(optimizer, "lm_verdict_step", None) == step:
        verdict = torch.maximum(optimizer.found_inf, verdict)
    optimizer.found_inf, optimizer.lm_verdict_step = verdict, step


def resume_step(saver: RunCheckpoint | None, start_step: int) -> int:
    """The step a restart resumes from: the last checkpoint this process saved, or the one it started at."""
    saved = saver.saved_step if saver is not None else None
    return max(start_step, saved or 0)


def roll_back(
    trainer: pl.Trainer,
    ckpt_dir: Path | None,
    start_step: int,
    what: str,
    skip: tuple[int, int] | None = None,
) -> NoReturn:
    """Exit without saving so the restart resumes from the checkpoint at `start_step` (skipping the data
    window `skip` from there on); give up when that checkpoint was rolled back to before.

    `checkpoints/rollbacks.json` counts rollbacks per checkpoint step (`{"6": 1}`) and lists the skipped data
    windows (`"skip_windows": [[6, 11]]`), which the restart reads before its data loader is built.
    """
    key = str(start_step)
    record = ckpt_dir / rundir.ROLLBACKS if ckpt_dir else None
    seen = (rundir.read_record(record) if record else None) or {}
    if seen.get(key, 0) >= 1:
        log.error(
            "%s again after rolling back to the checkpoint at step %s: the divergence is deterministic. "
            "Lower optim.lr, raise optim.warmup_steps or inspect the data near step %d",
            what,
            key,
            trainer.global_step,
        )
        raise Diverged(EXIT_DIVERGED)
    if record and trainer.is_global_zero:
        seen[key] = seen.get(key, 0) + 1
        if skip is not None:
            seen["skip_windows"] = [*seen.get("skip_windows", []), list(skip)]
        rundir.write_record(record, seen)
    log.warning(
        "%s: rolling back to the checkpoint at step %s%s (exit %d, restart me)",
        what,
        key,
        f" and skipping the data of steps {skip[0]}-{skip[1]}" if skip is not None else "",
        EXIT_PREEMPTED,
    )
    raise Diverged(EXIT_PREEMPTED)
