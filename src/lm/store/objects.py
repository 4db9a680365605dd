"""Object storage through fsspec (`s3://`, `gs://`, `file://`, any fsspec URL): opening a URL, telling a
refusal from an outage, retrying an outage, a write probe, and verified, atomic downloads.

Every failure is one of two kinds, decided here only (`transient`):
- a refusal a restart cannot fix (no such bucket, access denied, no credentials, a malformed URL, a missing
  package): `RemoteError`, a ValueError, exit 78, with a message that names the fix;
- an outage (connection refused or reset, a timeout, a 5xx, throttling): retried with exponential backoff and
  jitter for a bounded window (`retrying`), then `Unavailable`, exit 69, which `lm supervise` restarts.

The checkpoint pointer protocol (`lm.checkpoint.remote`) and the prepared-data mirror (`lm.data.mirror`) build on these.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from lm.base.exits import Refused, Unavailable, outage

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK = 16 << 20  # bytes per read/write while streaming (and hashing) a file
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an "
    "S3-compatible store (R2, MinIO, B2, ...)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key, or run "
    "`gcloud auth application-default login`",
}


RETRY_WINDOW_S = 300.0
"""How long an outage is retried inside the process by default (`checkpoint.retry_window_s`)."""
MAX_DELAY_S = 30.0  # the backoff's ceiling between two attempts
TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException", "BandwidthLimitExceeded",
}  # fmt: skip
"""S3-style error codes that mean "later", whatever the HTTP status."""
DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class RemoteError(Refused):
    """Object storage refused the request; the message names the URL and the fix (exit 78)."""


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
        fix = f"the store refused the request: check the URL and the endpoint ({creds})"
    return RemoteError(f"{doing} {url} failed ({name}: {error}); {fix}")


def causes(error: BaseException) -> list[BaseException]:
    """`error` and what it was raised from (s3fs re-raises botocore's errors, which wrap aiohttp's)."""
    chain: list[BaseException] = []
    while error is not None and error not in chain and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def transient(error: BaseException) -> bool:
    """True for an outage that waiting can cure: the network (refused, reset, timed out), a 5xx, throttling."""
    if outage(error) is not None:
        return True
    for e in causes(error):
        response = getattr(e, "response", None)  # botocore's ClientError
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if (
                code in TRANSIENT_CODES
                or status >= 500
                or status == 429
                or code in ("429", "500", "502", "503", "504")
            ):
                return True
    return False


def retrying(call: Callable[[], T], url: str, doing: str, window_s: float = RETRY_WINDOW_S) -> T:
    """`call()`, with an outage retried (exponential backoff, full jitter) for `window_s` seconds.

    A missing object (FileNotFoundError) is returned to the caller as it is: whether that is a refusal is
    the caller's to say. Any other refusal becomes a RemoteError that names the fix (exit 78); an outage
    that outlasts the window becomes `Unavailable` (exit 69: a restart later may succeed). A local disk that
    filled up is left as it is, for its own exit code.
    """
    deadline = time.monotonic() + window_s
    delay, failures = 1.0, 0
    while True:
        try:
            result = call()
        except (FileNotFoundError, RemoteError, Unavailable):
            raise
        except Exception as e:
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                raise
            if not transient(e):
                raise explain(e, url, doing) from e
            failures += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    f"{doing} {url} failed for {window_s:.0f} s ({type(e).__name__}: {e}); the store is down "
                    f"or unreachable. Nothing is lost: a restart (lm supervise restarts exit 69) retries; raise "
                    f"checkpoint.retry_window_s to wait longer in the process"
                ) from e
            if failures == 1:
                log.warning(
                    "%s %s failed (%s: %s); retrying for up to %.0f s (checkpoint.retry_window_s)",
                    doing, url, type(e).__name__, e, window_s,
                )  # fmt: skip
            time.sleep(min(left, random.uniform(0.0, delay)))
            delay = min(2 * delay, MAX_DELAY_S)
            continue
        if failures:
            log.info("%s %s succeeded after %d failed attempt(s)", doing, url, failures)
        return result


def check_writable(
    url: str, storage_options: dict[str, Any] | None = None, window_s: float = RETRY_WINDOW_S
) -> None:
    """Write and delete a small probe object under `url`: credentials, bucket and permissions are checked
    before a cent is spent on training; an outage is waited out for `window_s` seconds."""
    fs, path = open_fs(url, storage_options)
    probe = f"{path}/.lm-probe-{socket.gethostname()}-{os.getpid()}"

    def write_and_delete() -> None:
        fs.pipe_file(probe, b"lm write probe\n")
        fs.rm_file(probe)

    try:
        retrying(write_and_delete, url, "writing a probe object to", window_s)
    except FileNotFoundError as e:  # the bucket itself: a refusal
        raise explain(e, url, "writing a probe object to") from e


def hash_stream(src: IO[bytes], dst: IO[bytes]) -> tuple[int, str]:
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
            got_size, got_sha = hash_stream(r, w)
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
