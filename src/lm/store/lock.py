"""One trainer per run directory: `<run dir>/.lock`, held by the training process for as long as it runs.

A second launch by mistake, or a supervisor restarting while the old process still winds down, would otherwise
interleave two processes' checkpoints and ledgers, and `run.resume=false` would archive the files of a run that
is still writing them. The lock is `flock` on a descriptor kept open for the process's lifetime: the kernel
releases it when the process dies however it dies, so a lock is never stale on the host that held it (a
SIGKILL, an OOM kill). The holder writes its pid, host and start time into the file, for the refusal message.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from lm.base.exits import Unavailable
from lm.store import atomic

LOCK = ".lock"


class RunLocked(Unavailable):
    """Another live process trains this run (exit 69: `lm supervise` retries with backoff, by when the other
    process has usually exited)."""


class RunLock:
    """The exclusive lock on one run directory; `acquire` it before anything in the directory changes."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise `RunLocked` naming the holder's pid and host and the fix."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLocked(self.refusal()) from None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self.fd = fd
        atomic.own(self.path.parent, lambda: not self.removed())  # every run-file write checks it first
        return self

    def release(self) -> None:
        """Give the lock up now. Unlocked explicitly rather than only closed: forked children (DataLoader
        workers) share the descriptor and would keep the lock while they live."""
        atomic.disown(self.path.parent)
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def removed(self) -> bool:
        """Whether the lock file this process holds is no longer at its path: the run directory (or the lock)
        was removed or replaced while the run trained. A writer that recreates a folder on its way (the next
        checkpoint) does not hide it: the new `.lock`, if any, is another file."""
        if self.fd is None:
            return False
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return True
        held = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def holder(self) -> dict:
        """What the holder wrote: pid, host, since (empty while it has not written yet)."""
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            return {}

    def refusal(self) -> str:
        h = self.holder()
        pid, host = h.get("pid", "?"), h.get("host", "?")
        return (
            f"{self.path.parent} is in use: another trainer (pid {pid} on host {host}, since "
            f"{h.get('since', '?')}) holds {self.path}. Two processes on one run would mix their checkpoints "
            f"(and run.resume=false would archive its live files). Wait for it to finish, or stop it "
            f"(`kill -TERM {pid}` on {host} saves a checkpoint and exits 75), then rerun the same command; "
            f"`lm supervise` retries this exit (69) with backoff"
        )
