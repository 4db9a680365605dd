"""Data pipeline: corpus -> byte-level BPE -> cached token shards -> step-addressed batches."""

from lm.config import DataConfig
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
from lm.data.shards import prepare
from lm.data.stdlib import stdlib_documents
from lm.data.tokenizer import EOT, load_tokenizer

__all__ = [
    "EOT",
    "FORMAT_VERSION",
    "DataConfig",
    "LMDataModule",
    "StepSampler",
    "TokenWindows",
    "cache_key",
    "check_tokenizer",
    "dataset_dir",
    "implied_epochs",
    "load_manifest",
    "load_tokenizer",
    "prepare",
    "shard_paths",
    "stdlib_documents",
]
