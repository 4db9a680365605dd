"""Checkpoints and prepared data on object storage (`s3://`, `gs://`, any fsspec URL), so a run can move
to whichever region has the cheap GPU today instead of staying where its volume is.

Object stores have no rename and no symlink, but a single PUT is atomic: a reader sees the whole object or
none of it. So a remote checkpoint folder holds immutable objects and one small pointer, written last:

    <url>/step-<N>.<token>.ckpt     a checkpoint, uploaded once and never overwritten (the token is random)
    <url>/latest.json               the pointer: the kept checkpoints, newest first, with step, size, sha256
    <url>/archive-<time>.json       a pointer set aside by `run.resume=false` (its checkpoints are kept)

A reader only trusts objects a pointer lists, and checks their size and sha256 on download, so an upload a
kill interrupted (an object without a pointer update, or no object at all) is never picked. Rotation
deletes only objects that no pointer lists, after the new pointer is written.

Prepared data (`lm prepare` output) is mirrored file by file: `manifest.json` is uploaded last and
downloaded first, and every shard is checked against the sha256 the manifest records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

POINTER = "latest.json"
POINTER_FORMAT = 1
CHUNK = 16 << 20  # bytes per read/write while streaming (and hashing) a file
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an "
    "S3-compatible store (R2, MinIO, B2, ...)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key, or run "
    "`gcloud auth application-default login`",
}


class RemoteError(ValueError):
    """Object storage refused or cannot be reached; the message names the URL and the fix."""


def is_url(path: str | None) -> bool:
    """True for `scheme://...` (s3://, gs://, file://, ...): a location reached through fsspec."""
    return isinstance(path, str) and "://" in path


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def open_fs(url: str, storage_options: dict[str, Any] | None = None):
    """(filesystem, path inside it) for `url`; a missing package or a malformed URL is a RemoteError."""
    import fsspec

    proto = protocol(url)
    options = dict(storage_options or {})
    if proto == "file":
        options.setdefault("auto_mkdir", True)  # object stores have no folders to create first
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        package = PACKAGES.get(proto, f"the fsspec implementation of {proto}://")
        raise RemoteError(
            f"{url}: {proto}:// needs the `{package}` package, which is not installed: "
            f"pip install {package} (or pip install -e '.[cloud]')"
        ) from e
    except ValueError as e:  # fsspec: "Protocol not known"
        raise RemoteError(f"{url}: {e}; use s3://bucket/prefix, gs://bucket/prefix or file:///path") from e
    path = path.rstrip("/")
    if proto != "file" and not path.strip("/"):
        raise RemoteError(f"{url} names no bucket; use {proto}://bucket/prefix")
    return fs, path


def explain(error: BaseException, url: str, doing: str) -> RemoteError:
    """Turn a storage client's exception into a RemoteError that says what to change."""
    proto = protocol(url)
    name = type(error).__name__
    creds = CREDENTIALS.get(proto, "check the credentials for this store")
    if "Credential" in name or "credential" in str(error).lower():
        fix = f"no usable credentials: {creds}"
    elif isinstance(error, PermissionError):
        fix = f"access denied: give these credentials read and write access to the prefix ({creds})"
    elif isinstance(error, FileNotFoundError):
        fix = "the bucket does not exist (or is in another account): create it or fix the URL"
    else:
        fix = (
            "the store cannot be reached or refused the request: check the URL, the network and the "
            f"endpoint ({creds})"
        )
    return RemoteError(f"{doing} {url} failed ({name}: {error}); {fix}")


def check_writable(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write and delete a small probe object under `url`: credentials, bucket and permissions are checked
    before a cent is spent on training."""
    fs, path = open_fs(url, storage_options)
    probe = f"{path}/.lm-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fs.pipe_file(probe, b"lm write probe\n")
        fs.rm_file(probe)
    except RemoteError:
        raise
    except Exception as e:
        raise explain(e, url, "writing a probe object to") from e


def _hash_stream(src: IO[bytes], dst: IO[bytes]) -> tuple[int, str]:
    """Copy src to dst in chunks; (bytes, sha256) of what was copied."""
    sha, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        sha.update(chunk)
        dst.write(chunk)
        size += len(chunk)
    return size, sha.hexdigest()


def download_verified(fs, src: str, dst: Path, size: int | None, sha256: str | None) -> str | None:
    """Download `src` to `dst` atomically (a hidden temporary, fsync, rename); None, or why it was refused.

    A copy whose size or sha256 differs from the expected one is deleted and never renamed into place.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        with fs.open(src, "rb", block_size=CHUNK) as r, open(tmp, "wb") as w:
            got_size, got_sha = _hash_stream(r, w)
            w.flush()
            os.fsync(w.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if size is not None and got_size != size:
        tmp.unlink()
        return f"{got_size} bytes where {size} were recorded"
    if sha256 is not None and got_sha != sha256:
        tmp.unlink()
        return f"sha256 {got_sha[:12]}... where {sha256[:12]}... was recorded"
    os.replace(tmp, dst)
    return None


# -- checkpoints ---------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One uploaded checkpoint as the pointer records it."""

    file: str
    step: int
    size: int
    sha256: str


class RemoteCheckpoints:
    """One run's checkpoint folder on object storage: immutable step objects and the `latest.json` pointer.

    Only rank 0 writes. Two machines writing the same folder at once are not supported (the second one's
    rotation would delete the first one's newest checkpoint): one run, one writer, as on a local disk.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, keep_last: int = 3) -> None:
        self.url = url.rstrip("/")
        self.fs, self.path = open_fs(self.url, storage_options)
        self.keep_last = keep_last

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}"

    def read_pointer(self, name: str = POINTER) -> list[Entry]:
        """The checkpoints the pointer lists, newest first; [] when there is no pointer yet."""
        self.fs.invalidate_cache(self.path)
        try:
            raw = self.fs.cat_file(self._key(name))
        except FileNotFoundError:
            return []
        except Exception as e:
            raise explain(e, self.url, f"reading {name} from") from e
        try:
            doc = json.loads(raw)
            entries = [Entry(**e) for e in doc["checkpoints"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RemoteError(
                f"{self.url}/{name} is not a checkpoint pointer ({e}); it was not written by lm: move it "
                f"away, or point checkpoint.remote elsewhere"
            ) from e
        return sorted(entries, key=lambda e: e.step, reverse=True)

    def _write_pointer(self, entries: list[Entry], name: str = POINTER) -> None:
        doc = {
            "format": POINTER_FORMAT,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": socket.gethostname(),
            "checkpoints": [asdict(e) for e in entries],
        }
        self.fs.pipe_file(self._key(name), (json.dumps(doc, indent=1) + "\n").encode())  # one atomic PUT

    def upload(self, f: IO[bytes], step: int) -> Entry:
        """Upload a checkpoint, then the pointer naming it, then delete what no pointer lists any more.

        A kill before the pointer is written leaves the previous pointer, and the checkpoints it lists,
        untouched: the remote folder always describes complete, verified checkpoints.
        """
        name = f"step-{step}.{secrets.token_hex(4)}.ckpt"  # never overwrites an object a pointer lists
        f.seek(0)
        with self.fs.open(self._key(name), "wb", block_size=CHUNK) as w:  # multipart: complete or absent
            size, sha = _hash_stream(f, w)
        entry = Entry(name, step, size, sha)
        # Listed steps beyond this one belong to an abandoned future (the run resumed from an older
        # checkpoint because a newer one was corrupt or lost): the run's present is this upload.
        kept = [entry, *(e for e in self.read_pointer() if e.step < step)]
        kept.sort(key=lambda e: e.step, reverse=True)
        if self.keep_last > 0:
            kept = kept[: self.keep_last]
        self._write_pointer(kept)
        self.delete_unlisted()
        return entry

    def delete_unlisted(self) -> None:
        """Delete checkpoint objects that no pointer (latest or archived) lists: rotated-out checkpoints and
        the remains of uploads a kill interrupted."""
        self.fs.invalidate_cache(self.path)
        names = [Path(p).name for p in self.fs.ls(self.path, detail=False)]
        listed = {e.file for n in names if n.endswith(".json") for e in self.read_pointer(n)}
        for n in names:
            if n.startswith("step-") and n.endswith(".ckpt") and n not in listed:
                self.fs.rm_file(self._key(n))

    def archive_pointer(self) -> str | None:
        """`run.resume=false`: set the pointer aside as `archive-<time>.json` (its checkpoints stay)."""
        entries = self.read_pointer()
        if not entries:
            return None
        name = f"archive-{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
        self._write_pointer(entries, name)
        self.fs.rm_file(self._key(POINTER))
        return f"{self.url}/{name}"

    def download_newest(self, ckpt_dir: Path, newer_than: int = -1, loads=None) -> Path | None:
        """Download the newest listed checkpoint beyond step `newer_than` that verifies (size, sha256 and,
        with `loads`, a load check) into `ckpt_dir/step-<N>.ckpt`; older ones are tried after a bad one."""
        for entry in self.read_pointer():
            if entry.step <= newer_than:
                return None
            dst = ckpt_dir / f"step-{entry.step}.ckpt"
            log.info(
                "downloading %s/%s (step %d, %.1f MB)", self.url, entry.file, entry.step, entry.size / 1e6
            )
            try:
                why = download_verified(self.fs, self._key(entry.file), dst, entry.size, entry.sha256)
            except FileNotFoundError:
                why = "the object is missing"
            if why is None and loads is not None and (why := loads(dst)) is not None:
                dst.unlink()
            if why is None:
                return dst
            log.warning(
                "remote checkpoint %s/%s is unusable (%s); trying an older one", self.url, entry.file, why
            )
        return None


class CheckpointUploader:
    """Uploads checkpoints on a background thread, so training waits for the local write only.

    `submit` opens the file at once (an open file survives the local rotation deleting it) and replaces a
    checkpoint still waiting: only the newest matters. `wait` blocks until nothing is waiting or in flight;
    the spot path calls it after the final save, before exiting 75. A failed upload is logged and the run
    goes on (the local checkpoint is intact; the next save uploads again).
    """

    def __init__(self, store: RemoteCheckpoints) -> None:
        self.store = store
        self.uploaded_step: int | None = None
        """Step of the newest checkpoint the remote pointer lists, as written by this process."""
        self.failed: str | None = None
        self._pending: tuple[IO[bytes], int] | None = None
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._in_flight: int | None = None
        """Step of the upload the thread is working on (named in a timeout's log)."""
        self._gave_up = False
        """A wait timed out: the process is on its way out, so later waits (teardown after on_exception)
        return at once instead of waiting for the same hung upload again."""

    def submit(self, path: Path, step: int) -> None:
        f = open(path, "rb")  # noqa: SIM115 (closed by the upload thread; open now to pin the file)
        with self._cond:
            if self._pending is not None:
                self._pending[0].close()
                log.info("step %d supersedes step %d before its upload began", step, self._pending[1])
            self._pending = (f, step)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lm-checkpoint-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                f, step = self._pending
                self._pending, self._busy, self._in_flight = None, True, step
            t0 = time.monotonic()
            try:
                entry = self.store.upload(f, step)
                self.uploaded_step, self.failed = step, None
                log.info(
                    "uploaded step %d to %s/%s (%.1f MB in %.1f s)",
                    step, self.store.url, entry.file, entry.size / 1e6, time.monotonic() - t0,
                )  # fmt: skip
            except Exception as e:
                self.failed = f"step {step}: {type(e).__name__}: {e}"
                log.error(
                    "uploading step %d to %s failed (%s: %s); the local checkpoint is intact and the next "
                    "save uploads again", step, self.store.url, type(e).__name__, e,
                )  # fmt: skip
            finally:
                f.close()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted checkpoint is uploaded (or has failed), or `timeout` seconds pass.

        Returns False on a timeout. The process may then exit with the upload still in flight: the bucket
        keeps its previous complete checkpoint (the pointer is written last), and the local file is intact.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._gave_up and (self._pending is not None or self._busy):
                return False
            if self._pending is not None or self._busy:
                log.info("waiting for the checkpoint upload to %s to finish", self.store.url)
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    step = self._pending[1] if self._pending is not None else self._in_flight
                    held = "nothing yet" if self.uploaded_step is None else f"step {self.uploaded_step}"
                    log.error(
                        "the checkpoint upload to %s did not finish in %.0f s (checkpoint.upload_timeout_s); "
                        "exiting without step %s. The bucket still resumes from %s, written "
                        "whole before this upload began; the local checkpoint is intact, and a restart on "
                        "this machine resumes from it and uploads again", self.store.url, timeout, step, held,
                    )  # fmt: skip
                    self._gave_up = True
                    return False
                self._cond.wait(left)
        if self.failed:
            log.warning(
                "the last checkpoint upload failed (%s); %s may be behind", self.failed, self.store.url
            )
        return True


# -- prepared data -------------------------------------------------------------------------------------


def dataset_cache(url: str, cache_dir: Path) -> Path:
    """Local folder that mirrors the prepared dataset at `url`."""
    tail = url.rstrip("/").rsplit("/", 1)[-1] or "root"
    return cache_dir / f"remote-{tail}-{hashlib.sha256(url.encode()).hexdigest()[:10]}"


def fetch_dataset(url: str, local: Path, storage_options: dict[str, Any] | None = None) -> Path:
    """Mirror a prepared dataset folder from `url` into `local`, verifying every file; returns `local`.

    The manifest is read first and written locally last. A file already present with the recorded size and
    sha256 is kept (an interrupted download resumes); each other one is downloaded atomically and must hash
    to the manifest's sha256, or the download stops naming it.
    """
    import numpy as np

    from lm.data.shards import MANIFEST, SPLITS, TOKENIZER
    from lm.data.tokenizer import file_sha256

    fs, path = open_fs(url, storage_options)
    try:
        raw = fs.cat_file(f"{path}/{MANIFEST}")
    except FileNotFoundError:
        raise RemoteError(
            f"no {MANIFEST} in {url}: it is not a prepared dataset (or its upload did not finish); upload the "
            f"folder `lm prepare` wrote, manifest.json last (`lm prepare ... data.dir={url}` does)"
        ) from None
    except Exception as e:
        raise explain(e, url, f"reading {MANIFEST} from") from e
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
            why = download_verified(fs, f"{path}/{name}", local / name, size, sha)
        except FileNotFoundError:
            why = "it is missing"
        except Exception as e:
            raise explain(e, url, f"downloading {name} from") from e
        if why is not None:
            raise RemoteError(
                f"{url}/{name} does not match the manifest ({why}): the remote copy is corrupt or from "
                f"another preparation; upload the folder again (`lm prepare ... data.dir={url}`)"
            )
    (local / MANIFEST).write_bytes(raw)  # last: a folder with a manifest is complete
    return local


def upload_dataset(local: Path, url: str, storage_options: dict[str, Any] | None = None) -> int:
    """Upload a prepared dataset folder to `url`, manifest.json last; returns the files uploaded.

    Files already there with the same size are skipped (a rerun resumes an interrupted upload); training
    from `url` checks every shard's sha256, so a stale same-size object cannot slip through.
    """
    from lm.data.shards import MANIFEST, SPLITS, TOKENIZER

    fs, path = open_fs(url, storage_options)
    manifest = json.loads((local / MANIFEST).read_text())
    try:
        if (
            fs.exists(f"{path}/{MANIFEST}")
            and fs.cat_file(f"{path}/{MANIFEST}") == (local / MANIFEST).read_bytes()
        ):
            return 0
        names = [TOKENIZER, *(s["file"] for sp in SPLITS for s in manifest["splits"][sp]["shards"])]
        fs.invalidate_cache(path)
        there = {Path(p["name"]).name: p["size"] for p in fs.ls(path, detail=True)} if fs.exists(path) else {}
        sent = 0
        for name in names:
            if there.get(name) != (local / name).stat().st_size:
                fs.put_file(str(local / name), f"{path}/{name}")
                sent += 1
        fs.put_file(str(local / MANIFEST), f"{path}/{MANIFEST}")
    except RemoteError:
        raise
    except Exception as e:
        raise explain(e, url, "uploading the dataset to") from e
    return sent + 1
