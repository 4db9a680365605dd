"""Benchmark-only callback: timestamps of the first training step and per-step times, optional SIGTERM."""

import json
import os
import signal
import statistics
import time

import lightning.pytorch as pl


class Clock(pl.Callback):
    def __init__(self, out: str, sigterm_at: int = -1) -> None:
        self.out, self.sigterm_at = out, sigterm_at
        self.record: dict = {"steps": []}
        self._t = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.sigterm_at:
            self.record["signal_at"] = time.time()
            self.dump()
            os.kill(os.getpid(), signal.SIGTERM)
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "first_step_end" not in self.record:
            self.record["first_step_end"] = time.time()
            self.record["start_step"] = trainer.global_step - 1
        self.record["steps"].append(time.perf_counter() - self._t)
        self.dump()

    def dump(self) -> None:
        steps = self.record["steps"][5:]
        self.record["median_step_s"] = statistics.median(steps) if steps else None
        with open(self.out, "w") as f:
            json.dump(self.record, f)
