"""Prepared data on object storage: `lm prepare ... data.dir=s3://...` uploads the folder, and training from
that URL mirrors it into the local cache.

The mirror is file by file: `manifest.json` is uploaded last and downloaded first, and every shard is checked
against the sha256 the manifest records, so a half-uploaded or stale folder is never trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from lm.data.manifest import MANIFEST, SPLITS, TOKENIZER
from lm.data.tokenizer import file_sha256
from lm.store.objects import RETRY_WINDOW_S, RemoteError, download_verified, explain, open_fs, retrying

log = logging.getLogger("lm.data")


def dataset_cache(url: str, cache_dir: Path) -> Path:
    """Local folder that mirrors the prepared dataset at `url`."""
    tail = url.rstrip("/").rsplit("/", 1)[-1] or "root"
    return cache_dir / f"remote-{tail}-{hashlib.sha256(url.encode()).hexdigest()[:10]}"


def fetch_dataset(
    url: str,
    local: Path,
    storage_options: dict[str, Any] | None = None,
    retry_window_s: float = RETRY_WINDOW_S,
) -> Path:
    """Mirror a prepared dataset folder from `url` into `local`, verifying every file; returns `local`.

    The manifest is read first and written locally last. A file already present with the recorded size and
    sha256 is kept (an interrupted download resumes); each other one is downloaded atomically and must hash
    to the manifest's sha256, or the download stops naming it. An outage is retried for `retry_window_s`
    seconds (then exit 69), each file's download from its start.
    """
    fs, path = open_fs(url, storage_options)
    try:
        raw = retrying(
            lambda: fs.cat_file(f"{path}/{MANIFEST}"), url, f"reading {MANIFEST} from", retry_window_s
        )
    except FileNotFoundError:
        raise RemoteError(
            f"no {MANIFEST} in {url}: it is not a prepared dataset (or its upload did not finish); upload the "
            f"folder `lm prepare` wrote, manifest.json last (`lm prepare ... data.dir={url}` does)"
        ) from None
    if (local / MANIFEST).is_file() and (local / MANIFEST).read_bytes() == raw:
        return local  # complete and verified when its manifest was written; load_manifest checks sizes
    (local / MANIFEST).unlink(missing_ok=True)
    manifest = json.loads(raw)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    files = [(TOKENIZER, None, manifest["tokenizer_sha256"])]
    files += [
        (s["file"], s["tokens"] * itemsize, s["sha256"])
        for sp in SPLITS
        for s in manifest["splits"][sp]["shards"]
    ]
    todo = [
        f
        for f in files
        if not ((local / f[0]).is_file() and file_sha256(local / f[0]) == f[2])  # resumed: already here
    ]
    total = sum(f[1] or 0 for f in todo)
    log.info(
        "downloading %d of %d files (%.1f MB) of %s into %s", len(todo), len(files), total / 1e6, url, local
    )
    for name, size, sha in todo:
        try:
            why = retrying(
                partial(download_verified, fs, f"{path}/{name}", local / name, size, sha),
                url,
                f"downloading {name} from",
                retry_window_s,
            )
        except FileNotFoundError:
            why = "it is missing"
        if why is not None:
            raise RemoteError(
                f"{url}/{name} does not match the manifest ({why}): the remote copy is corrupt or from "
                f"another preparation; upload the folder again (`lm prepare ... data.dir={url}`)"
            )
    (local / MANIFEST).write_bytes(raw)  # last: a folder with a manifest is complete
    return local


def upload_dataset(
    local: Path,
    url: str,
    storage_options: dict[str, Any] | None = None,
    retry_window_s: float = RETRY_WINDOW_S,
) -> int:
    """Upload a prepared dataset folder to `url`, manifest.json last; returns the files uploaded.

    Files already there with the same size are skipped (a rerun resumes an interrupted upload); training
    from `url` checks every shard's sha256, so a stale same-size object cannot slip through. An outage is
    retried for `retry_window_s` seconds per request (then exit 69).
    """
    fs, path = open_fs(url, storage_options)
    manifest = json.loads((local / MANIFEST).read_text())

    def remote(call):
        return retrying(call, url, "uploading the dataset to", retry_window_s)

    try:
        if remote(lambda: fs.cat_file(f"{path}/{MANIFEST}")) == (local / MANIFEST).read_bytes():
            return 0
    except FileNotFoundError:
        pass  # not uploaded yet (or the bucket is missing: the first upload below says so)
    names = [TOKENIZER, *(s["file"] for sp in SPLITS for s in manifest["splits"][sp]["shards"])]
    fs.invalidate_cache(path)
    try:
        listing = remote(lambda: fs.ls(path, detail=True))
    except FileNotFoundError:
        listing = []
    there = {Path(p["name"]).name: p["size"] for p in listing}
    sent = 0
    try:
        for name in [*(n for n in names if there.get(n) != (local / n).stat().st_size), MANIFEST]:
            remote(partial(fs.put_file, str(local / name), f"{path}/{name}"))
            sent += 1
    except FileNotFoundError as e:  # the bucket itself
        raise explain(e, url, "uploading the dataset to") from e
    return sent
