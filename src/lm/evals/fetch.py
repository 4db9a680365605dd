"""`lm fetch-evals`: DCLM's CORE task files, downloaded from the eval bundle nanochat uses, checked file by
file against lm's table (rows, sha256, the baseline CSV), and put where CORE reads them by default.

The bundle (nanochat's `base_eval` fetches the same zip) holds `eval_bundle/eval_data/<category>/<task>.jsonl`
for DCLM's tasks and `eval_bundle/eval_meta_data.csv`. lm keeps the 22 files CORE reads and the CSV, laid out
as llm-foundry's `local_data` (lm.evals.core.default_data_dir), and moves them in only once every file has
passed, so a failed or tampered download never leaves a half folder where CORE looks.
"""

from __future__ import annotations

import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from lm.base.exits import Refused, Unavailable
from lm.evals import core

URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
"""nanochat's copy of DCLM's eval bundle (scripts/base_eval.py and speedrun.sh download it)."""
TIMEOUT_S = 60.0
"""How long one read of the download may stall before it is abandoned."""


def fetch(url: str | None = None, dest: str | Path | None = None, *, force: bool = False) -> Path:
    """Download the bundle at `url` (default `URL`; a file:// address works too), check every CORE file, and
    put the 22 files and the CSV into `dest` (default: lm's cache). Returns `dest`. A folder that already
    holds all 22 checked files is kept unless `force`."""
    url = url or URL
    dest = Path(dest).expanduser() if dest is not None else core.default_data_dir()
    labels = [t.label for t in core.CORE_TASKS]
    if dest.is_dir() and not force:
        try:
            core.check_folder(dest, labels, partial=False)
            return dest
        except Refused:
            pass  # incomplete or changed: fetched again below
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        archive = Path(tmp) / "eval_bundle.zip"
        download(url, archive)
        root = unpack(archive, Path(tmp) / "unpacked", url)
        staged = Path(tmp) / "core"
        for task in core.CORE_TASKS:
            if (root / task.file).is_file():
                (staged / task.file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / task.file, staged / task.file)
        meta = root / core.META if (root / core.META).is_file() else root.parent / core.META
        if meta.is_file():
            shutil.copyfile(meta, staged / core.META)
        try:
            core.check_folder(staged, labels, partial=False)
        except Refused as e:
            raise Refused(f"the bundle at {url} is not the one CORE is defined on: {e}") from None
        replace(staged, dest)
    return dest


def download(url: str, to: Path) -> None:
    """`url` into the file `to`; an address that cannot be read is `Unavailable` (69: try again later)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(to, "wb") as out:
            shutil.copyfileobj(response, out, length=1 << 20)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise Unavailable(
            f"cannot download {url} ({e}): retry `{core.FETCH}` when it is reachable, or pass --url a copy "
            "of the bundle (file:///path/eval_bundle.zip)"
        ) from e


def unpack(archive: Path, into: Path, url: str) -> Path:
    """The archive extracted into `into`; returns the folder of `<category>/<task>.jsonl` in it. Refused: not
    a zip, a member that would land outside `into`, no CORE files inside."""
    try:
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if name.startswith("/") or ".." in Path(name).parts:
                    raise Refused(f"{url} holds a file outside its folder ({name}): not an eval bundle")
            z.extractall(into)
    except zipfile.BadZipFile:
        raise Refused(f"{url} is not a zip archive: pass --url the eval bundle (eval_bundle.zip)") from None
    probe = core.CORE_TASKS[1].file  # jeopardy: in every copy of the bundle
    found = sorted(p for p in into.rglob(Path(probe).name) if p.as_posix().endswith(probe))
    if not found:
        raise Refused(
            f"{url} holds no CORE task files ({probe}): pass --url the eval bundle (eval_bundle.zip)"
        )
    return found[0].parents[1]


def replace(staged: Path, dest: Path) -> None:
    """`staged` becomes `dest`; a folder already there is moved aside first and removed after, so `dest` is
    at every moment the old folder or the new one."""
    old = dest.with_name(dest.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        dest.rename(old)
    staged.rename(dest)
    if old.exists():
        shutil.rmtree(old)
