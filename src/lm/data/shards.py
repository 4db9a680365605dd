"""Turn a corpus into a prepared dataset folder: tokenizer.json, token shards and manifest.json (the layout
and its readers are `lm.data.manifest`'s).

The corpus is planned into units (groups of whole files, or shards of a stream); worker processes tokenize
units in parallel, each writing its two shards atomically (temporary file, fsync, rename) and then a
progress record with their sha256. A rerun after an interruption verifies the recorded shards and
tokenizes only the units that have none. Training reads the shards of a split as one stream, in unit order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import shutil
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from tokenizers import Tokenizer

from lm.base.exits import Interrupted, Refused
from lm.config import DataConfig
from lm.data import sources
from lm.data.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    SPLITS,
    TOKENIZER,
    cache_key,
    dataset_dir,
    format_refusal,
    load_manifest,
    resolve_cache_dir,
    summary,
    token_dtype,
)
from lm.data.mirror import dataset_cache, fetch_dataset, upload_dataset
from lm.data.sources import Skip, Unit, UnitPlan, split_key
from lm.data.stdlib import stable_fraction
from lm.data.tokenize_pool import MAX_LISTED_DOCUMENTS, is_val, run_units, stop_on_signals
from lm.data.tokenizer import (
    MIN_VOCAB_SIZE,
    file_sha256,
    load_tokenizer_spec,
    sample_texts,
    text_sha256,
    tokenizer_id,
    train_tokenizer,
)
from lm.store.atomic import write_atomic
from lm.store.objects import is_url

log = logging.getLogger("lm.data")

MAX_LISTED_SKIPS = 1000
MAX_LOGGED_SKIPS = 20
"""Without a terminal for the progress bar, progress is logged this often."""
MANIFEST_CONFIG_KEYS = (
    "source", "paths", "name", "subset", "split", "text_field", "vocab_size", "val_fraction", "max_bytes",
    "tokenizer_sample_bytes", "shard_bytes", "max_line_chars",
)  # fmt: skip


def check_config(cfg: DataConfig) -> None:
    """Fail fast, before any corpus is read, on values that cannot produce a dataset."""
    if not 0 < cfg.val_fraction < 1:
        raise Refused(f"data.val_fraction={cfg.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.02")
    if cfg.vocab_size < MIN_VOCAB_SIZE:
        raise Refused(
            f"data.vocab_size={cfg.vocab_size} is too small: a byte-level BPE needs 256 byte tokens, the "
            f"end-of-text token and at least one merge; use data.vocab_size>={MIN_VOCAB_SIZE}"
        )
    if cfg.max_bytes is not None and cfg.max_bytes <= 0:
        raise Refused(f"data.max_bytes={cfg.max_bytes} must be positive, or null for the whole corpus")
    if cfg.tokenizer_sample_bytes <= 0:
        raise Refused(f"data.tokenizer_sample_bytes={cfg.tokenizer_sample_bytes} must be positive")


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


# --- the preparation ---------------------------------------------------------------------------------------


def forced_validation(cfg: DataConfig, plan: UnitPlan) -> dict[str, bool]:
    """{split key: is validation} overrides that give each split at least one document, decided before
    anything is tokenized (a small corpus hashes one-sided by chance: 10 documents at data.val_fraction=0.3
    leave val empty once in 35).

    Documents are read in unit order until one falls on each side, about 1 / data.val_fraction of them, so a
    large corpus costs a glance. Only a one-sided corpus is read whole: its document nearest the other side
    moves across (every copy of its text with it), or, with fewer than two distinct texts, it is refused here,
    naming the numbers, rather than after tokenizing.
    """
    skips: list[Skip] = []  # reported when the units are tokenized, or by the refusal below
    fractions: dict[str, float] = {}
    sides: set[bool] = set()
    documents = 0
    for unit in plan.units:
        for doc in sources.read_unit(unit, cfg, skips):
            documents += 1
            key = split_key(doc.text)
            fractions[key] = stable_fraction(key, "val")
            sides.add(fractions[key] < cfg.val_fraction)
            if len(sides) == 2:
                return {}
    if len(fractions) < 2:
        kinds = sorted({s.reason for s in skips})[:5]
        raise Refused(
            f"the corpus is too small to split into train and val: {documents} document(s) with "
            f"{len(fractions)} distinct text(s), {sum(s.count for s in skips)} input(s) skipped "
            f"({'; '.join(kinds) or 'none'}); each split needs a text of its own: add documents, or check "
            f"data.paths and data.text_field"
        )
    if True in sides:  # every document hashed to val: the one nearest train goes there
        return {max(fractions, key=fractions.__getitem__): False}
    return {min(fractions, key=fractions.__getitem__): True}


def sample_documents(cfg: DataConfig, plan: UnitPlan, forced: dict):
    """Training documents for the tokenizer: whole units visited in a hash order, validation left out.

    Stops once data.tokenizer_sample_bytes have been read, so a 30B-token corpus is not read to sample it.
    """
    skips: list[Skip] = []  # reported when the units are tokenized
    n_bytes = 0
    for unit in sorted(plan.units, key=lambda u: stable_fraction(str(u.files[:1] or u.index), "tokenizer")):
        for doc in sources.read_unit(unit, cfg, skips):
            if not is_val(doc.text, cfg, forced):
                yield doc.text
                n_bytes += len(doc.text)
                if n_bytes >= cfg.tokenizer_sample_bytes:
                    return


def build_tokenizer(cfg: DataConfig, plan: UnitPlan, forced: dict) -> str:
    """The serialized tokenizer for `cfg`: loaded from data.tokenizer, or trained on a corpus sample."""
    if cfg.tokenizer is not None:
        tok, text = load_tokenizer_spec(cfg.tokenizer)
        tokenizer_id(tok, cfg.eot_token)
        if tok.get_vocab_size() > cfg.vocab_size:
            raise Refused(
                f"data.tokenizer {cfg.tokenizer!r} has {tok.get_vocab_size()} tokens but data.vocab_size="
                f"{cfg.vocab_size}; set data.vocab_size={tok.get_vocab_size()} (or more)"
            )
        return text
    t0 = time.perf_counter()
    tok = train_tokenizer(
        sample_texts(sample_documents(cfg, plan, forced), cfg.tokenizer_sample_bytes),
        cfg.vocab_size,
        eot_token=cfg.eot_token,
    )
    log.info("trained a %d-token BPE in %.1f s", tok.get_vocab_size(), time.perf_counter() - t0)
    return tok.to_str()


def _claim(out: Path, key: str, in_cache: bool) -> None:
    """Make `out` ours for key `key`, or refuse: never mix two corpora's shards, never delete a user's files."""
    plan_file = out / PROGRESS / "plan.json"
    if plan_file.is_file():
        recorded = json.loads(plan_file.read_text())
        theirs = recorded.get("key")
        if theirs == key:
            return
        if recorded.get("format_version") != FORMAT_VERSION:
            fix = f"delete {out} (or choose another data.dir) and rerun to prepare it again"
            raise Refused(format_refusal(out, recorded.get("format_version"), fix))
        raise Refused(
            f"{out} holds an unfinished preparation of a different corpus or config (key {theirs}, this one "
            f"is {key}); delete {out} or choose another data.dir"
        )
    if out.exists() and any(out.iterdir()):
        if not in_cache:
            raise Refused(
                f"data.dir {out} is not empty and was not written by `lm prepare`; choose an empty folder"
            )
        # Never produced by prepare (it writes plan.json first), so it is not trusted.
        log.warning("%s holds files but no %s; deleting and rebuilding it", out, plan_file.name)
        shutil.rmtree(out)
    (out / PROGRESS).mkdir(parents=True, exist_ok=True)
    write_json(plan_file, {"key": key, "format_version": FORMAT_VERSION})


def _finished(out: Path, unit: Unit) -> dict | None:
    """The unit's progress record if its shards are exactly what it recorded (size and sha256), else None."""
    record_file = out / PROGRESS / f"unit-{unit.index:05d}.json"
    if not record_file.is_file():
        return None
    try:
        record = json.loads(record_file.read_text())
        for shard in record["shards"].values():
            path = out / shard["file"]
            if not path.is_file() or file_sha256(path) != shard["sha256"]:
                log.warning("unit %d: %s does not match its record; redoing the unit", unit.index, path.name)
                return None
    except (json.JSONDecodeError, KeyError):
        return None
    return record


