"""Data pipeline: corpus -> byte-level BPE -> cached token shards -> step-addressed batches."""

from collections.abc import Sequence

from lm.config import DataConfig, PhaseConfig
from lm.data.datamodule import LMDataModule
from lm.data.dataset import StepSampler, TokenWindows
from lm.data.manifest import (
    FORMAT_VERSION,
    cache_key,
    check_tokenizer,
    dataset_dir,
    implied_epochs,
    load_manifest,
    shard_paths,
)
from lm.data.mixture import MixtureDataModule
from lm.data.shards import prepare
from lm.data.stdlib import stdlib_documents
from lm.data.tokenizer import EOT, load_tokenizer

__all__ = [
    "EOT",
    "FORMAT_VERSION",
    "DataConfig",
    "LMDataModule",
    "MixtureDataModule",
    "StepSampler",
    "TokenWindows",
    "cache_key",
    "check_tokenizer",
    "data_module",
    "dataset_dir",
    "implied_epochs",
    "load_manifest",
    "load_tokenizer",
    "prepare",
    "shard_paths",
    "stdlib_documents",
]


def data_module(
    cfg: DataConfig, planned_tokens: int | None = None, phases: Sequence[PhaseConfig] = ()
) -> LMDataModule:
    """The data module a run trains from: a MixtureDataModule when data.mixture lists sources."""
    if cfg.mixture:
        return MixtureDataModule(cfg, planned_tokens, phases)
    return LMDataModule(cfg, planned_tokens)
