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

The storage primitives (URLs, errors that name the fix, verified downloads) are `lm.storage`'s; prepared
data is mirrored by `lm.data.mirror`.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from lm.storage import CHUNK, RemoteError, download_verified, explain, hash_stream, open_fs

log = logging.getLogger(__name__)

POINTER = "latest.json"
POINTER_FORMAT = 1


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
            size, sha = hash_stream(f, w)
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
