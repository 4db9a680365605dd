"""KeepTokenizer: the run directory keeps the tokenizer its run trains with (`rundir.keep_tokenizer`)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lm.data.manifest import TOKENIZER
from lm.store import rundir


class KeepTokenizer(Callback):
    """At setup, after the data is prepared (the tokenizer may be trained only then) and before the first
    step: rank 0 copies the data's tokenizer.json into the run directory, or refuses a resume whose data was
    made by another tokenizer (exit 78)."""

    priority = 10  # setup only: its place among lm's callbacks does not matter

    def __init__(self, run_dir: Path, resumed: bool) -> None:
        self.run_dir = run_dir
        self.resumed = resumed

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            data = trainer.datamodule
            eot = data.manifest["eot_token"]
            rundir.keep_tokenizer(
                self.run_dir, data.data_dir / TOKENIZER, eot, data.eot_id, resumed=self.resumed
            )
