"""Exit codes and the exceptions that carry them: how a run tells `lm supervise` (or any restarter) what to do.

| code | meaning | a restart |
|---|---|---|
| 0 | finished (or stopped early on purpose) | not needed |
| 75 `EXIT_PREEMPTED` | a stop signal's checkpoint is saved, or a rollback after non-finite steps | resumes |
| 65 `EXIT_DIVERGED` | non-finite again after a rollback: deterministic divergence | cannot help |
| 74 `EXIT_SAVE_FAILED` | a checkpoint could not be written (disk full, quota) | would fail again |
| 78 `EXIT_CONFIG` | a config, data or preflight refusal that names its fix | cannot help |
| 69 `EXIT_UNAVAILABLE` | something a later restart can fix is unavailable (object storage down past the retry window) | resumes, after a backoff |

Codes follow sysexits.h, so other supervisors read them the same way.
"""

from __future__ import annotations

EXIT_PREEMPTED = 75
"""A stop signal was handled and the checkpoint saved, or a rollback: "restart me" (EX_TEMPFAIL)."""
EXIT_DIVERGED = 65
"""Training diverged again after a rollback: a human must look (EX_DATAERR)."""
EXIT_SAVE_FAILED = 74
"""A checkpoint could not be written; the previous ones are intact and a restart would only fail at the next
save (EX_IOERR)."""
EXIT_CONFIG = 78
"""A config or preflight check refused the run; restarting cannot help (EX_CONFIG)."""
EXIT_UNAVAILABLE = 69
"""Something the run needs is temporarily unavailable (object storage down past the in-process retry window):
a later restart can succeed (EX_UNAVAILABLE)."""


class Preempted(SystemExit):
    """Raised at a step boundary once a stop signal's checkpoint is saved; the process exits with 75."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.reason = reason


class Diverged(SystemExit):
    """Training hit `spot.max_nonfinite` non-finite steps in a row: 75 to roll back, 65 on a repeat."""

    def __str__(self) -> str:
        if self.code == EXIT_DIVERGED:
            return "diverged again after a rollback (see checkpoints/rollbacks.json)"
        return "non-finite steps in a row: rolling back to the last checkpoint"


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the previous checkpoints are untouched (exit 74)."""


class Unavailable(OSError):
    """Something the run needs is down for longer than the process waits for it (exit 69): not a refusal, since
    the same command succeeds once it is back, and not a crash. An OSError, like the network errors it ends."""


class JobFailed(Exception):
    """A job of a sweep that failed for a reason a rerun would meet again (a refusal, a divergence).

    `train.py` raises it instead of exiting in a multirun, so Hydra records the job as failed and runs the next
    one; `lm.sweep.SweepSummary` turns it into a `failed` row and ends the sweep with `exit_code`.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code(error: BaseException) -> int | None:
    """The code a run that raised `error` leaves with when it is not a crash: a refusal or a failure no restart
    can help, or 69 for an outage a later restart can outlast; None for a crash (exit 1, which `lm supervise`
    retries) or a rollback (75, raised as it is)."""
    if isinstance(error, Unavailable):
        return EXIT_UNAVAILABLE
    if isinstance(error, CheckpointSaveError):
        return EXIT_SAVE_FAILED
    if isinstance(error, ValueError):  # a refusal that names its fix (config, data, disk)
        return EXIT_CONFIG
    if isinstance(error, Diverged) and error.code == EXIT_DIVERGED:
        return EXIT_DIVERGED
    return None
