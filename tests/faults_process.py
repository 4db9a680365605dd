"""Test-only process-level faults, added to a run as `+callbacks.pfault._target_=tests.faults_process.ProcessFault`.

Each fires once per `marker` file (so a rerun trains undisturbed) at optimizer step `step`, once the DataLoader
workers are up.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl

from tests.faults import fill

BALLAST = "ballast.bin"


class ProcessFault(pl.Callback):
    """action:
    raise_twice  an error in a hook, then another while Lightning handles the first (an error on the way out:
                 Lightning's teardown, which stops the DataLoader workers, is skipped)
    fill_disk    the filesystem of `path` fills up (a ballast file there), so the run's next write meets ENOSPC
    hold         the run waits at `step` until the file `path` exists (a live run, for as long as a test needs)
    """

    def __init__(self, action: str, marker: str, step: int = 0, path: str = "") -> None:
        self.action, self.marker, self.step, self.path = action, Path(marker), step, Path(path)

    def fire(self) -> bool:
        """True the first time across reruns."""
        if self.marker.exists():
            return False
        self.marker.write_text(self.action)
        return True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or not self.fire():
            return
        if self.action == "raise_twice":
            raise RuntimeError(f"fault injected at step {self.step}")
        if self.action == "fill_disk":
            fill(self.path / BALLAST)
        if self.action == "hold":
            deadline = time.monotonic() + 300
            while not self.path.exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.action == "raise_twice":
            raise RuntimeError("a second fault, while handling the first")