def prepare(cfg: DataConfig) -> Path:
    """Build the tokenized dataset for `cfg` unless it is complete already; return its folder.

    `data=tokens` only checks the folder it names. Otherwise an interrupted preparation is resumed: units
    whose shards match their progress record are kept, the rest are tokenized again.
    """
    cfg.check_inputs()
    if is_url(cfg.dir):
        return prepare_remote(cfg)
    if cfg.source == "tokens":
        folder = Path(cfg.dir).expanduser()
        load_manifest(folder)
        return folder
    check_config(cfg)
    plan = sources.plan_units(cfg)
    key = cache_key(cfg, plan)
    out = dataset_dir(cfg, key)
    if (out / MANIFEST).is_file():
        recorded = json.loads((out / MANIFEST).read_text())
        theirs = recorded.get("key")
        if recorded.get("format_version") != FORMAT_VERSION:
            fix = f"delete {out} (or choose another data.dir) and rerun to prepare it again"
            raise Refused(format_refusal(out, recorded.get("format_version"), fix))
        if theirs != key:
            raise Refused(
                f"{out} holds a dataset prepared from a different corpus or config (key {theirs}, this one is "
                f"{key}); choose another data.dir, or delete {out} to rebuild it"
            )
        log.info("using the prepared dataset in %s", out)
        return out

    t0 = time.perf_counter()
    _claim(out, key, in_cache=cfg.dir is None)
    forced = forced_validation(cfg, plan)
    if not (out / TOKENIZER).is_file():
        write_atomic(out / TOKENIZER, build_tokenizer(cfg, plan, forced).encode("utf-8"))
    tokenizer_json = (out / TOKENIZER).read_bytes().decode("utf-8")
    records = tokenize_units(cfg, plan, out, forced, tokenizer_json)
    manifest = _manifest(cfg, plan, key, [records[u.index] for u in plan.units], tokenizer_json)
    manifest["prepare_seconds"] = round(time.perf_counter() - t0, 2)
    report_skips(manifest)
    write_json(out / MANIFEST, manifest)
    log.info("prepared %s: %s", out, summary(manifest))
    return out


