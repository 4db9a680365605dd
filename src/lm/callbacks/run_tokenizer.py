"""KeepTokenizer: the run directory keeps the tokenizer its run trains with (`rundir.keep_tokenizer`), checked
against the sha256 it recorded at every start: at preflight (`tokenizer_findings`, before anything changes)
and at setup, where a damaged copy is restored from the prepared data (`rundir.restore_tokenizer`)."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.checkpoint.files import step_files
from lm.config import DataConfig
from lm.data.manifest import TOKENIZER, prepared_folder
from lm.data.mixture import mixture_sources
from lm.store import rundir

log = logging.getLogger(__name__)


class KeepTokenizer(Callback):
    """At setup, after the data is prepared (the tokenizer may be trained only then) and before the first
    step: rank 0 copies the data's tokenizer.json into the run directory, restores a damaged copy from it on
    a resume, or refuses a resume whose data was made by another tokenizer (exit 78)."""

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


def prepared_tokenizer(data: DataConfig) -> Path | None:
    """The tokenizer.json of the data the run will read, when it is prepared already (for a mixture: the first
    source's, which `check_one_tokenizer` makes every source's); None when it is still to be prepared."""
    try:
        if data.mixture:
            sources = mixture_sources(data, train=False)
            folder = prepared_folder(sources[0]) if sources else None
        else:
            folder = prepared_folder(data)
    except (OSError, Refused) as e:  # a data problem: preparation reports it by name
        log.debug("doctor: prepared data not located (%s)", e)
        return None
    path = folder / TOKENIZER if folder is not None else None
    return path if path is not None and path.is_file() else None


def tokenizer_findings(run_dir: Path, data: DataConfig, resume: bool) -> list[Finding]:
    """Preflight: a run that will resume (run.resume and a checkpoint in its directory) keeps the tokenizer
    its tokenizer_info.json records; a damaged copy is restored at start from the prepared data when that
    holds the same tokenizer, else the run is refused here, before anything changes (naming both files)."""
    info = rundir.read_record(run_dir / rundir.TOKENIZER_INFO)
    if not resume or info is None or not step_files(run_dir / rundir.CHECKPOINTS):
        return []
    kept = run_dir / rundir.TOKENIZER
    try:
        source = rundir.restore_tokenizer(run_dir, prepared_tokenizer(data), write=False)
    except Refused as e:
        fix = f"copy a tokenizer.json with sha256 {info['sha256']} to {kept}, or run.resume=false"
        return [Finding("tokenizer", "error", str(e), "a run whose token ids mean what they did", fix)]
    if source is not None:
        what = f"{kept} is damaged (sha256 is not {rundir.TOKENIZER_INFO}'s): restored from {source} at start"
        return [Finding("tokenizer", "ok", what)]
    return [Finding("tokenizer", "ok", f"{kept} is the tokenizer {rundir.TOKENIZER_INFO} records")]
