"""A run's callback for ledger item j (`+callbacks.sync._target_=sync_probe.SyncProbe`, with this folder on
PYTHONPATH): counts the host-device synchronisations of each training step with
`torch.cuda.set_sync_debug_mode("warn")` (every copy or read that makes the host wait for the device warns
once), validation left out, and writes `{step: count}` and the commonest sites to `<out>/syncs.json` at teardown.

`before=true` puts back what lm did at every step before issue 54: three `self.log(name, <python float>)`
calls (`train/lr`, `train/spikes`, `phase/index`), each a blocking host-to-device copy, so one call measures
tokens/s with and without them.
"""

from __future__ import annotations

import collections
import json
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch


class SyncProbe(pl.Callback):
    def __init__(self, out: str, before: bool = False) -> None:
        self.out, self.before = Path(out), before
        self.step: int | None = None
        self.counts: dict[int, int] = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self._show = None

    def on_train_start(self, trainer, pl_module) -> None:
        if not torch.cuda.is_available():
            return
        warnings.simplefilter("always")  # every synchronising call, not once per line
        self._show = warnings.showwarning
        warnings.showwarning = self.seen
        torch.cuda.set_sync_debug_mode("warn")

    def seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message) or self.step is None:
            return self._show(message, category, filename, lineno, file, line)
        self.counts[self.step] += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
        if frames:
            self.sites[f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}"] += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.before:  # what train/lr and train/spikes did before issue 54
            pl_module.log("probe/lr", float(optimizer.param_groups[0]["lr"]))
            pl_module.log("probe/spikes", 0.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.before:  # what phase/index did before issue 54
            pl_module.log("probe/phase", 0.0, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer, pl_module) -> None:
        self.step = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.step = None
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        record = {
            "counts": {str(s): n for s, n in sorted(self.counts.items())},
            "sites": self.sites.most_common(8),
        }
        (self.out / f"syncs-{trainer.global_rank}.json").write_text(json.dumps(record))
