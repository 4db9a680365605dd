"""Health of a run: a throughput alarm (a sick host is often about to go) and non-finite losses.

Neither is allowed to pass silently: a slow host gets a checkpoint and a warning; a NaN or infinite loss is
skipped (its gradients dropped, the weights and optimizer untouched, the count logged), and a run of them rolls
back to the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lm.callbacks.spot import EXIT_DIVERGED, EXIT_PREEMPTED
from lm.parallel import grad_norm

log = logging.getLogger(__name__)


class ThroughputAlarm(pl.Callback):
    """Tokens/s below `ratio` x the run's own baseline for `window_s` seconds: save a checkpoint and warn.

    The seed's spot monitor used 60% for 2 minutes. The baseline is the median of `baseline_steps` steps after
    `warmup` steps of each invocation (a restart may land on a different GPU). Intervals that contain a
    validation or a checkpoint write are not throughput and are ignored.
    """

    def __init__(
        self, ratio: float = 0.6, window_s: float = 120.0, baseline_steps: int = 20, warmup: int = 5
    ):
        self.ratio, self.window_s = ratio, window_s
        self.baseline_steps, self.warmup = baseline_steps, warmup
        self.baseline: float | None = None
        self.alarms = 0
        self._samples: list[float] = []
        self._t: float | None = None
        self._step = -1
        self._slow_since: float | None = None
        self._interrupted = False
        self._saved_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._interrupted = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step:
            return  # mid-accumulation
        now, self._step = time.monotonic(), trainer.global_step
        ckpt = trainer.checkpoint_callback
        saved = getattr(ckpt, "_last_global_step_saved", -1)
        interrupted = self._interrupted or saved != self._saved_step
        self._interrupted, self._saved_step = False, saved
        last, self._t = self._t, now
        if last is None or interrupted:
            return
        tokens = batch.numel() * trainer.accumulate_grad_batches * trainer.world_size
        self.observe(tokens / max(now - last, 1e-9), now, trainer)

    def observe(self, tokens_per_s: float, now: float, trainer: pl.Trainer) -> None:
        """Feed one step's throughput; fires the alarm when it has been low for the whole window."""
        if self.baseline is None:
            self._samples.append(tokens_per_s)
            if len(self._samples) >= self.warmup + self.baseline_steps:
                self.baseline = statistics.median(self._samples[self.warmup :])
                log.info("throughput baseline: %.0f tokens/s", self.baseline)
            return
        fire = False
        if tokens_per_s >= self.ratio * self.baseline:
            self._slow_since = None
        else:
            self._slow_since = self._slow_since or now
            fire = now - self._slow_since >= self.window_s
        # Every rank reaches this line at the same steps; the save below is collective, so they must agree.
        if trainer.strategy.reduce_boolean_decision(fire, all=False):
            self._slow_since = None  # re-arm: another full window before the next alarm
            self.alarms += 1
            log.warning(
                "throughput %.0f tokens/s has been below %.0f%% of the %.0f tokens/s baseline for %g s: "
                "saving a checkpoint now (the host may be failing or about to be reclaimed)",
                tokens_per_s,
                100 * self.ratio,
                self.baseline,
                self.window_s,
            )
            ckpt = trainer.checkpoint_callback
            if ckpt is not None and hasattr(ckpt, "save_now"):
                ckpt.save_now(trainer)


class Diverged(SystemExit):
    """Training hit `max_nonfinite` non-finite losses in a row."""


