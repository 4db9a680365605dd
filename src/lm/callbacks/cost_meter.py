"""CostMeter: tokens/s, MFU, peak memory and the run's dollars, kept in the checkpoint across resumes.

Lightning's ThroughputMonitor is not used: it synchronises the GPU on every batch to time it. This meter
reads the wall clock only at step boundaries and derives rates over a window of steps, so the hot path
never waits on the device.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lm.checkpoint.run_state import MeterState, RunState
from lm.numbers import cost
from lm.numbers.batch_ramp import BatchRamp
from lm.store import rundir
from lm.store.rundir import BUCKETS
from lm.store.tensorboard_layout import log_loss_by_cost


class CostMeter(Callback):
    """Meters a run's time and money: `perf/*` and `cost/*` every `log_every` optimizer steps.

    Money is wall-clock seconds x $/hour x devices / 3600, accumulated over every process of the run.
    The ledger (`cost.json` in `run_dir`, rewritten at each log point) outlives a crash, so a resumed run
    also pays for the steps its predecessor did after its last checkpoint. What it carries across resumes is
    the `meter` section of the run's `RunState` (`state`), saved and restored with the rest of it.
    """

    def __init__(
        self,
        *,
        tokens_per_device_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        price_per_hour: float | None,
        log_every: int,
        run_dir: Path | None = None,
        started_at: float | None = None,
        about: dict[str, Any] | None = None,
        ramp: BatchRamp | None = None,
        run_state: RunState,
        flops_at: Callable[[int], float] | None = None,
    ) -> None:
        self.run = run_state
        self.tokens_per_device_step = tokens_per_device_step
        self.tokens_per_step = tokens_per_device_step  # x world size, known at setup
        # The tokens of each step (a batch-size ramp's first steps have fewer); one device's until setup.
        self.ramp = ramp if ramp is not None else BatchRamp(tokens_per_device_step)
        self.flops_per_token = flops_per_token
        self.flops_at = flops_at or (lambda step: flops_per_token)
        """FLOPs per token of optimizer step `step` (0-based): a sequence-length warm-up's shorter windows do
        less attention, so its MFU is measured with the windows it trained, not the full one."""
        self._flops = 0.0  # FLOPs trained by this process, for MFU over each log window
        self.peak_flops = peak_flops
        self.price = price_per_hour
        self.log_every = max(1, log_every)
        self.run_dir = run_dir
        self.about = about or {}  # what the run resolved `auto` to (device, precision, ...), for the report
        self.n_devices = 1
        self._bucket = "startup"
        self._resumed = False
        self._mark = started_at if started_at is not None else time.monotonic()
        self._window: tuple[float, int, float] | None = None  # (train seconds, tokens, FLOPs) at the last log
        self.last_rate: float | None = None

    @property
    def state(self) -> MeterState:
        """The run's cost ledger (RunState's `meter` section)."""
        return self.run.meter

    # --- clock -------------------------------------------------------------------------------------------

    def switch(self, bucket: str) -> None:
        """Charge the time since the last switch to the current bucket and start charging `bucket`."""
        now = time.monotonic()
        # A resumed process's start-up is a cost of the restart, not of training.
        charged = "restart" if self._bucket == "startup" and self._resumed else self._bucket
        self.state.seconds[charged] += now - self._mark
        self._mark, self._bucket = now, bucket

    def usd(self, seconds: float | None = None) -> float | None:
        """Dollars for `seconds` (default: the whole run so far) on this run's devices."""
        if self.price is None:
            return None
        return cost.usd(self.state.total_seconds if seconds is None else seconds, self.price, self.n_devices)

    # --- Lightning hooks ---------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.n_devices = trainer.world_size
        self.tokens_per_step = self.tokens_per_device_step * trainer.world_size
        self.ramp = replace(self.ramp, world=trainer.world_size)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stride = getattr(pl_module, "stride", None)  # `auto` decided at setup (LMModule)
        if stride is not None:
            self.about["activation_checkpointing"] = stride.every
        for logger in trainer.loggers:  # TensorBoard's hparams tab: what the run resolved `auto` to
            logger.log_hyperparams(self.about)
        self.switch("train")
        self._window = (self.state.seconds["train"], self.state.tokens, self._flops)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._bucket != "train":
            self.switch("train")

    def count(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The step boundary's first act: the tokens of the optimizer step just taken (and the steps before
        it since the last count); `perf/*` and `cost/*` every `log_every` steps."""
        tokens = self.ramp.tokens_through(trainer.global_step) - self.ramp.tokens_through(self.state.step)
        self._flops += tokens * self.flops_at(trainer.global_step - 1)
        self.state.tokens += tokens
        self.state.step = trainer.global_step
        if self.state.step % self.log_every == 0:
            self.switch("train")
            pl_module.log_dict(self.metrics(), on_step=True, on_epoch=False)
            self.write_ledger(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.switch("eval")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.switch("train")
        loss = trainer.callback_metrics.get("val/loss")
        if self.price and loss is not None and isinstance(trainer.logger, TensorBoardLogger):
            log_loss_by_cost(trainer.logger, float(loss), self.usd() or 0.0)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After every on_train_end, so the final checkpoint's write is charged before the ledger closes.
        self.switch("train")
        self.write_ledger(trainer)

    def before_restore(self) -> float:
        """Called just before a checkpoint's RunState replaces the ledger: this process's start-up so far."""
        self.switch("startup")
        return self.state.seconds["startup"]

    def restored(self, startup: float) -> None:
        """Called once the checkpoint's ledger is in place: this start-up is a restart's cost, and time the
        previous process spent after that checkpoint (cost.json) is paid for."""
        self.state.restarts += 1
        self._resumed = True
        self.state.seconds["restart"] += startup
        ledger = rundir.read_ledger(self.run_dir) if self.run_dir is not None else None
        if ledger is None:
            return
        later = {b: max(0.0, ledger["seconds"].get(b, 0.0) - self.state.seconds[b]) for b in BUCKETS}
        if ledger.get("step") == self.state.step:
            # Nothing was trained after this checkpoint: what the ledger holds beyond it is real time of its
            # own bucket (the final save's write, which the snapshot precedes; the shutdown).
            for bucket, seconds in later.items():
                self.state.seconds[bucket] += seconds
        else:
            # Work the previous process did after this checkpoint was written is paid for but redone.
            self.state.seconds["restart"] += sum(later.values())

    # --- metrics -----------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The `perf/*` and `cost/*` scalars at this point of the run."""
        s = self.state
        train_seconds, tokens, flops = self._window or (0.0, 0, 0.0)
        window_s, window_tokens = s.seconds["train"] - train_seconds, s.tokens - tokens
        window_flops = self._flops - flops
        self._window = (s.seconds["train"], s.tokens, self._flops)
        out: dict[str, float] = {"train/tokens": float(s.tokens)}
        if window_s > 0 and window_tokens > 0:
            self.last_rate = window_tokens / window_s
            out["perf/tokens_per_sec"] = self.last_rate
            util = cost.mfu(self.last_rate, window_flops / window_tokens, self.peak_flops, self.n_devices)
            if util is not None:
                out["perf/mfu"] = util
        out["perf/peak_mem_gb"] = peak_memory_gb()
        out["cost/hours"] = sum(s.seconds.values()) / 3600  # what an unpriced run's report plots against
        if self.price:  # an unpriced run (or a $0 one: a CPU) would plot a row of flat zeros
            total = self.usd()
            out["cost/usd"] = total
            for bucket in BUCKETS:
                out[f"cost/usd_{bucket}"] = self.usd(s.seconds[bucket])
            if s.tokens:
                out["cost/usd_per_billion_tokens"] = total / s.tokens * 1e9
        return out

    def write_ledger(self, trainer: pl.Trainer) -> None:
        """Record the run's time so far beside the checkpoints (atomically; rank 0 only)."""
        if self.run_dir is None or not trainer.is_global_zero:
            return
        record = {
            "seconds": self.state.seconds,
            "tokens": self.state.tokens,
            "step": self.state.step,
            "usd": self.usd(),
            "price_per_hour": self.price,
            "devices": self.n_devices,
            "run": self.about,
        }
        rundir.write_ledger(self.run_dir, record)


def peak_memory_gb() -> float:
    """Peak device memory on CUDA (allocator high-water mark), else the process's peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB
