"""Corpus sources: plan the input into units of work, and read one unit as documents.

A unit is a group of whole files (or one shard of a Hugging Face stream) that `prepare` tokenizes into one
train shard and one val shard. Units are planned from file names and sizes alone, so the plan (and with it
the resume of an interrupted preparation) is known before any text is read. Reading never raises on a bad
file: it records a `Skip` naming the file and the reason, and `prepare` reports every one.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from lm.base.exits import Refused
from lm.config import DataConfig
from lm.data import stdlib
from lm.data.stdlib import Document, stable_fraction

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
BINARY_SNIFF = 8192
"""Bytes read from the start of a text file to tell binary files (NUL bytes) from text."""
MAX_REPORTED_RECORDS = 5
"""Bad records listed per file and reason; the rest are only counted."""


@dataclass
class Skip:
    """Something left out of the dataset: `where` names the file (and record), `reason` says why."""

    where: str
    reason: str
    count: int = 1
    """How many records this entry stands for (past the first few bad lines of a file, one entry sums them)."""


@dataclass
class Unit:
    """One unit of work: whole files of a local corpus, or shard `index` of a Hugging Face stream."""

    index: int
    files: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    n_bytes: int = 0


@dataclass
class UnitPlan:
    """Every unit of a preparation plus the identity of the input, for cache keys and resume checks."""

    units: list[Unit]
    fingerprint: str
    n_bytes: int | None
    """Input bytes (for the progress bar's ETA); None when a stream's size is unknown."""


def kind_of(path: str) -> str:
    """`text`, `jsonl` or `parquet` from the file name (a trailing .gz is looked through)."""
    name = path.lower().removesuffix(".gz")
    for kind, suffixes in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    return "text"  # unknown suffixes are read as text; binary content is caught and skipped when read


def expand_paths(patterns: list[str]) -> list[str]:
    """Sorted, de-duplicated files matched by `patterns` (`**` spans folders; a folder means every file in it)."""
    files: set[str] = set()
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if not glob.has_magic(pattern):
            if os.path.isdir(pattern):
                pattern = os.path.join(pattern, "**", "*")
            elif not os.path.exists(pattern):
                raise FileNotFoundError(
                    f"data.paths {pattern!r} does not exist; check the path (relative paths start at "
                    f"{os.getcwd()})"
                )
        matched = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matched:
            raise Refused(
                f"data.paths {pattern!r} matched no files; check the glob (use ** to span folders, e.g. "
                f"'corpus/**/*.jsonl') and quote it so the shell does not expand it"
            )
        files.update(matched)
    return sorted(files)


def group_units(files: list[tuple[str, int]], shard_bytes: int) -> list[Unit]:
    """Consecutive files packed into units of about `shard_bytes` (a bigger file is a unit of its own)."""
    units: list[Unit] = []
    for name, size in files:
        if not units or (units[-1].n_bytes + size > shard_bytes and units[-1].files):
            units.append(Unit(index=len(units)))
        units[-1].files.append(name)
        units[-1].sizes.append(size)
        units[-1].n_bytes += size
    return units


def cap_files(files: list[tuple[str, int]], max_bytes: int | None) -> list[tuple[str, int]]:
    """The first files (in sorted order) within `max_bytes`, always at least one."""
    if max_bytes is None:
        return files
    kept, total = [], 0
    for name, size in files:
        if kept and total + size > max_bytes:
            break
        kept.append((name, size))
        total += size
    return kept


def _fingerprint(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def plan_units(cfg: DataConfig) -> UnitPlan:
    """Split the configured corpus into units; reads names and sizes only (and a stream's shard count)."""
    if cfg.source == "stdlib":
        sizes = dict(stdlib.list_files())
        files = [(n, sizes[n]) for n in stdlib.select_files(stdlib.list_files(), cfg.max_bytes)]
        return UnitPlan(group_units(files, cfg.shard_bytes), stdlib.fingerprint(), sum(s for _, s in files))
    if cfg.source == "text":
        files = cap_files([(p, os.path.getsize(p)) for p in expand_paths(cfg.paths)], cfg.max_bytes)
        ident = [f"{os.path.abspath(p)}\t{s}\t{os.stat(p).st_mtime_ns}" for p, s in files]
        return UnitPlan(group_units(files, cfg.shard_bytes), _fingerprint(ident), sum(s for _, s in files))
    if cfg.source == "hf":
        n = hf_stream(cfg).n_shards
        ident = [f"{cfg.name}\t{cfg.subset}\t{cfg.split}\t{cfg.paths}\t{n}"]
        return UnitPlan([Unit(index=i) for i in range(n)], _fingerprint(ident), None)
    raise Refused(f"data.source {cfg.source!r} has no corpus to plan; it reads prepared shards")


def document_name(cfg: DataConfig, where: str) -> str:
    """Readable name of a document (what the manifest lists and skips name); the split never reads it."""
    return f"{cfg.name}/{cfg.subset}/{cfg.split}/{where}" if cfg.source == "hf" else where


def split_key(text: str) -> str:
    """What decides a document's split: the sha256 of its text. Not its name, which for a local corpus is its
    path as the glob returned it: keyed on the content, the same documents split the same way wherever the
    corpus sits (another folder, a relative data.paths, a new volume) and copies of a text fall on one side."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_validation(key: str, val_fraction: float) -> bool:
    """Whether the document with `split_key` `key` is held out; depends on nothing else, so a document keeps
    its side as the corpus grows."""
    return stable_fraction(key, "val") < val_fraction


# --- reading -----------------------------------------------------------------------------------------------


def _open_text(path: str) -> io.TextIOBase:
    raw = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="")


def _longest_line(text: str) -> int:
    return max(map(len, text.split("\n")), default=0)


def _checked(doc: Document, cfg: DataConfig, skips: list[Skip]) -> Document | None:
    """`doc`, or None with a Skip when it is empty or has a line over data.max_line_chars."""
    if not doc.text.strip():
        skips.append(Skip(doc.name, "empty"))
        return None
    if len(doc.text) > cfg.max_line_chars and _longest_line(doc.text) > cfg.max_line_chars:
        skips.append(
            Skip(doc.name, f"a line longer than data.max_line_chars={cfg.max_line_chars} characters")
        )
        return None
    return doc


def read_text_file(path: str, cfg: DataConfig, skips: list[Skip]) -> Iterator[Document]:
    """The whole file as one document; binary or invalid UTF-8 files are skipped."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if path.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError) as e:
        skips.append(Skip(path, f"unreadable ({e})"))
        return
    if b"\0" in data[:BINARY_SNIFF]:
        skips.append(Skip(path, "binary (NUL bytes)"))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        skips.append(Skip(path, f"invalid UTF-8 at byte {e.start}"))
        return
    doc = _checked(Document(path, text), cfg, skips)
    if doc is not None:
        yield doc


def read_jsonl_file(path: str, cfg: DataConfig, skips: list[Skip]) -> Iterator[Document]:
    """One document per line's `text_field`; bad lines are skipped and counted, a file of them is an error."""
    bad: dict[str, list[int]] = {}
    good = 0
    keys: set[str] = set()
    try:
        with _open_text(path) as f:
            line_no = 0
            while True:
                line_no += 1
                try:
                    # Bounded read: a multi-gigabyte line must not be loaded to be rejected.
                    line = f.readline(cfg.max_line_chars + 1)
                except UnicodeDecodeError:
                    bad.setdefault("invalid UTF-8", []).append(line_no)
                    break  # the decoder cannot resynchronise; the rest of the file is lost (reported)
                if not line:
                    break
                if len(line) > cfg.max_line_chars and not line.endswith("\n"):
                    while (rest := f.readline(1 << 20)) and not rest.endswith("\n"):
                        pass
                    bad.setdefault(f"a line longer than data.max_line_chars={cfg.max_line_chars}", []).append(
                        line_no
                    )
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    bad.setdefault("not JSON", []).append(line_no)
                    continue
                text = record.get(cfg.text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    if isinstance(record, dict):
                        keys.update(record)
                    bad.setdefault(f"no string field {cfg.text_field!r}", []).append(line_no)
                    continue
                doc = _checked(Document(f"{path}:{line_no}", text), cfg, skips)
                if doc is not None:
                    good += 1
                    yield doc
    except (OSError, EOFError) as e:
        bad.setdefault(f"unreadable ({e})", []).append(0)
    missing = bad.get(f"no string field {cfg.text_field!r}", [])
    if not good and missing:
        raise Refused(
            f"{path}: no record has a string field {cfg.text_field!r} (fields seen: "
            f"{', '.join(sorted(keys)) or 'none'}); set data.text_field to the field that holds the text"
        )
    for reason, lines in bad.items():
        skips.extend(Skip(f"{path}:{n}", reason) for n in lines[:MAX_REPORTED_RECORDS])
        if len(lines) > MAX_REPORTED_RECORDS:
            skips.append(Skip(path, f"{reason} (more lines)", len(lines) - MAX_REPORTED_RECORDS))


def read_parquet_file(path: str, cfg: DataConfig, skips: list[Skip]) -> Iterator[Document]:
    """One document per row of column `text_field`, a row group at a time; unreadable files are skipped."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading .parquet needs pyarrow: pip install 'lm[data]'") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        skips.append(Skip(path, f"unreadable parquet ({type(e).__name__}: {e})"))
        return
    columns = pf.schema_arrow.names
    if cfg.text_field not in columns:
        raise Refused(
            f"{path} has no column {cfg.text_field!r} (columns: {', '.join(columns)}); set data.text_field"
        )
    row = 0
    for group in range(pf.num_row_groups):
        try:
            texts = pf.read_row_group(group, columns=[cfg.text_field]).column(0).to_pylist()
        except Exception as e:
            skips.append(Skip(f"{path}#rowgroup{group}", f"unreadable ({type(e).__name__}: {e})"))
            continue
        for text in texts:
            row += 1
            if not isinstance(text, str):
                skips.append(Skip(f"{path}:{row}", f"{cfg.text_field!r} is not a string"))
                continue
            doc = _checked(Document(f"{path}:{row}", text), cfg, skips)
            if doc is not None:
                yield doc


def read_stdlib_file(name: str, cfg: DataConfig, skips: list[Skip]) -> Iterator[Document]:
    """A stdlib module as one document, named by its path relative to the stdlib."""
    try:
        text = (stdlib.stdlib_root() / name).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        # A few test fixtures are deliberately in other encodings.
        skips.append(Skip(name, "invalid UTF-8"))
        return
    if text:
        yield Document(name, text)
    else:  # mostly empty __init__.py files
        skips.append(Skip(name, "empty"))


READERS = {"text": read_text_file, "jsonl": read_jsonl_file, "parquet": read_parquet_file}


def hf_stream(cfg: DataConfig):
    """The configured Hugging Face dataset as a streaming IterableDataset."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError("data=hf needs the `datasets` package: pip install 'lm[data]'") from e
    try:
        return datasets.load_dataset(
            cfg.name, cfg.subset, split=cfg.split, streaming=True, data_files=cfg.paths or None
        )
    except Exception as e:
        raise Refused(
            f"could not open Hugging Face dataset data.name={cfg.name!r} subset={cfg.subset!r} split="
            f"{cfg.split!r} ({type(e).__name__}: {e}); check the names, and that this machine is online"
        ) from e


def read_unit(unit: Unit, cfg: DataConfig, skips: list[Skip]) -> Iterator[Document]:
    """Every document of `unit`, in a fixed order; bad input goes to `skips`."""
    if cfg.source == "hf":
        stream = hf_stream(cfg)
        budget = None if cfg.max_bytes is None else cfg.max_bytes // stream.n_shards
        for i, record in enumerate(stream.shard(num_shards=stream.n_shards, index=unit.index)):
            text = record.get(cfg.text_field)
            where = f"{unit.index}:{i}"
            if not isinstance(text, str):
                skips.append(Skip(where, f"no string field {cfg.text_field!r}"))
                continue
            doc = _checked(Document(document_name(cfg, where), text), cfg, skips)
            if doc is not None:
                yield doc
                if budget is not None:
                    budget -= len(text)
                    if budget <= 0:
                        return
        return
    for path in unit.files:
        reader = read_stdlib_file if cfg.source == "stdlib" else READERS[kind_of(path)]
        yield from reader(path, cfg, skips)
