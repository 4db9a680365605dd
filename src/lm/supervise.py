"""`lm supervise -- python train.py ...`: rerun a training command until it finishes.

Resume is the default, so rerunning the same command continues the run; this loop only decides when to rerun:

| child exit | meaning | supervisor |
|---|---|---|
| 0 | finished | exits 0 |
| 75 (`EXIT_PREEMPTED`) | a stop signal was handled and the checkpoint saved, or a rollback | restarts at once |
| 78 (`EXIT_CONFIG`), 65 (`EXIT_DIVERGED`), 74 (`EXIT_SAVE_FAILED`), 2 | a refusal a restart cannot fix | exits with it |
| anything else, or killed by a signal (SIGKILL, OOM) | a crash | restarts after a backoff |

Crashes back off exponentially; `max_failures` crashes in a row, each within `start_secs` of starting (the
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

from lm.callbacks.spot import EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_SAVE_FAILED

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
    restarts = failures = 0
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
            child = subprocess.Popen(list(cmd), env={**os.environ, "LM_RESTARTS": str(restarts)})
            code = child.wait()
            uptime = time.monotonic() - start
            what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            if code == 0:
                log.info("lm supervise: finished after %d restart(s)", restarts)
                return 0
            if stopping:
                log.warning(
                    "lm supervise: stopped by %s; the child left with %s",
                    signal.Signals(stopping[0]).name,
                    what,
                )
                return EXIT_PREEMPTED if code == EXIT_PREEMPTED else (code if code > 0 else 128 - code)
            if code in FINAL:
                log.error("lm supervise: %s (%s); not restarting", FINAL[code], what)
                return code
            if restarts >= max_restarts:
                log.error("lm supervise: %d restarts, the limit (--max-restarts); giving up", restarts)
                return code if code > 0 else 128 - code
            if code == EXIT_PREEMPTED:
                failures = 0
                wait = 0.0
            else:
                failures = failures + 1 if uptime < start_secs else 1
                if failures > max_failures:
                    log.error(
                        "lm supervise: %d crashes in a row within %.0f s of starting (last: %s); giving up",
                        failures,
                        start_secs,
                        what,
                    )
                    return code if code > 0 else 128 - code
                wait = backoff_s(failures, backoff, max_backoff)
            restarts += 1
            log.warning(
                "lm supervise: child left with %s after %.1f s; restart %d in %.1f s",
                what,
                uptime,
                restarts,
                wait,
            )
            time.sleep(wait)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
