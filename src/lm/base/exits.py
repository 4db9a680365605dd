"""Exit codes and the exceptions that carry them: how a run tells `lm supervise` (or any restarter) what to do.

| code | meaning | a restart |
|---|---|---|
| 0 | finished (or stopped early on purpose) | not needed |
| 75 `EXIT_PREEMPTED` | a stop signal's checkpoint is saved, or a rollback after non-finite steps | resumes |
| 75 (`lm prepare`) | SIGTERM or SIGINT stopped a data preparation: its workers are stopped, finished units kept | resumes |
| 65 `EXIT_DIVERGED` | non-finite again after a rollback: deterministic divergence | cannot help |
| 74 `EXIT_SAVE_FAILED` | a checkpoint or any run file could not be written (disk full, quota, a read-only filesystem), or the run directory was removed under the run | would fail again |
| 78 `EXIT_CONFIG` | a refusal that names its fix (`Refused`: config, data, preflight) or a config that does not compose | cannot help |
| 69 `EXIT_UNAVAILABLE` | something a later restart can fix is unavailable (object storage down past the retry window, the run directory locked by a live process) | resumes, after a backoff |

Any other exception is a crash: its traceback is shown and the process exits 1, which `lm supervise`
restarts within its policy. A library's ValueError is a crash, never a refusal: only `Refused` says "do not
retry". Codes follow sysexits.h, so other supervisors read them the same way.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import re
import sys
import threading
import time

EXIT_PREEMPTED = 75
"""A stop signal was handled and the checkpoint saved, or a rollback: "restart me" (EX_TEMPFAIL)."""
EXIT_DIVERGED = 65
"""Training diverged again after a rollback: a human must look (EX_DATAERR)."""
EXIT_SAVE_FAILED = 74
"""A checkpoint or run file could not be written (a full disk, a quota, a read-only filesystem), or the run
directory was removed under the run; the previous checkpoints are intact (where they still exist) and a restart
would only fail at the next write (EX_IOERR)."""
EXIT_CONFIG = 78
"""A config or preflight check refused the run; restarting cannot help (EX_CONFIG)."""
EXIT_UNAVAILABLE = 69
"""Something the run needs is temporarily unavailable (object storage down past the in-process retry window,
the run directory locked by another live process): a later restart can succeed, so `lm supervise` restarts
with backoff (EX_UNAVAILABLE)."""
EXIT_GRACE_S = 30.0
"""How long a process may take to exit once training is over before it is ended with its exit code."""

PROGRESS_FILE = "LM_PROGRESS_FILE"
"""The environment variable `lm supervise` names a file in: a child touches it when it saves a checkpoint,
so a crash after that starts the supervisor's count of crashes in a row again (`report_progress`)."""

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
UNWRITABLE = (*DISK_FULL, errno.EROFS)
"""The errors of a disk that takes no more writes until someone acts (frees space, remounts it read-write)."""


class Preempted(SystemExit):
    """Raised at a step boundary once a stop signal's checkpoint is saved; the process exits with 75."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.reason = reason


class Interrupted(SystemExit):
    """A stop signal (SIGTERM, SIGINT) ended a data preparation (`lm prepare`, or a run's start-up) once its
    worker processes were stopped; the finished units are kept and a rerun resumes (exit 75)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.signal_name = signal_name

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name}"


class Diverged(SystemExit):
    """Training hit `guards.max_nonfinite` non-finite steps in a row: 75 to roll back, 65 on a repeat."""

    def __str__(self) -> str:
        if self.code == EXIT_DIVERGED:
            return "diverged again after a rollback (see checkpoints/rollbacks.json)"
        return "non-finite steps in a row: rolling back to the last checkpoint"