class NonFiniteGuard(pl.Callback):
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

    def __init__(self, max_in_a_row: int = 3, ckpt_dir: str | Path | None = None) -> None:
        self.max_in_a_row = max_in_a_row
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        self.skipped = 0
        self.in_a_row = 0
        self._start_step = 0
        self._pending: tuple[int, HostFlag] | None = None  # (step, verdict) not yet read by the host
        self._trainer: pl.Trainer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step
        self._trainer = trainer

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.settle(log_metric=True)  # the previous step's verdict, long computed by now
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
            optimizer.found_inf = nonfinite.float()  # read by the fused kernel: no update when 1
            self._pending = (trainer.global_step, HostFlag(nonfinite))
            return
        if not nonfinite:  # a host sync, but only on the unfused path (CPU, fp16)
            self.in_a_row = 0
            return
        for p in pl_module.parameters():
            p.grad = None  # AdamW skips parameters without gradients: no update, no moment change
        self.record(trainer, trainer.global_step, log_metric=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.settle()

    def settle(self, log_metric: bool = False) -> None:
        """Read the deferred verdict of the last fused step, counting (and acting on) a skip."""
        if self._pending is None or self._trainer is None:
            return
        step, nonfinite = self._pending
        self._pending = None
        if bool(nonfinite):
            self.record(self._trainer, step, log_metric)
        else:
            self.in_a_row = 0

    def record(self, trainer: pl.Trainer, step: int, log_metric: bool) -> None:
        """Count a skipped step; roll back after `max_in_a_row` of them in a row."""
        self.skipped += 1
        self.in_a_row += 1
        if log_metric:  # only from hooks where Lightning allows logging
            trainer.lightning_module.log("train/skipped_steps", float(self.skipped))
        log.warning(
            "step %d: non-finite loss/gradients, step skipped (%d in a row, %d in this run)",
            step,
            self.in_a_row,
            self.skipped,
        )
        if self.in_a_row >= self.max_in_a_row:
            self.roll_back(trainer)

    def roll_back(self, trainer: pl.Trainer) -> None:
        """Exit without saving so the restart resumes from the last checkpoint; give up on a repeat."""
        saved = getattr(trainer.checkpoint_callback, "_last_global_step_saved", 0)
        key = str(max(self._start_step, saved))  # the step the restart will resume from
        record = self.ckpt_dir / "rollbacks.json" if self.ckpt_dir else None
        seen = json.loads(record.read_text()) if record and record.is_file() else {}
        if seen.get(key, 0) >= 1:
            log.error(
                "%d non-finite steps in a row again after rolling back to step %s: the divergence is "
                "deterministic. Lower optim.lr, raise optim.warmup_steps or inspect the data near step %d",
                self.in_a_row,
                key,
                trainer.global_step,
            )
            raise Diverged(EXIT_DIVERGED)
        if record and trainer.is_global_zero:
            seen[key] = seen.get(key, 0) + 1
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(seen))
        log.warning(
            "%d non-finite steps in a row: rolling back to the checkpoint at step %s (exit %d, restart me)",
            self.in_a_row,
            key,
            EXIT_PREEMPTED,
        )
        raise Diverged(EXIT_PREEMPTED)

    def state_dict(self) -> dict[str, Any]:
        self.settle()  # a checkpoint holds the count up to its own step
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = state_dict.get("skipped", 0)


def skips_on_device(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.found_inf` makes this optimizer skip its update on the device (fused Adam/AdamW),
    and nothing else sets it (fp16's GradScaler does, for its own overflow checks)."""
    fused = bool(getattr(optimizer, "defaults", {}).get("fused"))
    return (
        fused
        and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        and trainer.precision != "16-mixed"
    )


class HostFlag:
    """A device boolean copied to host memory without waiting for it; reading it waits for that copy only.

    `bool(device_tensor)` would wait for everything queued on the stream so far (the next step's forward and
    backward included); waiting on an event recorded right after the copy waits for nothing later.
    """

    def __init__(self, flag: torch.Tensor) -> None:
        cuda = flag.is_cuda
        self.value = torch.empty((), dtype=torch.bool, pin_memory=cuda)
        self.value.copy_(flag, non_blocking=cuda)
        self.value.host_staging = True  # lives on the host by construction (tests/test_sync.py)
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()

    def __bool__(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.value)
