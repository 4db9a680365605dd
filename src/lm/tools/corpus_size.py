"""How many training tokens a corpus holds, before `lm plan` prices them: exact from a prepared corpus's
manifest, else estimated from its raw bytes over the run's tokenizer's bytes per token (measured on a sample),
or over a measured default for a byte-level BPE of the configured vocabulary when no tokenizer exists yet."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tokenizers import Tokenizer

from lm.base.exits import Refused
from lm.config import DataConfig
from lm.data import shards, sources
from lm.data.manifest import TOKENIZER, cache_key, dataset_dir, prepared_folder, train_tokens
from lm.data.tokenizer import load_tokenizer, load_tokenizer_spec


@dataclass(frozen=True)
class CorpusSize:
    """The corpus's training tokens, exact (a manifest, --corpus-tokens) or estimated (not prepared yet)."""

    tokens: int
    estimated: bool
    how: str
    """Where the number comes from, printed beside it."""

    def __str__(self) -> str:
        if self.estimated:
            return f"~{self.tokens:,} training tokens, an ESTIMATE: {self.how}"
        return f"{self.tokens:,} training tokens ({self.how})"


def corpus_size(data: DataConfig) -> CorpusSize:
    """Training tokens of the prepared corpus, from its manifest; estimated from the raw sources when it is
    not prepared yet (`estimate_corpus`), so that a plan comes before paying for the tokenizing."""
    folder = prepared_folder(data)
    if folder is not None:
        tokens = train_tokens(folder)
        return CorpusSize(tokens, estimated=False, how=f"exact: the manifest of {folder}")
    if data.source not in ("stdlib", "text"):
        raise Refused(
            f"the corpus (data.source={data.source}) is not prepared here and its size cannot be estimated "
            "without reading it: run `lm prepare <the same data overrides>` first, or give its size with "
            "--corpus-tokens N"
        )
    return estimate_corpus(data)


SAMPLE_BYTES = 1_000_000
"""Text of an unprepared corpus that the run's tokenizer encodes to measure its bytes per token (~1 s)."""
BYTES_PER_TOKEN = {
    512: 2.03,
    1024: 2.50,
    2048: 2.91,
    4096: 3.25,
    8192: 3.53,
    16384: 3.72,
    32768: 3.82,
    65536: 3.86,
}
"""Bytes on disk per training token (end-of-text included) of the byte-level BPE `lm prepare` trains, by
vocabulary size, measured on the bundled stdlib corpus, Python source (experiments/2026-11-24-startup/
bytes_per_token.py). The estimate's default when no tokenizer exists yet, interpolated in log2(vocabulary)
between sizes; prose and other languages compress differently, which is why it is labelled a default."""


def default_bytes_per_token(vocab_size: int) -> float:
    """BYTES_PER_TOKEN at `vocab_size`: interpolated in log2 between the measured sizes, the ends held."""
    sizes = sorted(BYTES_PER_TOKEN)
    v = min(max(vocab_size, sizes[0]), sizes[-1])
    hi = next(s for s in sizes if s >= v)
    lo = max(s for s in sizes if s <= v)
    if hi == lo:
        return BYTES_PER_TOKEN[lo]
    t = (math.log2(v) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return BYTES_PER_TOKEN[lo] + t * (BYTES_PER_TOKEN[hi] - BYTES_PER_TOKEN[lo])


def bytes_per_token(tokenizer: Tokenizer, texts: list[str]) -> float:
    """UTF-8 bytes per token of `texts` as prepared data counts them: each document ends with end-of-text."""
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts)) + len(texts)
    return sum(len(t.encode("utf-8")) for t in texts) / tokens


def run_tokenizer(data: DataConfig, plan: sources.UnitPlan) -> tuple[Tokenizer | None, str]:
    """The tokenizer the run will use, where one exists before preparing: data.tokenizer, or the one an
    interrupted `lm prepare` already trained into the dataset folder. (None, "") when it is yet to be trained."""
    if data.tokenizer is not None:
        return load_tokenizer_spec(data.tokenizer)[0], f"data.tokenizer={data.tokenizer}"
    path = dataset_dir(data, cache_key(data, plan)) / TOKENIZER
    if path.is_file():
        return load_tokenizer(path), f"the tokenizer `lm prepare` trained in {path.parent}"
    return None, ""


def estimate_corpus(data: DataConfig) -> CorpusSize:
    """Training tokens of an unprepared corpus: its bytes on disk (after data.max_bytes, less the validation
    share) over the bytes per token of the run's tokenizer on a sample of its training documents, or over
    `default_bytes_per_token` when no tokenizer exists yet. Compressed or JSON files hold other bytes than
    the text they yield, so for them the estimate is rougher."""
    plan = sources.plan_units(data)
    tokenizer, which = run_tokenizer(data, plan)
    if tokenizer is None:
        bpt = default_bytes_per_token(data.vocab_size)
        per = (
            f"{bpt:.2f} bytes per token, the default for a byte-level BPE of {data.vocab_size:,} tokens "
            "(measured on the stdlib corpus: lm.tools.corpus_size.BYTES_PER_TOKEN)"
        )
    else:
        sampled = dataclasses.replace(data, tokenizer_sample_bytes=SAMPLE_BYTES)
        texts = list(shards.sample_documents(sampled, plan, shards.forced_validation(data, plan)))
        if not texts:
            raise Refused(f"the corpus (data.source={data.source}) has no training document to sample")
        bpt = bytes_per_token(tokenizer, texts)
        sample_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        per = f"{bpt:.2f} bytes per token measured on a {sample_mb:.1f} MB sample with {which}"
    tokens = round(plan.n_bytes * (1 - data.val_fraction) / bpt)
    how = (
        f"{plan.n_bytes / 1e6:,.1f} MB of raw sources (less the {data.val_fraction:g} validation share) / "
        f"{per}; `lm prepare` makes it exact"
    )
    return CorpusSize(tokens, estimated=True, how=how)
