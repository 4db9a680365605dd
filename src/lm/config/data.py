"""Schemas of the data section: one corpus (`DataConfig`) or a weighted mixture of them (`MixtureSource`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lm.base.exits import Refused

SOURCES = ("stdlib", "text", "hf", "tokens")
VERIFY = ("size", "cached", "full")
ON_EXHAUSTED = ("stop", "renormalise")


@dataclass
class MixtureSource:
    """One corpus of a weighted data mixture (`data.mixture`, lm.data.mixture)."""

    name: str = "???"
    """Names the source in messages and in its metric `val/loss/<name>`."""
    weight: float = 1.0
    """Share of the training windows (weights are normalised over the sources)."""
    dir: str | None = None
    """A folder `lm prepare` wrote, or its URL, as `data=tokens` takes it."""
    data: dict[str, Any] = field(default_factory=dict)
    """Instead of `dir`: the data.* fields of a corpus to prepare (`{source: text, paths: [...]}`); the
    fields it leaves out come from `data` (seq_len, vocab_size, tokenizer, cache_dir...)."""
    max_epochs: float | None = None
    """Cap on passes over this source's training windows; None repeats it as often as the weight asks."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise Refused(
                f"data.mixture source name {self.name!r} must be letters, digits, '_', '-' or '.' (it becomes "
                f"the metric val/loss/<name>)"
            )
        if (self.dir is None) == (not self.data):
            raise Refused(
                f"data.mixture source '{self.name}' needs exactly one of dir (a prepared folder) or data "
                f"(a corpus to prepare, e.g. {{source: text, paths: ['corpus/*.txt']}})"
            )
        if self.weight < 0 or (self.max_epochs is not None and self.max_epochs <= 0):
            raise Refused(
                f"data.mixture source '{self.name}': weight={self.weight} must be >= 0 and max_epochs="
                f"{self.max_epochs} positive or null"
            )


