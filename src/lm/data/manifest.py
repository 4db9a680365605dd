"""A prepared dataset folder as training reads it: where it is, what its manifest says, and whether to trust it.

    <dir>/tokenizer.json            the tokenizer that made every shard (its sha256 is in the manifest)
    <dir>/train-00000.bin ...       flat streams of token ids, each document followed by end-of-text
    <dir>/val-00000.bin ...         documents held out by a hash of their text (`sources.split_key`)
    <dir>/progress/                 plan.json and one record per finished unit (what a resume trusts)
    <dir>/manifest.json             written last: its presence means the folder is complete
    <dir>/verified.json             what training last verified of each shard (`data.verify=cached`)

`lm.data.shards` writes such a folder; everything that reads one (the data module, the doctor, `lm prepare`'s
summary, the object-storage mirror) goes through this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lm.base.exits import Refused
from lm.config import DataConfig
from lm.data import sources
from lm.data.sources import UnitPlan
from lm.data.tokenizer import file_sha256, load_tokenizer_spec, text_sha256
from lm.store.atomic import write_atomic
from lm.store.objects import is_url

log = logging.getLogger("lm.data")

FORMAT_VERSION = 3
"""Bump when the folder layout or token stream changes, so old caches get a new key instead of misreads, and
say what changed in `FORMAT_CHANGES`."""

FORMAT_CHANGES = {
    3: "format 3 holds documents out for validation by a hash of their text, where format 2 hashed their "
    "path as the glob returned it (so the same corpus in another folder got another validation set)",
}
"""What each format changed, for the refusal that meets an older folder."""


def format_refusal(folder: Path, found: object, fix: str) -> str:
    """The message for a dataset folder written in format `found` when this code writes `FORMAT_VERSION`."""
    changes = "; ".join(
        text for v, text in sorted(FORMAT_CHANGES.items()) if isinstance(found, int) and v > found
    )
    return (
        f"{folder} has dataset format {found} but this code reads format {FORMAT_VERSION}"
        + (f" ({changes})" if changes else "")
        + f"; {fix}"
    )


MANIFEST = "manifest.json"


TOKENIZER = "tokenizer.json"


PROGRESS = "progress"


VERIFIED = "verified.json"
"""Each shard's sha256 check and largest token id, keyed by the (size, mtime, recorded sha256) they were
computed for: a file that keeps all three is not read again."""


SCAN_BYTES = 16 << 20
"""Bytes read per step when a shard is hashed and scanned (a multiple of every token size)."""


class NotPrepared(FileNotFoundError, Refused):
    """A folder named as prepared data holds no manifest: a refusal (exit 78) that names the folder and the
    fix. Still a FileNotFoundError for the callers that ask whether a dataset exists."""


SPLITS = ("train", "val")


def resolve_cache_dir(cache_dir: str) -> Path:
    """Cache folder as a path; resolves the `${oc.env:...}` default when DataConfig is used without Hydra."""
    if "${" in cache_dir:
        from omegaconf import OmegaConf

        cache_dir = OmegaConf.create({"dir": cache_dir}).dir
    return Path(cache_dir).expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _tokenizer_identity(cfg: DataConfig) -> str | None:
    """What identifies a given tokenizer in the cache key: its file's sha256, or its hub name."""
    if cfg.tokenizer is None:
        return None
    path = Path(cfg.tokenizer).expanduser()
    path = path / TOKENIZER if path.is_dir() else path
    return file_sha256(path) if path.is_file() else cfg.tokenizer


