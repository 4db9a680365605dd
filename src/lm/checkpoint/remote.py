"""Checkpoints and prepared data on object storage (`s3://`, `gs://`, any fsspec URL), so a run can move
to whichever region has the cheap GPU today instead of staying where its volume is.

Object stores have no rename and no symlink, but a single PUT is atomic: a reader sees the whole object or
none of it. So a remote checkpoint folder holds immutable objects and one small pointer, written last:

    <url>/step-<N>.<token>.ckpt     a checkpoint, uploaded once and never overwritten (the token is random);
                                    a sharded one (checkpoint.format=sharded) is a prefix holding each file of
                                    its folder as an object, every one listed in the pointer with its size and
                                    sha256 (`Entry.parts`)
    <url>/latest.json               the pointer: the kept checkpoints, newest first, with step, size, sha256,
                                    and the run that wrote them (its id and identity)
    <url>/archive-<time>.json       a pointer set aside by `run.resume=false` (its checkpoints are kept)

A reader only trusts objects a pointer lists, and checks their size and sha256 on download, so an upload a
kill interrupted (an object without a pointer update, or no object at all) is never picked. Rotation
deletes only objects that no pointer lists, after the new pointer is written.

The folder is keyed by run name, so two runs can meet in one folder by accident (another `run.root`, the same
`run.name` and `checkpoint.remote`). The pointer therefore names its run: an id (also in the run directory's
run.json) and the identity it was started with (`run_identity`). A run that finds another run's pointer is
refused before anything is downloaded (`RemoteCheckpoints.claim`), while a new machine continuing the same run
(same identity, no run.json yet) adopts the pointer's id and resumes.

The storage primitives (URLs, errors that name the fix, verified downloads) are `lm.store.objects`'s; prepared
data is mirrored by `lm.data.mirror`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar

from lm.base.exits import Refused
from lm.checkpoint.files import (
    LAST,
    checkpoint_step,
    is_sharded,
    is_step_object,
    loadable,
    remote_name,
    remove,
    step_name,
)
from lm.checkpoint.formats import TMP_MARK
from lm.checkpoint.local import replace_symlink
from lm.config import CheckpointConfig, DataConfig, RunConfig
from lm.model import ModelConfig
from lm.store import rundir
from lm.store.objects import (
    CHUNK,
    RETRY_WINDOW_S,
    RemoteError,
    check_writable,
    download_verified,
    hash_stream,
    open_fs,
    retrying,
)

log = logging.getLogger(__name__)

POINTER = "latest.json"
POINTER_FORMAT = 1
T = TypeVar("T")

MODEL_IDENTITY = (
    "vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "ffn_hidden", "ffn_multiple", "tie_embeddings",
    "vocab_multiple",
)  # fmt: skip
"""The model keys that shape the weights (not max_seq_len or rope_theta: a context extension changes them)."""
DATA_IDENTITY = ("source", "dir", "paths", "name", "subset", "tokenizer", "vocab_size", "seed")
"""The data keys that say which tokens, in which order (not seq_len, batch size, workers or cache_dir)."""


def run_identity(run: RunConfig, model: ModelConfig, data: DataConfig) -> dict[str, Any]:
    """What makes two invocations one run, as the pointer records it: name, root and seed as written, the
    weights' shape and the data's identity. A new machine running the same command has the same identity."""
    identity = {"run.name": run.name, "run.root": run.root, "run.seed": run.seed}
    identity |= {f"model.{k}": getattr(model, k) for k in MODEL_IDENTITY}
    identity |= {f"data.{k}": getattr(data, k) for k in DATA_IDENTITY}
    return json.loads(json.dumps(identity))  # as read back from the pointer (tuples become lists)


def new_run_id() -> str:
    return uuid.uuid4().hex


# -- checkpoints ---------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One uploaded checkpoint as the pointer records it."""

    file: str
    step: int
    size: int
    sha256: str
    """Of the object; for a sharded checkpoint, of its parts' `name sha256` lines."""
    parts: list[dict[str, Any]] | None = None
    """A sharded checkpoint's files under `<file>/`: [{"name", "size", "sha256"}]; None for one object."""


