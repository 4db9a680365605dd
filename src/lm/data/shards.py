"""Turn a corpus into a cached, tokenized dataset folder: tokenizer.json, train.bin, val.bin, manifest.json.

The .bin files are flat streams of token ids (uint16 when the vocabulary fits, else uint32), each document
followed by the end-of-text token, so training can memory-map them and read any window without parsing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from lm.data import stdlib
from lm.data.config import DataConfig
from lm.data.stdlib import Corpus, Document, stable_fraction
from lm.data.tokenizer import EOT, EOT_ID, MIN_VOCAB_SIZE, file_sha256, sample_texts, train_tokenizer

log = logging.getLogger("lm.data")

FORMAT_VERSION = 1
"""Bump when the folder layout or token stream changes, so old caches get a new key instead of misreads."""
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")
ENCODE_CHUNK = 256
"""Documents per encode_batch call: enough to keep the Rust threads busy, small enough to bound memory."""

# name -> (cheap fingerprint of the corpus, reader of its documents capped at max_bytes)
SOURCES: dict[str, tuple[Callable[[], str], Callable[[int | None], Corpus]]] = {
    "stdlib": (stdlib.fingerprint, stdlib.stdlib_documents),
}


def _source(name: str) -> tuple[Callable[[], str], Callable[[int | None], Corpus]]:
    if name not in SOURCES:
        raise ValueError(f"data.source {name!r} is unknown; use one of {sorted(SOURCES)} (e.g. data=stdlib)")
    return SOURCES[name]


def resolve_cache_dir(cache_dir: str) -> Path:
    """Cache folder as a path; resolves the `${oc.env:...}` default when DataConfig is used without Hydra."""
    if "${" in cache_dir:
        from omegaconf import OmegaConf

        cache_dir = OmegaConf.create({"dir": cache_dir}).dir
    return Path(cache_dir).expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def cache_key(cfg: DataConfig) -> str:
    """Short hash of everything that determines the prepared dataset's contents."""
    fingerprint, _ = _source(cfg.source)
    parts = {
        "format_version": FORMAT_VERSION,
        "source": cfg.source,
        "fingerprint": fingerprint(),
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "max_bytes": cfg.max_bytes,
        "tokenizer_sample_bytes": cfg.tokenizer_sample_bytes,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def dataset_dir(cfg: DataConfig, key: str | None = None) -> Path:
    """Folder where `prepare(cfg)` puts (or finds) the dataset; it exists only once complete."""
    return resolve_cache_dir(cfg.cache_dir) / f"{cfg.source}-{key or cache_key(cfg)}"


def is_validation(name: str, val_fraction: float) -> bool:
    """Whether document `name` is held out; depends only on the name, so it is stable as the corpus grows."""
    return stable_fraction(name, "val") < val_fraction


def check_config(cfg: DataConfig) -> None:
    """Fail fast, before any corpus is read, on values that cannot produce a dataset."""
    _source(cfg.source)
    if not 0 < cfg.val_fraction < 1:
        raise ValueError(
            f"data.val_fraction={cfg.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.02"
        )
    if cfg.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"data.vocab_size={cfg.vocab_size} is too small: a byte-level BPE needs 256 byte tokens, the "
            f"end-of-text token and at least one merge; use data.vocab_size>={MIN_VOCAB_SIZE}"
        )
    if cfg.max_bytes is not None and cfg.max_bytes <= 0:
        raise ValueError(f"data.max_bytes={cfg.max_bytes} must be positive, or null for the whole corpus")
    if cfg.tokenizer_sample_bytes <= 0:
        raise ValueError(f"data.tokenizer_sample_bytes={cfg.tokenizer_sample_bytes} must be positive")


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, val) by document, each non-empty and in the input order."""
    if len(docs) < 2:
        raise ValueError(
            f"the corpus has {len(docs)} document(s) but a train/val split needs at least 2; "
            "raise data.max_bytes (or set it to null)"
        )
    val_names = {d.name for d in docs if is_validation(d.name, val_fraction)}
    # Tiny corpora may hash every document to one side; move the closest document across.
    if not val_names:
        val_names = {min(docs, key=lambda d: stable_fraction(d.name, "val")).name}
    elif len(val_names) == len(docs):
        val_names.remove(max(docs, key=lambda d: stable_fraction(d.name, "val")).name)
    train = [d for d in docs if d.name not in val_names]
    val = [d for d in docs if d.name in val_names]
    return train, val


def write_tokens(
    tokenizer: Tokenizer, texts: Sequence[str], path: Path, dtype: np.dtype, vocab_size: int
) -> int:
    """Encode `texts` into `path` as one flat stream, each text followed by end-of-text; returns the count."""
    # The fast variant skips character offsets, which we never use (about a third less CPU); tokenizers>=0.20.
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    eot = np.array([EOT_ID], dtype=np.int64)
    n_tokens = 0
    with open(path, "wb") as f:
        for start in range(0, len(texts), ENCODE_CHUNK):
            encodings = encode_batch(texts[start : start + ENCODE_CHUNK], add_special_tokens=False)
            ids = np.concatenate([part for e in encodings for part in (np.asarray(e.ids, np.int64), eot)])
            if ids.max() >= vocab_size:
                raise ValueError(
                    f"the tokenizer produced id {ids.max()} >= data.vocab_size={vocab_size} while writing "
                    f"{path.name}; the tokenizer does not match the config: delete {path.parent} and rerun"
                )
            f.write(ids.astype(dtype).tobytes())
            n_tokens += len(ids)
    return n_tokens


def _build(cfg: DataConfig, out: Path, key: str) -> None:
    """Write the whole dataset into the (temporary) folder `out`; the manifest is written last."""
    t0 = time.perf_counter()
    fingerprint, read = _source(cfg.source)
    corpus = read(cfg.max_bytes)
    log.info(
        "read %d %s documents (%.1f MB); skipped %d files that are not UTF-8 and %d empty ones",
        len(corpus.documents), cfg.source, corpus.n_bytes / 1e6, len(corpus.skipped), corpus.empty,
    )  # fmt: skip
    train_docs, val_docs = split_documents(corpus.documents, cfg.val_fraction)

    # Sample the tokenizer's training text across the whole corpus, never from validation documents.
    t1 = time.perf_counter()
    spread = sorted(train_docs, key=lambda d: stable_fraction(d.name, "tokenizer"))
    tokenizer = train_tokenizer(
        sample_texts((d.text for d in spread), cfg.tokenizer_sample_bytes), cfg.vocab_size
    )
    tokenizer.save(str(out / TOKENIZER))
    log.info("trained a %d-token BPE in %.1f s", tokenizer.get_vocab_size(), time.perf_counter() - t1)

    # A literal "<|endoftext|>" inside a source file is text, not a document boundary.
    tokenizer.encode_special_tokens = True
    dtype = token_dtype(cfg.vocab_size)
    splits = {}
    for split, docs in zip(SPLITS, (train_docs, val_docs)):
        t1 = time.perf_counter()
        texts = [d.text for d in docs]
        n_tokens = write_tokens(tokenizer, texts, out / f"{split}.bin", dtype, cfg.vocab_size)
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        splits[split] = {"file": f"{split}.bin", "documents": len(docs), "tokens": n_tokens, "bytes": n_bytes}
        log.info(
            "%s: %d documents, %.1f MB -> %d tokens (%.2f bytes/token) in %.1f s",
            split, len(docs), n_bytes / 1e6, n_tokens, n_bytes / n_tokens, time.perf_counter() - t1,
        )  # fmt: skip

    manifest = {
        "format_version": FORMAT_VERSION,
        "source": cfg.source,
        "key": key,
        "fingerprint": fingerprint(),
        "dtype": dtype.name,
        "vocab_size": cfg.vocab_size,
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        "eot_id": EOT_ID,
        "eot_token": EOT,
        "tokenizer_sha256": file_sha256(out / TOKENIZER),
        "splits": splits,
        "skipped_files": corpus.skipped,
        "empty_files": corpus.empty,
        "config": {
            "source": cfg.source,
            "vocab_size": cfg.vocab_size,
            "val_fraction": cfg.val_fraction,
            "max_bytes": cfg.max_bytes,
            "tokenizer_sample_bytes": cfg.tokenizer_sample_bytes,
        },
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prepare_seconds": round(time.perf_counter() - t0, 2),
        "documents": {"train": [d.name for d in train_docs], "val": [d.name for d in val_docs]},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def prepare(cfg: DataConfig) -> Path:
    """Build the tokenized dataset for `cfg` if it is not cached yet; return its folder.

    The dataset is built in a temporary sibling folder and renamed into place only when complete, so an
    interrupted run never leaves a folder that a later run trusts, and concurrent runs cannot corrupt it.
    """
    check_config(cfg)
    key = cache_key(cfg)
    final = dataset_dir(cfg, key)
    if (final / MANIFEST).is_file():
        log.info("using the prepared dataset in %s", final)
        return final
    if final.exists():
        # Never produced by prepare (it renames complete folders only), so it is not trusted.
        log.warning("%s exists without a manifest; deleting and rebuilding it", final)
        shutil.rmtree(final)

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    log.info("preparing %s (building in %s)", final, tmp)
    t0 = time.perf_counter()
    try:
        _build(cfg, tmp, key)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process (e.g. another node on a shared disk) finished first; its copy is as good.
            if not (final / MANIFEST).is_file():
                raise
            log.info("another process prepared %s first; using it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s in %.1f s", final, time.perf_counter() - t0)
    return final


def load_manifest(path: str | Path) -> dict:
    """Read a dataset folder's manifest (or the manifest file itself) and check the files it describes."""
    folder = Path(path)
    folder = folder.parent if folder.name == MANIFEST else folder
    fix = f"delete {folder} and rerun prepare (or the training script) to rebuild it"
    if not (folder / MANIFEST).is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {folder}: it is not a prepared dataset; run prepare first")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / MANIFEST} is not valid JSON ({e}); {fix}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{folder} has dataset format {manifest.get('format_version')} but this code reads format "
            f"{FORMAT_VERSION}; {fix}"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        info = manifest["splits"][split]
        file = folder / info["file"]
        expected = info["tokens"] * itemsize
        actual = file.stat().st_size if file.is_file() else None
        if actual != expected:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise ValueError(
                f"{file} {found} but the manifest records {info['tokens']} tokens ({expected} bytes): "
                f"the dataset is truncated or corrupt; {fix}"
            )
    tokenizer = folder / TOKENIZER
    if not tokenizer.is_file() or file_sha256(tokenizer) != manifest["tokenizer_sha256"]:
        raise ValueError(f"{tokenizer} is missing or is not the tokenizer the tokens were made with; {fix}")
    return manifest
