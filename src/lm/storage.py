"""Object storage through fsspec (`s3://`, `gs://`, `file://`, any fsspec URL): opening a URL, turning a
client's exception into a message that names the fix, a write probe, and verified, atomic downloads.

The checkpoint pointer protocol (`lm.remote`) and the prepared-data mirror (`lm.data.mirror`) build on these.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import IO, Any

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