class RemoteCheckpoints:
    """One run's checkpoint folder on object storage: immutable step objects and the `latest.json` pointer.

    Only rank 0 writes. Two machines writing the same folder at once are not supported (the second one's
    rotation would delete the first one's newest checkpoint): one run, one writer, as on a local disk.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        keep_last: int = 3,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.fs, self.path = open_fs(self.url, storage_options)
        self.keep_last = keep_last
        self.retry_window_s = retry_window_s
        """How long an outage is retried before `Unavailable` (checkpoint.retry_window_s)."""
        self.run_id: str | None = None
        """The run this process writes for, recorded in every pointer it writes (set by `claim`)."""
        self.identity: dict[str, Any] = {}
        """`run_identity` of this process's run, recorded beside the id."""

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}"

    def _retry(self, call: Callable[[], T], doing: str) -> T:
        return retrying(call, self.url, doing, self.retry_window_s)

    def read_doc(self, name: str = POINTER) -> dict[str, Any] | None:
        """The pointer document as written, or None when there is none (or the bucket is gone)."""
        self.fs.invalidate_cache(self.path)
        try:
            raw = self._retry(lambda: self.fs.cat_file(self._key(name)), f"reading {name} from")
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            doc["checkpoints"] = [Entry(**e) for e in doc["checkpoints"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RemoteError(
                f"{self.url}/{name} is not a checkpoint pointer ({e}); it was not written by lm: move it "
                f"away, or point checkpoint.remote elsewhere"
            ) from e
        return doc

    def read_pointer(self, name: str = POINTER) -> list[Entry]:
        """The checkpoints the pointer lists, newest first; [] when there is no pointer yet."""
        doc = self.read_doc(name)
        return sorted(doc["checkpoints"] if doc else [], key=lambda e: e.step, reverse=True)

    def _write_pointer(self, entries: list[Entry], name: str = POINTER) -> None:
        doc = {
            "format": POINTER_FORMAT,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": socket.gethostname(),
            "run_id": self.run_id,
            "identity": self.identity,
            "checkpoints": [asdict(e) for e in entries],
        }
        data = (json.dumps(doc, indent=1) + "\n").encode()
        self._retry(lambda: self.fs.pipe_file(self._key(name), data), f"writing {name} to")  # one atomic PUT

    def claim(self, local_id: str | None, identity: dict[str, Any], explicit: str | None = None) -> str:
        """Decide which run this process continues, before anything is downloaded; returns its id.

        `local_id` is the run directory's (None when it is fresh), `explicit` is checkpoint.run_id. A pointer
        of another run is a RemoteError naming both runs and the fixes; a fresh directory (a new machine)
        adopts the pointer's run when the identities match. A pointer without an id (written before run
        ids) is continued as before and gets this run's id at the next upload.
        """
        doc = self.read_doc()
        theirs = doc.get("run_id") if doc and doc["checkpoints"] else None
        self.identity = identity
        if theirs is None or theirs in (explicit, local_id):
            self.run_id = theirs or explicit or local_id or new_run_id()
            if theirs is not None and local_id is None:
                log.info("continuing run %s from %s (checkpoint.run_id)", theirs, self.url)
            return self.run_id
        written = f"written from {doc.get('host', '?')} at {doc.get('written_at', '?')}"
        fixes = (
            f"Fixes: give this run another run.name or checkpoint.remote; run.resume=false to start over here "
            f"(the bucket's pointer is archived, its checkpoints kept); or checkpoint.run_id={theirs} to "
            f"continue that run with this config"
        )
        if explicit is not None:
            raise RemoteError(
                f"checkpoint.run_id={explicit}, but {self.url} holds run {theirs} ({written}). {fixes}"
            )
        if local_id is not None:
            raise RemoteError(
                f"this run directory belongs to run {local_id} (run.json), but {self.url} holds run {theirs} "
                f"({written}): two runs share one remote folder, and this one would resume from the other's "
                f"checkpoints. {fixes}"
            )
        differ = identity_diff(doc.get("identity") or {}, identity)
        if not differ:
            self.run_id = theirs
            log.info(
                "continuing run %s from %s: the run directory is new and the run is the same",
                theirs,
                self.url,
            )
            return theirs
        raise RemoteError(
            f"{self.url} holds another run's checkpoints (run {theirs}, {written}), and this is not that run: "
            f"{'; '.join(differ)}. Nothing was downloaded. {fixes}"
        )

    def upload(self, f: IO[bytes], step: int) -> Entry:
        """Upload a checkpoint, then the pointer naming it, then delete what no pointer lists any more.

        A kill before the pointer is written leaves the previous pointer, and the checkpoints it lists,
        untouched: the remote folder always describes complete, verified checkpoints.
        """
        name = remote_name(step)  # never overwrites an object a pointer lists

        def put() -> tuple[int, str]:
            f.seek(0)
            with self.fs.open(self._key(name), "wb", block_size=CHUNK) as w:  # multipart: complete or absent
                return hash_stream(f, w)

        size, sha = self._retry(put, f"uploading step {step} to")
        return self._publish(Entry(name, step, size, sha))

    def upload_folder(self, parts: dict[str, IO[bytes]], step: int) -> Entry:
        """Upload a sharded checkpoint's files (open, so local rotation cannot take them away) under one fresh
        prefix, then the pointer listing each with its size and sha256: a reader trusts the folder only whole."""
        name = remote_name(step)
        listed = []
        for part, f in sorted(parts.items()):

            def put(f: IO[bytes] = f, part: str = part) -> tuple[int, str]:
                f.seek(0)
                with self.fs.open(self._key(f"{name}/{part}"), "wb", block_size=CHUNK) as w:
                    return hash_stream(f, w)

            size, sha = self._retry(put, f"uploading step {step}'s {part} to")
            listed.append({"name": part, "size": size, "sha256": sha})
        digest = hashlib.sha256("".join(f"{p['name']} {p['sha256']}\n" for p in listed).encode()).hexdigest()
        return self._publish(Entry(name, step, sum(p["size"] for p in listed), digest, listed))

    def _publish(self, entry: Entry) -> Entry:
        """The pointer with `entry` as the newest, then the deletion of what no pointer lists any more."""
        step = entry.step
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
        names = [Path(p).name for p in self._retry(lambda: self.fs.ls(self.path, detail=False), "listing")]
        listed = {e.file for n in names if n.endswith(".json") for e in self.read_pointer(n)}
        for n in names:
            if is_step_object(n) and n not in listed:  # an object, or a sharded checkpoint's prefix
                self._retry(partial(self.fs.rm, self._key(n), recursive=True), f"deleting {n} from")

    def archive_pointer(self) -> str | None:
        """`run.resume=false`: set the pointer aside as `archive-<time>.json` (its checkpoints stay)."""
        if not self.read_pointer():
            return None
        name = f"archive-{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
        # Copied as written: the archive keeps naming the run that wrote it.
        self._retry(lambda: self.fs.copy(self._key(POINTER), self._key(name)), f"archiving {POINTER} in")
        self._retry(lambda: self.fs.rm_file(self._key(POINTER)), f"archiving {POINTER} in")
        return f"{self.url}/{name}"

    def holds(self, step: int, size: int) -> str | None:
        """None when the pointer's newest checkpoint is `step`, and its object is there with `size` bytes (the
        local file's); else what the bucket lacks. Read back at the end of a run, after the last upload."""
        try:
            entries = self.read_pointer()
            if not entries:
                return f"there is no {POINTER} (the bucket or the folder was emptied, or no upload succeeded)"
            newest = entries[0]
            if newest.step != step:
                return f"{POINTER} names step {newest.step} as the newest"
            keys = [f"{newest.file}/{p['name']}" for p in newest.parts] if newest.parts else [newest.file]
            there = sum(
                self._retry(lambda k=k: self.fs.info(self._key(k))["size"], f"checking {k} in") for k in keys
            )
        except FileNotFoundError:
            return f"{newest.file}, which {POINTER} lists, is missing"
        except (RemoteError, OSError) as e:  # a refusal, or an outage past the retry window
            return f"it cannot be read ({e})"
        if not newest.size == there == size:
            return f"{newest.file} has {there} bytes, {POINTER} says {newest.size}, the local file {size}"
        return None

    def download_newest(self, ckpt_dir: Path, newer_than: int = -1, loads=None) -> Path | None:
        """Download the newest listed checkpoint beyond step `newer_than` that verifies (size, sha256 and,
        with `loads`, a load check) into `ckpt_dir/step-<N>.ckpt`; older ones are tried after a bad one."""
        for entry in self.read_pointer():
            if entry.step <= newer_than:
                return None
            dst = ckpt_dir / step_name(entry.step)
            log.info(
                "downloading %s/%s (step %d, %.1f MB)", self.url, entry.file, entry.step, entry.size / 1e6
            )
            try:
                why = self.download_entry(entry, dst)
            except FileNotFoundError:
                why = "the object is missing"
            if why is None and loads is not None and (why := loads(dst)) is not None:
                remove(dst)
            if why is None:
                return dst
            log.warning(
                "remote checkpoint %s/%s is unusable (%s); trying an older one", self.url, entry.file, why
            )
        return None

    def download_entry(self, entry: Entry, dst: Path) -> str | None:
        """One listed checkpoint to `dst`, verified; a sharded one part by part into `<dst>.tmp-download/`,
        renamed to `dst` once every part verified. None, or why it was refused (nothing left behind)."""
        if not entry.parts:
            return self._retry(
                partial(download_verified, self.fs, self._key(entry.file), dst, entry.size, entry.sha256),
                f"downloading {entry.file} from",
            )
        tmp = dst.with_name(f"{dst.name}{TMP_MARK}download")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for p in entry.parts:
                key = self._key(f"{entry.file}/{p['name']}")
                fetch = partial(download_verified, self.fs, key, tmp / p["name"], p["size"], p["sha256"])
                if (why := self._retry(fetch, f"downloading {entry.file}/{p['name']} from")) is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    return f"{p['name']}: {why}"
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if dst.exists():
            remove(dst)
        os.replace(tmp, dst)
        return None


def identity_diff(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """`key: theirs -> ours` for every identity key whose value differs (keys one side lacks are skipped:
    a pointer written by an older lm records fewer)."""
    return [
        f"{k} {theirs[k]!r} there, {ours[k]!r} here" for k in ours if k in theirs and theirs[k] != ours[k]
    ]


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
        self.refusal: Refused | None = None
        """The bucket's refusal of the latest upload (access denied, no bucket), which no retry cures."""
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
        # Opened now to pin the file(s) against rotation; closed by the upload thread.
        if is_sharded(path):
            f: Any = {p.name: open(p, "rb") for p in sorted(path.iterdir()) if p.is_file()}  # noqa: SIM115
        else:
            f = open(path, "rb")  # noqa: SIM115
        with self._cond:
            if self._pending is not None:
                close(self._pending[0])
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
                entry = (
                    self.store.upload_folder(f, step) if isinstance(f, dict) else self.store.upload(f, step)
                )
                self.uploaded_step, self.failed, self.refusal = step, None, None
                log.info(
                    "uploaded step %d to %s/%s (%.1f MB in %.1f s)",
                    step, self.store.url, entry.file, entry.size / 1e6, time.monotonic() - t0,
                )  # fmt: skip
            except Exception as e:
                self.failed = f"step {step}: {type(e).__name__}: {e}"
                self.refusal = e if isinstance(e, Refused) else None
                log.error(
                    "uploading step %d to %s failed (%s: %s); the local checkpoint is intact and the next "
                    "save uploads again", step, self.store.url, type(e).__name__, e,
                )  # fmt: skip
            finally:
                close(f)
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


def close(f: IO[bytes] | dict[str, IO[bytes]]) -> None:
    """Close a pinned checkpoint: one file, or a sharded checkpoint's files."""
    for one in f.values() if isinstance(f, dict) else [f]:
        one.close()


def remote_checkpoints(
    c: CheckpointConfig, identity: dict[str, Any], run: RunConfig, run_dir: Path
) -> RemoteCheckpoints | None:
    """The run's remote checkpoint folder, `<checkpoint.remote>/<run dir under run.root>/checkpoints`, after a
    write probe (credentials, bucket, permissions) so that a bad URL fails before training, and claimed for
    this run (`RemoteCheckpoints.claim`: another run's folder, told by its `identity` (`run_identity`), is
    refused before anything is downloaded); None if off."""
    if c.remote is None:
        return None
    url = f"{c.remote.rstrip('/')}/{run_dir.relative_to(Path(run.root)).as_posix()}/checkpoints"
    check_writable(url, c.storage_options, c.retry_window_s)
    remote = RemoteCheckpoints(url, c.storage_options, c.keep_last, c.retry_window_s)
    if run.resume:
        remote.claim(rundir.read_run_id(run_dir), identity, c.run_id)
    else:  # starting over: the bucket's pointer is archived by lm.checkpoint.checkpointer.archive_run
        remote.run_id, remote.identity = c.run_id or new_run_id(), identity
    return remote


def remote_behind(remote: RemoteCheckpoints, run_dir: Path) -> str | None:
    """At the end of a run: None when the bucket holds the run's latest checkpoint, else a message naming the
    step, the bucket and what is missing. The verdict goes to remote.json, for the report."""
    last = run_dir / rundir.CHECKPOINTS / LAST
    if not last.exists():
        return None
    target = last.resolve()
    size = sum(p.stat().st_size for p in target.iterdir()) if is_sharded(target) else target.stat().st_size
    step = checkpoint_step(target)
    why = remote.holds(step, size)
    rundir.write_record(
        run_dir / rundir.REMOTE, {"url": remote.url, "step": step, "holds": why is None, "why": why}
    )
    if why is None:
        return None
    return (
        f"{remote.url} does not hold this run's latest checkpoint, step {step}: {why}. The local checkpoint "
        f"{last.resolve()} is intact and continues the run on this machine; a new machine would start from an "
        f"older step, or from scratch, until a later save is uploaded. Check the bucket (the upload errors "
        f"above say why)"
    )


def fetch_newer(ckpt_dir: Path, remote: RemoteCheckpoints, local_step: int, have_local: bool) -> Path | None:
    """Download the newest remote checkpoint beyond `local_step` (the newest local one that loads; -1 when
    there is none) and point `last.ckpt` at it; returns it, or None. `have_local`: a local checkpoint loads
    (when not, and the bucket lists some that do not verify, say so)."""
    fetched = remote.download_newest(ckpt_dir, newer_than=local_step, loads=loadable)
    if fetched is not None:
        replace_symlink(fetched, ckpt_dir / LAST)
        log.info(
            "resuming from %s (step %s), newer than any local checkpoint",
            remote.url,
            checkpoint_step(fetched),
        )
    elif not have_local and remote.read_pointer():
        log.warning("no checkpoint in %s verifies; starting without one", remote.url)
    return fetched
