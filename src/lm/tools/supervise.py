"""`lm supervise -- python train.py ...`: rerun a training command until it finishes.

Resume is the default, so rerunning the same command continues the run; this loop only decides when to rerun:

| child exit | meaning | supervisor |
|---|---|---|
| 0 | finished | exits 0 |
| 75 (`EXIT_PREEMPTED`) | a stop signal was handled and the checkpoint saved, or a rollback | restarts at once |
| 78 (`EXIT_CONFIG`), 65 (`EXIT_DIVERGED`), 74 (`EXIT_SAVE_FAILED`), 2 | a refusal a restart cannot fix | exits with it |
| 69 (`EXIT_UNAVAILABLE`) | something was down past the run's own retry window (object storage) | restarts after a backoff |
| anything else, or killed by a signal (SIGKILL, OOM) | a crash | restarts after a backoff |

Crashes and outages (69) back off exponentially; `max_failures` crashes in a row, each within `start_secs` of starting (the
command fails before it makes progress, like supervisord's startsecs), give up. When the supervisor itself gets
SIGTERM/SIGINT (the whole machine is going away) it forwards the signal, waits for the save, and exits.
For reprovisioning a lost machine use an engine built for it (SkyPilot managed spot jobs run this command).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lm.store.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_SAVE_FAILED

log = logging.getLogger(__name__)

FINAL = {
    EXIT_CONFIG: "config or preflight refusal",
    EXIT_DIVERGED: "training diverged",
    EXIT_SAVE_FAILED: "a checkpoint could not be written (disk full? quota?)",
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
    max_restarts: int = 1000
    backoff: float = 5.0
    max_backoff: float = 300.0
    start_secs: float = 60.0
    restarts: int = 0
    failures: int = 0
    """Crashes in a row, each within start_secs of starting."""

    def after(self, code: int, uptime: float, what: str) -> tuple[int | None, float]:
        """(exit status to leave with, or None to restart; seconds to wait before the restart)."""
        if code in FINAL:
            log.error("lm supervise: %s (%s); not restarting", FINAL[code], what)
            return code, 0.0
        if self.restarts >= self.max_restarts:
            log.error("lm supervise: %d restarts, the limit (--max-restarts); giving up", self.restarts)
            return exit_status(code), 0.0
        if code == EXIT_PREEMPTED:
            self.failures = 0
            return None, 0.0
        self.failures = self.failures + 1 if uptime < self.start_secs else 1
        if self.failures > self.max_failures:
            log.error(
                "lm supervise: %d crashes in a row within %.0f s of starting (last: %s); giving up",
                self.failures, self.start_secs, what,
            )  # fmt: skip
            return exit_status(code), 0.0
        return None, backoff_s(self.failures, self.backoff, self.max_backoff)


def supervise(
    cmd: Sequence[str],
    *,
    max_failures: int = 5,
    max_restarts: int = 1000,
    backoff: float = 5.0,
    max_backoff: float = 300.0,
    start_secs: float = 60.0,
) -> int:
    """Run `cmd` until it exits 0 or a final code; returns the exit code to leave with.

    The child gets `LM_RESTARTS=<n>` in its environment (restarts so far) so a run can report it.
    """
    policy = RestartPolicy(max_failures, max_restarts, backoff, max_backoff, start_secs)
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
            child = subprocess.Popen(list(cmd), env={**os.environ, "LM_RESTARTS": str(policy.restarts)})
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
            status, wait = policy.after(code, uptime, what)
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