def tokenize_units(
    cfg: DataConfig, plan: UnitPlan, out: Path, forced: dict, tokenizer_json: str
) -> dict[int, dict]:
    """Every unit's progress record: kept where its shards still match it, tokenized (in parallel) otherwise."""
    for stale in out.glob(".*.tmp-*"):  # half-written shards of a killed run; their units are redone
        stale.unlink()
    records = {u.index: r for u in plan.units if (r := _finished(out, u)) is not None}
    todo = [u for u in plan.units if u.index not in records]
    if records:
        log.info("resuming %s: %d of %d units already done", out, len(records), len(plan.units))
    done_bytes = sum(u.n_bytes for u in plan.units if u.index in records)
    total = None if plan.n_bytes is None else plan.n_bytes - done_bytes
    t1 = time.perf_counter()
    # Closed on the way out wherever a stop signal lands, so its worker pool never outlives this call.
    with (
        stop_on_signals(),
        contextlib.closing(run_units(cfg, todo, tokenizer_json, out, forced, total)) as run,
    ):
        try:
            for record in run:
                write_json(out / PROGRESS / f"unit-{record['unit']:05d}.json", record)
                records[record["unit"]] = record
        except Interrupted as e:
            run.close()  # terminates and joins the workers before the message says they are stopped
            log.warning(
                "data preparation %s: its worker processes are stopped; %d of %d units are finished and kept "
                "in %s. Rerun the same command to resume from them",
                e, len(records), len(plan.units), out,
            )  # fmt: skip
            raise
    seconds = time.perf_counter() - t1
    n_bytes = sum(r["shards"][s]["bytes"] for r in (records[u.index] for u in todo) for s in SPLITS)
    n_tokens = sum(r["shards"][s]["tokens"] for r in (records[u.index] for u in todo) for s in SPLITS)
    if todo:
        log.info(
            "tokenized %d units: %.1f MB -> %d tokens in %.1f s (%.2f MB/s, %.0fK tokens/s)",
            len(todo), n_bytes / 1e6, n_tokens, seconds, n_bytes / 1e6 / seconds, n_tokens / 1e3 / seconds,
        )  # fmt: skip
    return records