@dataclass
class DataConfig:
    """Where the tokens come from and how they are batched."""

    source: str = "stdlib"
    """`stdlib` (the interpreter's standard library source, bundled with every Python), `text` (local files:
    .txt/.md, .jsonl, .parquet, optionally .gz), `hf` (a Hugging Face dataset, streamed) or `tokens` (a folder
    that `lm prepare` already wrote)."""
    paths: Any = None
    """`text`: a glob or a list of globs (`corpus/**/*.jsonl`); `hf`: optional data files for the builder."""
    text_field: str = "text"
    """Field (.jsonl) or column (.parquet, `hf`) that holds each document's text."""
    name: str | None = None
    """`hf`: the dataset name (`HuggingFaceFW/fineweb-edu`, or a builder such as `json`)."""
    subset: str | None = None
    """`hf`: the dataset configuration (`sample-10BT`)."""
    split: str = "train"
    """`hf`: the split to read; validation is carved out of it by document."""
    dir: str | None = None
    """Folder of the prepared shards. `tokens`: required; other sources: None uses cache_dir/<source>-<hash>.
    A URL (`s3://bucket/tokens`) is object storage: `tokens` downloads it into cache_dir (every shard checked
    against the manifest's sha256); other sources prepare into cache_dir and upload there."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for a `dir` URL (e.g. `endpoint_url`); credentials come from the environment."""
    tokenizer: str | None = None
    """A tokenizer.json path or a Hugging Face tokenizer name; None trains a byte-level BPE on the corpus.
    With `tokens`, the shards must have been made by this tokenizer (checked by sha256)."""
    eot_token: str = "<|endoftext|>"
    """End-of-text token appended to every document; a loaded tokenizer must have it."""
    cache_dir: str = "${oc.env:LM_CACHE,${oc.env:HOME}/.cache/lm}"
    """Folder for trained tokenizers and token shards; one sub-folder per prepared dataset."""
    vocab_size: int = 4096
    """Id space of the model's embedding (padded up from it); a trained BPE gets exactly this many tokens."""
    seq_len: int = 256
    """Tokens per training window (the model sees seq_len inputs and predicts seq_len targets)."""
    batch_size: int = 16
    """Windows per micro-batch per device; tokens per optimizer step = batch_size x seq_len x accumulation x devices."""
    batch_ramp_steps: int = 0
    """Optimizer steps over which the micro-batch grows to batch_size in doubling stages (lm.numbers.batch_ramp:
    start 0.25 over 100 steps is batch_size/4 for steps 0-49, /2 for 50-99, full from 100); 0: no ramp."""
    batch_ramp_start: float = 0.25
    """The ramp's first share of batch_size (0 < start <= 1); each stage doubles it."""
    seq_len_warmup_steps: int = 0
    """Optimizer steps over which the training windows grow to seq_len in doubling stages, at equal tokens per
    step (lm.numbers.batch_ramp.seq_len_warmup: start 0.25 over 100 steps cuts each window into 4 of
    seq_len/4 for steps 0-49, 2 of seq_len/2 for 50-99); 0: full windows from the first step. Validation and
    export are unchanged."""
    seq_len_warmup_start: float = 0.25
    """The warm-up's first share of seq_len: 1/2, 1/4, 1/8... (seq_len must divide by its inverse)."""
    val_fraction: float = 0.02
    """Share of documents held out for validation, chosen by a hash of each document's text."""
    max_bytes: int | None = None
    """Read at most about this many bytes of the corpus (whole files or documents); None reads all of it."""
    tokenizer_sample_bytes: int = 8_000_000
    """The tokenizer is trained on at most this many bytes of the training documents."""
    shard_bytes: int = 256_000_000
    """Input bytes per unit of work; each unit writes one train and one val shard and is resumed as a whole."""
    num_proc: int | None = None
    """Processes that tokenize in `prepare`; None uses every core."""
    max_line_chars: int = 1_000_000
    """Documents with a longer line (minified code, base64 blobs) are skipped and reported: BPE on one giant
    pre-token is slow and they are rarely language."""
    num_workers: int = 2
    """DataLoader worker processes; 0 loads batches in the training process and stalls the GPU."""
    pin_memory: bool = True
    """Page-locked host buffers for faster host-to-GPU copies (ignored without CUDA)."""
    persistent_workers: bool = True
    """Keep workers alive between validation and training instead of re-forking them."""
    seed: int = 0
    """Seed of the window order; order is a pure function of (seed, global step)."""
    verify: str = "cached"
    """How training checks the prepared shards against their manifest before it reads them: `size` (every
    file's size), `cached` (also each shard's sha256 and largest token id, computed once per file and
    remembered in the folder's `verified.json` by size and modification time, so later runs only stat the
    files), or `full` (recompute both on every run)."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Several corpora trained on together, each window drawn from a source in proportion to its weight
    (lm.data.mixture); the source fields above are then unused. Empty: the one corpus described above."""
    on_exhausted: str = "stop"
    """When a source reaches its max_epochs: `stop` the run there, or `renormalise` the other weights."""

    def check_inputs(self) -> None:
        """The source's required fields; checked when data is prepared, so every data=* option composes."""
        if self.source == "text" and not self.paths:
            raise Refused("data=text needs data.paths, e.g. data.paths='corpus/**/*.txt'")
        if self.source == "hf" and not self.name:
            raise Refused("data=hf needs data.name, e.g. data.name=HuggingFaceFW/fineweb-edu")
        if self.source == "tokens" and not self.dir:
            raise Refused("data=tokens needs data.dir, the folder `lm prepare` wrote")

    def check_ramp(self) -> None:
        """The batch-size ramp's keys; a mixture's allocation counts full-batch steps, so it has no ramp."""
        if self.batch_ramp_steps < 0:
            raise Refused(
                f"data.batch_ramp_steps={self.batch_ramp_steps} must be >= 0 (0 turns the batch-size ramp off)"
            )
        if not 0 < self.batch_ramp_start <= 1:
            raise Refused(
                f"data.batch_ramp_start={self.batch_ramp_start} must be in (0, 1]: the share of data.batch_size "
                f"the ramp starts at, e.g. 0.25"
            )
        if self.batch_ramp_steps and self.mixture:
            raise Refused(
                "data.batch_ramp_steps is not supported with data.mixture yet (the mixture's allocation counts "
                "full-batch steps); set data.batch_ramp_steps=0"
            )

    def check_seq_len_warmup(self) -> None:
        """The sequence-length warm-up's keys: its windows must tile seq_len exactly, so a step's tokens and
        targets are the full windows' own."""
        if self.seq_len_warmup_steps < 0:
            raise Refused(
                f"data.seq_len_warmup_steps={self.seq_len_warmup_steps} must be >= 0 (0 turns the warm-up off)"
            )
        start = self.seq_len_warmup_start
        pieces = round(1 / start) if 0 < start <= 1 else 0
        if pieces < 1 or pieces & (pieces - 1) or abs(start * pieces - 1) > 1e-9:
            raise Refused(
                f"data.seq_len_warmup_start={self.seq_len_warmup_start} must be 1, 1/2, 1/4, 1/8...: the share "
                "of data.seq_len the warm-up's first windows have"
            )
        if self.seq_len_warmup_steps and self.seq_len % pieces:
            raise Refused(
                f"data.seq_len={self.seq_len} does not divide into {pieces} windows of "
                f"data.seq_len_warmup_start={start}; use a seq_len divisible by {pieces}"
            )

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise Refused(
                f"data.source {self.source!r} is unknown; use one of {', '.join(SOURCES)} (e.g. data=text)"
            )
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if self.paths is not None and not (
            isinstance(self.paths, (list, tuple)) and all(isinstance(p, str) for p in self.paths)
        ):
            raise Refused(f"data.paths={self.paths!r} must be a glob or a list of globs")
        if self.seq_len < 1 or self.batch_size < 1:
            raise Refused(f"data.seq_len={self.seq_len} and data.batch_size={self.batch_size} must be >= 1")
        self.check_ramp()
        self.check_seq_len_warmup()
        if self.shard_bytes < 1 or (self.num_proc is not None and self.num_proc < 1):
            raise Refused("data.shard_bytes and data.num_proc must be positive (num_proc null = every core)")
        if self.max_line_chars < 1:
            raise Refused(f"data.max_line_chars={self.max_line_chars} must be positive")
        if self.verify not in VERIFY:
            raise Refused(f"data.verify={self.verify!r} is unknown; use one of {', '.join(VERIFY)}")
        if self.on_exhausted not in ON_EXHAUSTED:
            raise Refused(
                f"data.on_exhausted={self.on_exhausted!r} is unknown; use one of {', '.join(ON_EXHAUSTED)}"
            )
        names = [s.name for s in self.mixture]
        if len(set(names)) < len(names) or (self.mixture and not sum(s.weight for s in self.mixture) > 0):
            raise Refused(
                f"data.mixture needs distinct source names and a positive total weight; got {names}"
            )
