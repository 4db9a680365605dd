"""`lm supervise -- python train.py ...`: rerun a training command until it finishes.

Resume is the default, so rerunning the same command continues the run; this loop only decides when. 0 ends
it; 75 (saved on a signal, or a rollback) restarts at once; 78, 65, 74 and 2 (a restart cannot fix them) stop
with that code; 69 (an outage past the run's retry window) and crashes restart after an exponential backoff.
Giving up is decided by exit status and progress, never by how long the child ran (a start-up alone can take over a
minute): more than `max_failures` crashes or outages in a row give up, the count starting again after a
checkpoint (`$LM_PROGRESS_FILE`, `lm.base.exits.report_progress`) or a 75; `max_restarts` in all is the
backstop. A SIGTERM/SIGINT to the supervisor is forwarded and the save waited for. A lost machine is
SkyPilot's to replace (docs/faults.md)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lm.base.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_SAVE_FAILED, PROGRESS_FILE

log = logging.getLogger(__name__)

FINAL = {
    EXIT_CONFIG: "config or preflight refusal",
    EXIT_DIVERGED: "training diverged",
    EXIT_SAVE_FAILED: "a checkpoint or run file could not be written (disk full? quota? read-only?)",
    2: "usage error",
}
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def backoff_s(failures: int, base: float, cap: float) -> float:
    """Seconds to wait before restart number `failures` of a crash streak: base, 2 base, 4 base, ... cap."""
    return min(cap, base * 2 ** max(0, failures - 1))


def exit_status(code: int) -> int:
    """A shell's exit status for a child's return code (killed by signal N: 128 + N)."""
    return code if code >= 0 else 128 - code


@dataclass
class RestartPolicy:
    """When to rerun a child that left with a non-zero code, and how long to wait first."""

    max_failures: int = 5
    max_restarts: int = 100
    backoff: float = 5.0
    max_backoff: float = 300.0
    restarts: int = 0
    failures: int = 0
    """Crashes and outages since the child last made progress (a checkpoint saved, or exit 75)."""

    def after(self, code: int, progress: bool, what: str) -> tuple[int | None, float]:
        """(exit status to leave with, or None to restart; seconds to wait before the restart).

        `progress`: the child saved a checkpoint before it left."""
        if code in FINAL:
            log.error("lm supervise: %s (%s); not restarting", FINAL[code], what)
            return code, 0.0
        if self.restarts >= self.max_restarts:
            log.error(
                "lm supervise: %d restarts, the limit (--max-restarts); giving up (last: %s)",
                self.restarts,
                what,
            )
            return exit_status(code), 0.0
        if code == EXIT_PREEMPTED:
            self.failures = 0
            return None, 0.0
        self.failures = 1 if progress else self.failures + 1
        if self.failures > self.max_failures:
            log.error(
                "lm supervise: %d crashes in a row without a checkpoint saved in between (last: %s), more "
                "than --max-failures=%d; giving up",
                self.failures, what, self.max_failures,
            )  # fmt: skip
            return exit_status(code), 0.0
        return None, backoff_s(self.failures, self.backoff, self.max_backoff)


def supervise(
    cmd: Sequence[str],
    *,
    max_failures: int = 5,
    max_restarts: int = 100,
    backoff: float = 5.0,
    max_backoff: float = 300.0,
) -> int:
    """Run `cmd` until it exits 0 or a final code, or the policy gives up; returns the exit code to leave with.

    The child gets `LM_RESTARTS=<n>` in its environment (restarts so far) so a run can report it, and
    `LM_PROGRESS_FILE`, which it touches when it saves a checkpoint.
    """
    policy = RestartPolicy(max_failures, max_restarts, backoff, max_backoff)
    with tempfile.TemporaryDirectory(prefix="lm-supervise-") as tmp:
        return run_until_done(cmd, policy, Path(tmp) / "progress")


def run_until_done(cmd: Sequence[str], policy: RestartPolicy, progress: Path) -> int:
    """The loop of `supervise`, with the signals it forwards to the child installed meanwhile."""
    stopping: list[int] = []  # a signal the supervisor itself received: pass it on, then do not restart
    child: subprocess.Popen | None = None

    def forward(signum: int, frame) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        while True:
            start = time.monotonic()
            progress.unlink(missing_ok=True)
            env = {**os.environ, "LM_RESTARTS": str(policy.restarts), PROGRESS_FILE: str(progress)}
            child = subprocess.Popen(list(cmd), env=env)
            code = child.wait()
            uptime = time.monotonic() - start
            what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            if code == 0:
                log.info("lm supervise: finished after %d restart(s)", policy.restarts)
                return 0
            if stopping:
                name = signal.Signals(stopping[0]).name
                log.warning("lm supervise: stopped by %s; the child left with %s", name, what)
                return exit_status(code)
            status, wait = policy.after(code, progress.exists(), what)
            if status is not None:
                return status
            policy.restarts += 1
            log.warning(
                "lm supervise: child left with %s after %.1f s; restart %d in %.1f s",
                what, uptime, policy.restarts, wait,
            )  # fmt: skip
            time.sleep(wait)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
