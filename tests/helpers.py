"""Helpers more than one test module uses: hashing, the S3 server (moto), the bucket's checkpoint pointer and
loading an experiment's script as a module.

Fixtures built on them (`root`, `s3_server`) are in conftest.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import threading
from pathlib import Path

from lm.checkpoint.remote import POINTER

BUCKET = "lm-test"
"""The bucket `s3_server` makes (each module that asks for it gets a server of its own)."""


def load_script(path: Path, name: str):
    """An experiment's Python script (experiments/<date>-<topic>/*.py, not a package) imported as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up while the class is built
    spec.loader.exec_module(module)
    return module


def sha256(data: bytes | Path) -> str:
    """The hex sha256 of bytes, or of a file's contents (read in blocks)."""
    h = hashlib.sha256()
    if isinstance(data, bytes):
        h.update(data)
    else:
        with open(data, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# -- object storage ---------------------------------------------------------------------------------------


def moto_server(port: int = 0):
    """moto's S3 server on loopback, not yet started (port 0: a free one). Its buckets live in moto's
    in-process backend, so they outlive a server stopped and started again on the same port."""
    from moto.server import ThreadedMotoServer  # optional: the fixtures skip without moto

    return ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)


class S3Server:
    """moto's S3 on a fixed loopback port that can be stopped and started again mid-run.

    The buckets live in moto's in-process backend, so they survive a restart (as a real store's data does).
    """

    def __init__(self) -> None:
        self.server = moto_server()
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.lock = threading.Lock()
        self.up = True

    @property
    def env(self) -> dict[str, str]:
        """What a training process needs to reach this server with fake credentials."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{self.host}:{self.port}",
            "AWS_EC2_METADATA_DISABLED": "true",  # never wait for an instance-metadata service
        }

    def stop(self) -> None:
        with self.lock:
            if self.up:
                self.server.stop()
                self.up = False

    def start(self) -> None:
        with self.lock:
            if not self.up:
                self.server = moto_server(self.port)
                self.server.start()
                self.up = True

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(
            skip_instance_cache=True,
            key="testing",
            secret="testing",
            endpoint_url=f"http://{self.host}:{self.port}",
        )


def pointer_steps(fs, prefix: str) -> list[int]:
    """The steps the checkpoint pointer (`latest.json`) under `prefix` lists, newest first; [] before the first
    upload. `prefix` is `<bucket>/<checkpoint.remote's path>/<run.name>/checkpoints`."""
    fs.invalidate_cache()
    try:
        doc = json.loads(fs.cat_file(f"{prefix}/{POINTER}"))
    except FileNotFoundError:
        return []
    return sorted((e["step"] for e in doc["checkpoints"]), reverse=True)