class Refused(Exception):
    """The run (or verb) refuses its input, and the message names the fix: exit 78, printed without a
    traceback. Raised only where restarting cannot help (a config, data or preflight problem); anything else
    is a crash. `table=True` (the doctor's) keeps the message's lines, any other refusal prints on one line.

    Deliberately not a ValueError: a library's ValueError deep inside a step is a crash to restart, not a
    refusal (a user's callback whose numpy call fails must not end the run as "do not retry")."""

    def __init__(self, message: str, *, table: bool = False) -> None:
        super().__init__(message)
        self.table = table


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the previous checkpoints are untouched (exit 74)."""


class DiskFull(OSError):
    """A run file could not be written because the disk (or the quota) is full, or the filesystem is read-only;
    its temporary is removed where the filesystem allows it and the previous version of the file is intact
    (exit 74)."""


class RunDirRemoved(OSError):
    """The run directory was removed (or replaced) while the run trained: its checkpoints and logs are gone,
    so there is nothing to save to (exit 74)."""


class Unavailable(OSError):
    """Something the run needs is unavailable for longer than the process waits for it (exit 69): object
    storage down past the retry window, the run directory locked by another live process. Not a refusal,
    since the same command succeeds once it is back, and not a crash."""


class VerbExit(SystemExit):
    """An `lm` verb ends with `code` (`verb_exit_code`) once its one-line message is printed; `str()` is the
    message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class JobFailed(Exception):
    """A job of a sweep that failed for a reason a rerun would meet again (a refusal, a divergence).

    `train.py` raises it instead of exiting in a multirun, so Hydra records the job as failed and runs the next
    one; `lm.run.sweep.SweepSummary` turns it into a `failed` row and ends the sweep with `exit_code`.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code(error: BaseException) -> int | None:
    """The code a run that raised `error` leaves with when no restart can help (or, for 69, when a restart must
    wait), or None for a crash (exit 1, which `lm supervise` retries) or a rollback (75, raised as it is).

    A full disk or a read-only filesystem anywhere in the chain of causes is 74 whatever wraps it: Hydra turns
    an error in its own config writer into `SystemExit(1)`, and a restart would only fail again."""
    if isinstance(error, CheckpointSaveError | RunDirRemoved) or unwritable(error) is not None:
        return EXIT_SAVE_FAILED
    if isinstance(error, Unavailable):
        return EXIT_UNAVAILABLE
    if isinstance(error, Refused):  # a refusal that names its fix (config, data, disk)
        return EXIT_UNAVAILABLE if outage(error) is not None else EXIT_CONFIG  # an outage is no refusal
    if isinstance(error, Diverged) and error.code == EXIT_DIVERGED:
        return EXIT_DIVERGED
    return None


def verb_exit_code(error: BaseException) -> int | None:
    """The code an `lm` verb (`lm prepare`, `lm eval`, ...) leaves with after `error`, or None for a crash.

    As `exit_code`, and: a `FileNotFoundError` is an input the command was given that does not exist (a run
    directory, a spec, a checkpoint, prepared data) and an `ImportError` an optional extra not installed
    (lm's own say which: `pip install 'lm[export]'`); the same command meets the same absence again, so both
    are refusals (78). A missing file that is an outage (the Hub or the network unreachable:
    huggingface_hub's `LocalEntryNotFoundError` is a FileNotFoundError) is 69, the command works once it is
    back. A training run (`train.py`) raises its own `Refused`; there any other error stays a crash."""
    code = exit_code(error)
    if code is None and isinstance(error, FileNotFoundError | ImportError):
        return EXIT_UNAVAILABLE if outage(error) is not None else EXIT_CONFIG
    return code


NETWORK_ERRORS = frozenset(
    {
        "ConnectionError",  # Python's own, and requests' (an OSError that is not the builtin)
        "Timeout",  # requests'
        "NetworkError",  # httpx's (huggingface_hub's transport): ConnectError, ReadError, ...
        "TimeoutException",  # httpx's
        "HTTPClientError",  # botocore's: EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ...
        "ClientConnectionError",  # aiohttp's: ClientConnectorError, ServerDisconnectedError
        "ClientPayloadError",  # aiohttp's
        "LocalEntryNotFoundError",  # huggingface_hub's: not cached, and the Hub could not be asked
    }
)
"""Names of the bases of the errors that mean the network or a service could not be reached. Matched by
name, not imported, because the packages that raise them are optional."""


def outage(error: BaseException | None) -> BaseException | None:
    """The network or service outage in `error`'s chain (itself, what it was raised from or while handling),
    or None. An outage is never a refusal: the same command succeeds once the service is back."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TimeoutError) or any(k.__name__ in NETWORK_ERRORS for k in type(error).__mro__):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def unwritable(error: BaseException | None) -> OSError | None:
    """The full disk, quota or read-only filesystem error in `error`'s chain (itself, what it was raised from or
    while handling), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in UNWRITABLE:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


WORKER_ERROR = re.compile(r"Caught (\w+) (in DataLoader worker process \d+)\.\nOriginal Traceback")


def one_line(error: BaseException) -> str:
    """`error`'s message on one line, for a refusal's summary.

    torch re-raises an error of a DataLoader worker as "Caught ValueError in DataLoader worker process 0.",
    then the worker's whole traceback: the worker's own message (the shard, the id, the fix) is its end."""
    text = str(error)
    if m := WORKER_ERROR.match(text):
        kind, where = m.groups()
        # The traceback's last line names the exception, qualified when it is not a builtin (lm's Refused).
        last = list(re.finditer(rf"^(?:[\w.]+\.)?{kind}: ", text, re.M))
        own = text[last[-1].end() :] if last else text
        text = f"{own.strip()} ({where})"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def readable(error: BaseException) -> str:
    """What a refusal prints: a `Refused` table with its lines, anything else on one line."""
    return str(error) if getattr(error, "table", False) else one_line(error)


def report_progress(what: str) -> None:
    """Tell a supervisor (`lm supervise`, through $LM_PROGRESS_FILE) that the run made progress: `what` was
    saved. Best effort: a supervisor's file that cannot be written must not fail the run."""
    path = os.environ.get(PROGRESS_FILE)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(what)
    except OSError as e:
        print(f"lm: could not report progress to the supervisor in {path}: {e}", file=sys.stderr)


def intended_code(error: BaseException | None) -> int:
    """The status a run that ended with `error` (None: returned) exits with: what `train.py` maps it to."""
    if error is None:
        return 0
    code = exit_code(error)
    if code is not None:
        return code
    if isinstance(error, SystemExit):  # sys.exit(None) is 0, sys.exit("message") is 1
        return 0 if error.code is None else error.code if isinstance(error.code, int) else 1
    return 1


_exit: dict = {"code": 0, "watch": None}


def exit_within(code: int, seconds: float = EXIT_GRACE_S) -> None:
    """Bound the exit of this process: once it starts exiting, it has `seconds` to finish, else the stacks of
    every thread go to stderr and it leaves with `code` (os._exit).

    The last resort behind a clean shutdown: a child that ignores SIGTERM (DataLoader workers do, on purpose)
    makes multiprocessing's exit handler wait for ever, and a hung process on a rented GPU bills until someone
    looks. The clock starts when the interpreter begins to exit, not now, so a process that goes on after a run
    (tests, a sweep's next job) is never cut short. The latest call's code wins.
    """
    _exit["code"] = code
    if _exit["watch"] is None:
        exiting = threading.Event()
        _exit["watch"] = threading.Thread(
            target=_watch, args=(exiting, seconds), name="lm-exit-bound", daemon=True
        )
        _exit["watch"].start()
        # Called as the interpreter starts to exit: before it joins non-daemon threads and before the atexit
        # handlers (multiprocessing's joins its children there), either of which can hang. `atexit` itself
        # runs too late for the first; CPython's concurrent.futures uses this hook for the same reason.
        threading._register_atexit(exiting.set)


def _watch(exiting: threading.Event, seconds: float) -> None:
    exiting.wait()
    time.sleep(seconds)
    code = _exit["code"]
    print(
        f"lm: the process did not exit within {seconds:g} s of the end of the run; leaving with {code}. "
        f"Still running (a child or a thread that ignores shutdown):",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(code)
