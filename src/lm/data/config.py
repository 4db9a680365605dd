"""Typed schema of the `data` config node (conf/data/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    """Where the tokens come from and how they are batched."""

    source: str = "stdlib"
    """Corpus: `stdlib` (the running interpreter's standard library source, bundled with every Python)."""
    cache_dir: str = "${oc.env:LM_CACHE,${oc.env:HOME}/.cache/lm}"
    """Folder for trained tokenizers and token shards; one sub-folder per prepared dataset."""
    vocab_size: int = 4096
    """BPE vocabulary size including the end-of-text token; the model's embedding is padded up from it."""
    seq_len: int = 256
    """Tokens per training window (the model sees seq_len inputs and predicts seq_len targets)."""
    batch_size: int = 16
    """Windows per micro-batch per device; tokens per optimizer step = batch_size x seq_len x accumulation x devices."""
    val_fraction: float = 0.02
    """Share of documents held out for validation, chosen by a hash of each document's name."""
    max_bytes: int | None = None
    """Read at most this many bytes of the corpus (whole documents, deterministic order); None reads all of it."""
    tokenizer_sample_bytes: int = 8_000_000
    """The tokenizer is trained on at most this many bytes of the training documents."""
    num_workers: int = 2
    """DataLoader worker processes; 0 loads batches in the training process and stalls the GPU."""
    pin_memory: bool = True
    """Page-locked host buffers for faster host-to-GPU copies (ignored without CUDA)."""
    persistent_workers: bool = True
    """Keep workers alive between validation and training instead of re-forking them."""
    seed: int = 0
    """Seed of the window order; order is a pure function of (seed, global step)."""