def cache_key(cfg: DataConfig, plan: UnitPlan | None = None) -> str:
    """Short hash of everything that determines the prepared dataset's contents."""
    plan = plan or sources.plan_units(cfg)
    parts = {
        "format_version": FORMAT_VERSION,
        "source": cfg.source,
        "fingerprint": plan.fingerprint,
        "text_field": cfg.text_field if cfg.source in ("text", "hf") else None,
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "max_bytes": cfg.max_bytes,
        "tokenizer": _tokenizer_identity(cfg),
        "tokenizer_sample_bytes": cfg.tokenizer_sample_bytes if cfg.tokenizer is None else None,
        "eot_token": cfg.eot_token,
        "shard_bytes": cfg.shard_bytes,
        "max_line_chars": cfg.max_line_chars,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def dataset_dir(cfg: DataConfig, key: str | None = None) -> Path:
    """Folder where `prepare(cfg)` puts (or finds) the dataset: data.dir, else one named by the cache key."""
    if cfg.dir:
        return Path(cfg.dir).expanduser()
    return resolve_cache_dir(cfg.cache_dir) / f"{cfg.source}-{key or cache_key(cfg)}"


def summary(manifest: dict) -> str:
    """One line: documents and tokens per split."""
    s = manifest["splits"]
    return ", ".join(
        f"{k} {s[k]['documents']:,} documents / {s[k]['tokens']:,} tokens in {len(s[k]['shards'])} shard(s)"
        for k in SPLITS
    )


def implied_epochs(manifest: dict, budget_tokens: int) -> float:
    """How many passes over the training split a plan of `budget_tokens` makes."""
    return budget_tokens / max(manifest["splits"]["train"]["tokens"], 1)


def shard_paths(folder: Path, manifest: dict, split: str) -> list[Path]:
    """The split's shard files, in stream order."""
    return [folder / s["file"] for s in manifest["splits"][split]["shards"]]


def load_manifest(path: str | Path, verify: bool = False) -> dict:
    """Read a dataset folder's manifest (or the manifest file itself) and check the files it describes.

    Sizes are always checked; `verify=True` also recomputes every shard's sha256 and largest token id (slow
    on big corpora; `verify_shards` can remember the result).
    """
    folder = Path(path).expanduser()
    folder = folder.parent if folder.name == MANIFEST else folder
    fix = f"delete {folder} and rerun `lm prepare` to rebuild it"
    if not (folder / MANIFEST).is_file():
        hint = (
            " (an interrupted preparation: rerun `lm prepare` to finish it)"
            if (folder / PROGRESS).is_dir()
            else ""
        )
        raise NotPrepared(
            f"no {MANIFEST} in {folder}: it is not a prepared dataset{hint}; run `lm prepare` first "
            f"(`lm prepare data=text data.paths=... data.dir={folder}`), or point data.dir at the folder it wrote"
        )
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise Refused(f"{folder / MANIFEST} is not valid JSON ({e}); {fix}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise Refused(format_refusal(folder, manifest.get("format_version"), fix))
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            file = folder / shard["file"]
            expected = shard["tokens"] * itemsize
            actual = file.stat().st_size if file.is_file() else None
            if actual != expected:
                found = "is missing" if actual is None else f"has {actual} bytes"
                raise Refused(
                    f"{file} {found} but the manifest records {shard['tokens']} tokens ({expected} bytes): "
                    f"the dataset is truncated or corrupt; {fix}"
                )
    tokenizer = folder / TOKENIZER
    if not tokenizer.is_file() or file_sha256(tokenizer) != manifest["tokenizer_sha256"]:
        raise Refused(f"{tokenizer} is missing or is not the tokenizer the tokens were made with; {fix}")
    if verify:
        verify_shards(folder, manifest, "full")
    return manifest


def verify_shards(folder: Path, manifest: dict, mode: str) -> None:
    """Refuse shards whose bytes are not the ones the manifest records, or that hold a token id outside its
    vocabulary (which would index past the embedding). `load_manifest` has checked the sizes already.

    `size` stops there. `full` reads every shard: its sha256, and its largest id. `cached` does the same only
    for shards whose size, modification time or recorded sha256 changed since they were last verified, so
    the first run on a dataset pays one read of it and later runs a stat per shard; what it learns is kept in
    the folder's verified.json, when the folder is writable. A shard rewritten in place with its old size and
    mtime passes `cached`: `full` is the check for a dataset that may have rotted on disk.
    """
    if mode == "size":
        return
    known = read_verified(folder) if mode == "cached" else {}
    dtype = np.dtype(manifest["dtype"])
    shards = {s["file"]: s["sha256"] for split in SPLITS for s in manifest["splits"][split]["shards"]}
    stamps = {name: stamp(folder / name, sha) for name, sha in shards.items()}
    todo = [name for name in shards if (known.get(name) or {}).get("stamp") != stamps[name]]
    t0 = time.perf_counter()
    # hashlib and numpy let go of the GIL on large buffers: threads read several shards at once.
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1, 8))) as pool:
        max_ids = dict(zip(todo, pool.map(lambda n: scan_shard(folder, folder / n, shards[n], dtype), todo)))
    if todo:
        log.info("verified %d shard(s) of %s in %.1f s", len(todo), folder, time.perf_counter() - t0)
    verified = {n: {"stamp": stamps[n], "max_id": max_ids[n]} if n in max_ids else known[n] for n in shards}
    for name, entry in verified.items():
        check_ids(folder, folder / name, entry["max_id"], manifest["vocab_size"])
    if mode == "cached" and verified != known:
        try:
            write_atomic(folder / VERIFIED, json.dumps(verified, indent=1) + "\n")
        except OSError as e:  # a read-only or shared dataset: verified again next time, not refused
            log.warning(
                "could not record the verified shards in %s (%s); the next run hashes them again", folder, e
            )


