"""CostMeter: tokens/s, MFU, peak memory and the run's dollars, kept in the checkpoint across resumes.

Lightning's ThroughputMonitor is not used: it synchronises the GPU on every batch to time it. This meter
reads the wall clock only at step boundaries and derives rates over a window of steps, so the hot path
never waits on the device.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lm.callbacks.steps import StepWatch
from lm.numbers import cost
from lm.numbers.batch_ramp import BatchRamp
from lm.store import rundir
from lm.store.rundir import BUCKETS


@dataclass
class Meter:
    """Everything the meter must carry across a resume."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    tokens: int = 0
    step: int = 0
    restarts: int = 0

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class CostMeter(Callback):
    """Meters a run's time and money: `perf/*` and `cost/*` every `log_every` optimizer steps.

    Money is wall-clock seconds x $/hour x devices / 3600, accumulated over every process of the run.
    The ledger (`cost.json` in `run_dir`, rewritten at each log point) outlives a crash, so a resumed run
    also pays for the steps its predecessor did after its last checkpoint.
    """

    priority = 190  # counts each step's tokens and time before every callback below reads them

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
    ) -> None:
        self.tokens_per_device_step = tokens_per_device_step
        self.tokens_per_step = tokens_per_device_step  # x world size, known at setup
        # The tokens of each step (a batch-size ramp's first steps have fewer); one device's until setup.
        self.ramp = ramp if ramp is not None else BatchRamp(tokens_per_device_step)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.price = price_per_hour
        self.log_every = max(1, log_every)
        self.run_dir = run_dir
        self.about = about or {}  # what the run resolved `auto` to (device, precision, ...), for the report
        self.state = Meter()
        self.n_devices = 1
        self._bucket = "startup"
        self._resumed = False
        self._mark = started_at if started_at is not None else time.monotonic()
        self._window: tuple[float, int] | None = None  # (train seconds, tokens) at the last log point
        self.steps = StepWatch()
        self.last_rate: float | None = None

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
        self.steps.start(trainer)
        self.switch("train")
        self._window = (self.state.seconds["train"], self.state.tokens)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._bucket != "train":
            self.switch("train")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.steps.ended(trainer):
            return
        self.state.tokens += self.ramp.tokens_through(trainer.global_step) - self.ramp.tokens_through(
            self.state.step
        )
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
        if not trainer.sanity_checking:
            self.switch("train")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After every on_train_end, so the final checkpoint's write is charged before the ledger closes.
        self.switch("train")
        self.write_ledger(trainer)

    def state_dict(self) -> dict[str, Any]:
        # Lightning asks for this exactly when it writes a checkpoint: what follows is checkpoint time.
        self.switch("checkpoint")
        return {
            "seconds": dict(self.state.seconds),
            "tokens": self.state.tokens,
            "step": self.state.step,
            "restarts": self.state.restarts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.switch("startup")
        startup = self.state.seconds["startup"]  # this process's start-up until the restore
        self.state = Meter(dict(state["seconds"]), state["tokens"], state["step"], state["restarts"] + 1)
        self._resumed = True
        self.state.seconds["restart"] += startup
        ledger = rundir.read_ledger(self.run_dir) if self.run_dir is not None else None
        if ledger is None:
            return
        later = {b: max(0.0, ledger["seconds"].get(b, 0.0) - self.state.seconds[b]) for b in BUCKETS}
        if ledger.get("step") == self.state.step:
            # Nothing was trained after this checkpoint: what the ledger holds beyond it is real time of its
            # own bucket (the final save's write, which the snapshot in `state_dict` precedes; the shutdown).
            for bucket, seconds in later.items():
                self.state.seconds[bucket] += seconds
        else:
            # Work the previous process did after this checkpoint was written is paid for but redone.
            self.state.seconds["restart"] += sum(later.values())

    # --- metrics -----------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The `perf/*` and `cost/*` scalars at this point of the run."""
        s = self.state
        train_seconds, tokens = self._window or (0.0, 0)
        window_s, window_tokens = s.seconds["train"] - train_seconds, s.tokens - tokens
        self._window = (s.seconds["train"], s.tokens)
        out: dict[str, float] = {"train/tokens": float(s.tokens)}
        if window_s > 0 and window_tokens > 0:
            self.last_rate = window_tokens / window_s
            out["perf/tokens_per_sec"] = self.last_rate
            util = cost.mfu(self.last_rate, self.flops_per_token, self.peak_flops, self.n_devices)
            if util is not None:
                out["perf/mfu"] = util
        out["perf/peak_mem_gb"] = peak_memory_gb()
        out["cost/hours"] = sum(s.seconds.values()) / 3600  # what an unpriced run's report plots against
        if self.price is not None:
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
