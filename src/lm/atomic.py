"""One way to write a small file so that a crash leaves either the old file or the whole new one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` (text is UTF-8 encoded) to `path`: a hidden temporary beside it, fsync, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