def stamp(file: Path, sha256: str) -> list:
    """What a verification of `file` stays valid for: its size and mtime, and the sha256 it was checked against."""
    stat = file.stat()
    return [stat.st_size, stat.st_mtime_ns, sha256]


def read_verified(folder: Path) -> dict:
    """verified.json, or nothing (missing or unreadable: every shard is verified again)."""
    try:
        known = json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {k: v for k, v in known.items() if isinstance(v, dict) and {"stamp", "max_id"} <= v.keys()}


def scan_shard(folder: Path, file: Path, sha256: str, dtype: np.dtype) -> int:
    """Read `file` once: refuse it unless its sha256 is `sha256`; return its largest token id (-1 if empty)."""
    h, max_id = hashlib.sha256(), -1
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(SCAN_BYTES), b""):
            h.update(block)
            max_id = max(max_id, int(np.frombuffer(block, dtype).max()))
    if h.hexdigest() != sha256:
        raise Refused(
            f"{file} does not match the sha256 its manifest records ({folder / MANIFEST}): the shard is corrupt "
            f"or was changed after `lm prepare` wrote it; delete {folder} and rerun `lm prepare` to rebuild it"
        )
    return max_id


def check_ids(folder: Path, file: Path, max_id: int, vocab_size: int) -> None:
    """Refuse a shard holding an id the model has no embedding row for (an IndexError deep in a step)."""
    if max_id >= vocab_size:
        raise Refused(
            f"{file} holds token id {max_id}, outside the vocabulary of {vocab_size} that {folder / MANIFEST} "
            f"records: the shard does not belong to this manifest; delete {folder} and rerun `lm prepare`"
        )


def prepared_folder(cfg: DataConfig) -> Path | None:
    """The folder training will read, when it is known without preparing anything: `data=tokens`' data.dir
    (a local one: a URL is mirrored first), or a complete folder already in place for the other sources.
    None when the data is still to be prepared (or, for `hf`, found only by listing the hub)."""
    if is_url(cfg.dir):
        return None
    if cfg.source == "tokens":
        cfg.check_inputs()
        return Path(cfg.dir).expanduser()
    if cfg.dir is None and cfg.source == "hf":
        return None
    cfg.check_inputs()
    folder = dataset_dir(cfg)
    return folder if (folder / MANIFEST).is_file() else None


def check_tokenizer(cfg: DataConfig, folder: Path, manifest: dict) -> None:
    """Refuse shards that data.tokenizer did not make: their ids would mean other strings."""
    if manifest["eot_token"] != cfg.eot_token:
        raise Refused(
            f"{folder} separates documents with {manifest['eot_token']!r} but data.eot_token="
            f"{cfg.eot_token!r}; set data.eot_token={manifest['eot_token']!r}"
        )
    if cfg.tokenizer is None:
        return  # the folder's own tokenizer.json, already checked against the manifest
    _, text = load_tokenizer_spec(cfg.tokenizer)
    ours, theirs = text_sha256(text), manifest["tokenizer_sha256"]
    if ours != theirs:
        raise Refused(
            f"tokenizer mismatch: the shards in {folder} were made by a tokenizer with sha256 {theirs}, but "
            f"data.tokenizer={cfg.tokenizer!r} has sha256 {ours}. Train with the tokenizer the shards were "
            f"made with (data.tokenizer={folder / TOKENIZER}, or leave data.tokenizer unset), or re-run "
            f"`lm prepare` with data.tokenizer={cfg.tokenizer} to tokenize the corpus again"
        )


def train_tokens(folder: Path) -> int:
    """Training tokens of a prepared dataset folder, from its manifest."""
    return int(load_manifest(folder)["splits"]["train"]["tokens"])