def _manifest(cfg: DataConfig, plan: UnitPlan, key: str, records: list[dict], tokenizer_json: str) -> dict:
    """The manifest of a complete folder; refuses an empty split rather than writing a dataset that is one."""
    tok = Tokenizer.from_str(tokenizer_json)
    skips = [s for r in records for s in r["skips"]]
    splits = {}
    for split in SPLITS:
        shards = [r["shards"][split] for r in records]
        splits[split] = {
            "documents": sum(s["documents"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "shards": [{k: s[k] for k in ("file", "tokens", "sha256")} for s in shards],
        }
        if not splits[split]["documents"]:
            kinds = sorted({s["reason"] for s in skips})[:5]
            raise Refused(
                f"the {split} split is empty: {splits['train']['documents']} train documents, "
                f"{sum(s.get('count', 1) for s in skips)} skipped ({'; '.join(kinds) or 'none'}); "
                + (
                    "add documents or raise data.val_fraction"
                    if split == "val"
                    else "check data.paths and data.text_field"
                )
            )
    listed = all(r["documents"] is not None for r in records)
    documents = {s: [n for r in records for n in r["documents"][s]] for s in SPLITS} if listed else None
    if documents and sum(map(len, documents.values())) > MAX_LISTED_DOCUMENTS:
        documents = None
    vocab = cfg.vocab_size if cfg.tokenizer is None else tok.get_vocab_size()
    return {
        "format_version": FORMAT_VERSION,
        "source": cfg.source,
        "key": key,
        "fingerprint": plan.fingerprint,
        "dtype": token_dtype(cfg.vocab_size).name,
        "vocab_size": vocab,
        "tokenizer_vocab_size": tok.get_vocab_size(),
        "eot_id": tokenizer_id(tok, cfg.eot_token),
        "eot_token": cfg.eot_token,
        "tokenizer": cfg.tokenizer or "trained",
        "tokenizer_sha256": text_sha256(tokenizer_json),
        "val_split": "sha256 of each document's text",
        "splits": splits,
        "skipped": skips[:MAX_LISTED_SKIPS],
        "skipped_count": sum(s.get("count", 1) for s in skips),
        "inputs": {
            "units": len(plan.units),
            "files": sum(len(u.files) for u in plan.units),
            "paths": cfg.paths,
        },
        "config": {k: getattr(cfg, k) for k in MANIFEST_CONFIG_KEYS},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "documents": documents,
    }


def report_skips(manifest: dict) -> None:
    """Log skipped inputs: a count per kind of problem, then the first few by name (all are in the manifest)."""
    if not manifest["skipped_count"]:
        return
    kinds = Counter()
    for skip in manifest["skipped"]:
        kinds[re.split(r" at | \(", skip["reason"])[0]] += skip.get("count", 1)
    log.warning(
        "skipped %d input(s) (%s); every one is listed under `skipped` in the manifest",
        manifest["skipped_count"], ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()),
    )  # fmt: skip
    for skip in [s for s in manifest["skipped"] if s["reason"] != "empty"][:MAX_LOGGED_SKIPS]:
        log.warning("  skipped %s: %s", skip["where"], skip["reason"])


def prepare_remote(cfg: DataConfig) -> Path:
    """`data.dir` is a URL: `tokens` mirrors it into the cache (verified against the manifest's sha256);
    other sources prepare into the cache as usual, then upload the folder there (manifest last)."""
    if cfg.source == "tokens":
        local = fetch_dataset(
            cfg.dir, dataset_cache(cfg.dir, resolve_cache_dir(cfg.cache_dir)), cfg.storage_options
        )
        load_manifest(local)
        return local
    local = prepare(dataclasses.replace(cfg, dir=None))
    sent = upload_dataset(local, cfg.dir, cfg.storage_options)
    log.info("%s: %s", cfg.dir, f"uploaded {sent} file(s) from {local}" if sent else "already up to date")
    return local


def sample_tokenizer(cfg: DataConfig, out: Path) -> str:
    """Train a byte-level BPE (data.vocab_size) on a sample of the corpus into `out`; returns its sha256."""
    check_config(cfg)
    cfg.check_inputs()
    if cfg.source == "tokens":
        raise Refused("data=tokens holds no text to train a tokenizer on; use data=text or data=hf")
    plan = sources.plan_units(cfg)
    text = build_tokenizer(dataclasses.replace(cfg, tokenizer=None), plan, forced_validation(cfg, plan))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text.encode("utf-8"))
    return text_sha256(text)
