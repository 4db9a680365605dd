"""The bundled default corpus: the running interpreter's standard library source.

Every Python install ships ~30 MB of `.py` files that mix code, comments and docstrings, so a model can be
pretrained with no download at all. Each file is one document, named by its POSIX path relative to the stdlib.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# Third-party packages live under the stdlib folder but are not part of the corpus.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Document:
    """One source file: `name` is its path relative to the corpus root, `text` its decoded contents."""

    name: str
    text: str


@dataclass
class Corpus:
    """Documents in sorted-name order plus the files that were left out, so callers can report them."""

    documents: list[Document]
    skipped: list[str] = field(default_factory=list)
    """Files that are not valid UTF-8."""
    empty: int = 0
    """Files with no text (mostly empty `__init__.py`); they would add nothing but an end-of-text token."""

    @property
    def n_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.documents)


def stable_fraction(name: str, salt: str) -> float:
    """Map `name` to a number in [0, 1) that is the same on every machine and run.

    Python's hash() is salted per process, so sha1 is used instead; `salt` gives independent orders for
    independent decisions (corpus sampling vs. the validation split).
    """
    digest = hashlib.sha1(f"{salt}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def stdlib_root() -> Path:
    """Folder holding the running interpreter's standard library (the base install, even inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | None = None) -> list[tuple[str, int]]:
    """All `*.py` files under `root` as sorted (relative POSIX path, size in bytes) pairs; stat only."""
    root = root or stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        for name in names:
            if name.endswith(".py"):
                path = Path(folder, name)
                files.append((path.relative_to(root).as_posix(), path.stat().st_size))
    if not files:
        raise FileNotFoundError(
            f"no .py files under {root}; this interpreter ships without its stdlib source"
        )
    return sorted(files)


def fingerprint(root: Path | None = None) -> str:
    """Cheap identity of the corpus (Python version, file names and sizes) for the dataset cache key."""
    h = hashlib.sha256(f"{sys.implementation.name}-{platform.python_version()}\n".encode())
    for name, size in list_files(root):
        h.update(f"{name}\t{size}\n".encode())
    return h.hexdigest()


def select_files(files: list[tuple[str, int]], max_bytes: int | None) -> list[str]:
    """Names of whole files totalling at most `max_bytes`, in sorted order.

    Files are considered in a hash order rather than alphabetically, so a small cap still gets a spread of
    packages (code, tests, docs-heavy modules) instead of only `asyncio/`. Files that do not fit are passed
    over and smaller ones later in the order may still fill the budget.
    """
    if max_bytes is None:
        return [name for name, _ in files]
    chosen, total = [], 0
    for name, size in sorted(files, key=lambda f: stable_fraction(f[0], "select")):
        if total + size <= max_bytes:
            chosen.append(name)
            total += size
    return sorted(chosen)


def stdlib_documents(max_bytes: int | None = None, root: Path | None = None) -> Corpus:
    """Read the stdlib corpus (capped at `max_bytes` of whole files) as UTF-8 documents in sorted-name order."""
    root = root or stdlib_root()
    corpus = Corpus(documents=[])
    for name in select_files(list_files(root), max_bytes):
        try:
            text = (root / name).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            # A few test fixtures are deliberately in other encodings; they are reported in the manifest.
            corpus.skipped.append(name)
            continue
        if text:
            corpus.documents.append(Document(name, text))
        else:
            corpus.empty += 1
    return corpus
