"""The fault-injection harness: a real `python train.py` process (tiny model, DataLoader workers), one fault at
a chosen step or phase, and the checks every fault case shares.

- `run(args)` starts the command in its own session with faulthandler on and a wall-clock bound. A process
  that outlives the bound is a hang: every process of its group gets SIGABRT (faulthandler prints the stacks of
  every thread, the DataLoader workers' included), then SIGKILL, and the case fails with those stacks.
- `Trigger`s act from outside the process while it runs (stop or start the S3 server, fill the disk, remove a
  folder): when a `pause` fault's marker appears (the run is held at that step), or some seconds after a line
  of its output.
- `assert_matches_reference` compares the final checkpoint with an uninterrupted run's, bit for bit;
  `checkpoints` / `assert_kept` say that no good checkpoint was deleted; `tree_digest` that a refusal wrote
  nothing.
- `Record` writes each case's outcome (exit code, seconds, resumed, bitwise equal) to `$FAULT_MATRIX_LOG`,
  which `tests/run_matrix.py` turns into the matrix table.

Faults come from `tests/faults.py`, added to a run as a `_target_` callback (`fault(...)`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lm.checkpoint.files import checkpoint_step, loadable

from .conftest import CONF, TINY
from .helpers import sha256

ROOT = CONF.parent
STEPS = 20
RUN = [
    f"trainer.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",  # the schedule spans the whole run even when an invocation stops early
    "optim.warmup_steps=5",
    "trainer.val_every_steps=8",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=5",
    "+trainer.extra.num_sanity_val_steps=0",
    "checkpoint.every_n_steps=6",  # interrupts land between checkpoints: work is lost and redone
    "checkpoint.keep_last=2",
]
TIMEOUT_S = 240
"""Wall-clock bound of one process: far above a 20-step tiny run on a loaded 2-core machine (~30 s)."""
GRACE_S = 5
"""After SIGABRT, how long faulthandler gets to write the stacks before SIGKILL."""


def overrides(root: Path, cache: Path, name: str, *extra: str) -> list[str]:
    """The command line of run `name` under `root`: tiny model, 20 steps, 2 DataLoader workers."""
    return [*TINY, f"run.root={root}", f"data.cache_dir={cache}", f"run.name={name}", *RUN, *extra]


def fault(markers: Path, action: str, step: int = 0, key: str = "fault", seconds: float = 0.0) -> list[str]:
    """Overrides adding `tests.faults.Fault(action, step)`; it fires once per marker file in `markers`."""
    node = f"+callbacks.{key}"
    return [
        f"{node}._target_=tests.faults.Fault",
        f"{node}.action='{action}'",  # quoted: Hydra would read nan as a float
        f"{node}.step={step}",
        f"{node}.seconds={seconds}",
        f"{node}.marker={marker(markers, action, step, key)}",
    ]


def marker(markers: Path, action: str, step: int = 0, key: str = "fault") -> Path:
    """The file a fault writes when it fires (its mtime is the moment of the fault)."""
    return markers / f"{key}-{action}-{step}.fired"


# -- running a process ----------------------------------------------------------------------------------


@dataclass
class Trigger:
    """`action()` runs once, from the test process, when `ready(output)` first holds while the run is alive
    (`output`: its stdout and stderr so far).

    With a `pause` fault the run waits at its step until `release` exists; the harness creates it after `action`.
    """

    ready: Callable[[str], bool]
    action: Callable[[], None]
    release: Path | None = None
    done: bool = False

    @classmethod
    def at_pause(cls, fired: Path, action: Callable[[], None]) -> Trigger:
        """When a `pause` fault fires (its marker appears): act, then let the run go on."""
        return cls(lambda output: fired.exists(), action, release=fired.with_name(fired.name + ".go"))

    @classmethod
    def after_output(cls, text: str, seconds: float, action: Callable[[], None]) -> Trigger:
        """`seconds` after `text` first appears in the run's output."""
        seen: list[float] = []

        def ready(output: str) -> bool:
            if not seen and text in output:
                seen.append(time.monotonic())
            return bool(seen) and time.monotonic() - seen[0] >= seconds

        return cls(ready, action)

    def poll(self, output: Callable[[], str]) -> None:
        if not self.done and self.ready(output()):
            self.done = True
            self.action()
            if self.release is not None:
                self.release.touch()  # an empty file: it can still be made on a disk the action filled


@dataclass
class Outcome:
    """How one process ended."""

    args: list[str]
    code: int
    """Exit status as a shell reports it (killed by signal N: -N, as subprocess does)."""
    seconds: float
    """From the start of the process to its exit."""
    stdout: str
    stderr: str
    exited_at: float = 0.0
    """time.time() at the exit, to measure from a fault's marker."""

    def since(self, fired: Path) -> float:
        """Seconds from the fault (its marker's mtime) to the exit."""
        return self.exited_at - fired.stat().st_mtime

    def tail(self, n: int = 4000) -> str:
        return f"exit {self.code} after {self.seconds:.1f} s\n--- stderr (tail) ---\n{self.stderr[-n:]}"


class Hang(AssertionError):
    """The process did not exit within its bound; the message holds every process's stacks."""


def command(args: list[str], supervised: bool = False, torchrun: int = 0) -> list[str]:
    """`python train.py *args`, or the same under `lm supervise` (tiny backoff, and room for every crash a
    case injects: more than 10 in a row without a checkpoint saved between give up)."""
    cmd = [sys.executable, "train.py", *args]
    if torchrun:  # torchrun's agent starts the ranks (`--standalone`: one machine), Lightning reads its env
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
        cmd = [sys.executable, *launcher, "train.py", *args]
    if not supervised:
        return cmd
    supervise = [sys.executable, "-m", "lm.cli", "supervise", "--backoff", "0.05", "--max-failures", "10"]
    return [*supervise, "--", *cmd]


def run(
    args: list[str],
    *,
    supervised: bool = False,
    timeout: float = TIMEOUT_S,
    env: dict[str, str] | None = None,
    triggers: tuple[Trigger, ...] = (),
    torchrun: int = 0,
) -> Outcome:
    """Run `python train.py *args` in its own session (as a service on a VM is) and wait at most `timeout`.

    Output goes to files, not pipes: a DataLoader worker that outlives the main process would hold a pipe
    open and hang the reader. Raises `Hang` with every process's stacks when the bound passes.
    """
    full_env = {**os.environ, **(env or {}), "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out, "w") as out_f, open(err, "w") as err_f:
            start = time.monotonic()
            proc = subprocess.Popen(
                command(args, supervised, torchrun),
                cwd=ROOT,
                env=full_env,
                stdout=out_f,
                stderr=err_f,
                start_new_session=True,
            )
        try:
            # Triggers watch both streams: the run's log records reach stdout (Hydra's handler) and its
            # refusals and crashes stderr.
            code = wait(proc, start + timeout, triggers, lambda: read(out) + read(err))
            exited_at = time.time()
            if code is None:
                abort_group(proc)
                raise Hang(
                    f"{' '.join(command(args, supervised, torchrun))}\ndid not exit within {timeout:.0f} s: a hang. "
                    f"Stacks of every process of its group (faulthandler, on SIGABRT):\n{read(err)[-20000:]}"
                )
            drain(proc.pid)  # the other ranks leave after rank 0 under Lightning's launcher: their last lines
        finally:
            kill_group(proc)
        return Outcome(args, code, time.monotonic() - start, read(out), read(err), exited_at)


def wait(
    proc: subprocess.Popen, deadline: float, triggers: tuple[Trigger, ...], output: Callable[[], str]
) -> int | None:
    """The exit code, or None at the deadline; runs the triggers while waiting."""
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        for trigger in triggers:
            trigger.poll(output)
        time.sleep(0.05)
    return None


def drain(pgid: int, seconds: float = 15.0) -> None:
    """Wait (at most `seconds`) for the rest of the group to end on its own once its leader has."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and [pid for pid in group_pids(pgid, live=True) if pid != pgid]:
        time.sleep(0.05)


def abort_group(proc: subprocess.Popen) -> None:
    """SIGABRT to every process of the group, one at a time so that their stacks do not interleave (the
    leader last: its exit may take the workers with it), then SIGKILL."""
    for pid in sorted(group_pids(proc.pid), key=lambda pid: pid == proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        time.sleep(0.5)  # faulthandler writes the stacks of every thread, then the process dies
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(GRACE_S)
    kill_group(proc)


def group_pids(pgid: int, live: bool = False) -> list[int]:
    """The processes of process group `pgid` (from /proc; just the leader where there is no /proc); `live`:
    not those that have ended and wait to be reaped."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (
                stat.read_text().rsplit(")", 1)[1].split()
            )  # after the command name, which may hold spaces
            if int(fields[2]) == pgid and not (live and fields[0] in ("Z", "X")):
                pids.append(int(stat.parent.name))
    return pids or [pgid]


def kill_group(proc: subprocess.Popen) -> None:
    """Nothing of a case outlives it (a straggling DataLoader worker would hold the CPU and the files)."""
    signal_group(proc, signal.SIGKILL)
    proc.wait()


def signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid


def read(path: Path) -> str:
    """What the process wrote to `path` so far, through a descriptor of our own (never moving the child's
    file offset, which a shared one would)."""
    return path.read_text(errors="replace")


# -- checks ---------------------------------------------------------------------------------------------


def last(root: Path, name: str) -> dict:
    """The run's newest checkpoint, whole: a file, or a sharded folder assembled (`lm.checkpoint.files.read`)."""
    from lm.checkpoint import files

    return files.read(root / name / "checkpoints" / "last.ckpt")


def assert_same(a, b, where: str = "") -> None:
    """Bitwise equality of nested checkpoint state (tensors, dicts, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_matches_reference(root: Path, name: str, reference: dict, steps: int = STEPS) -> dict:
    """The run ended at the last step (`steps`) with the uninterrupted run's weights, optimizer and schedule;
    returns its checkpoint."""
    ckpt = last(root, name)
    assert ckpt["global_step"] == reference["global_step"] == steps
    assert_same(ckpt["state_dict"], reference["state_dict"], "weights")
    assert_same(ckpt["optimizer_states"], reference["optimizer_states"], "optimizer")
    assert_same(ckpt["lr_schedulers"], reference["lr_schedulers"], "scheduler")
    return ckpt


def checkpoints(ckpt_dir: Path) -> dict[int, str]:
    """{step: sha256} of the step checkpoints in `ckpt_dir` that load: the good ones."""
    found = {}
    for path in ckpt_dir.glob("step-*.ckpt"):
        step = checkpoint_step(path)
        if step is not None and loadable(path) is None:
            found[step] = sha256(path)
    return found


def assert_kept(before: dict[int, str], ckpt_dir: Path, keep_last: int = 2) -> None:
    """No good checkpoint of `before` was deleted or changed, except by rotation (`keep_last` newer ones on
    disk); what last.ckpt points at loads."""
    now = checkpoints(ckpt_dir)
    for step, digest in before.items():
        if step in now:
            assert now[step] == digest, f"step-{step}.ckpt changed"
        else:
            newer = [s for s in now if s > step]
            assert len(newer) >= keep_last, f"step-{step}.ckpt deleted with only {sorted(now)} left"
    link = ckpt_dir / "last.ckpt"
    if link.is_symlink() or link.exists():
        assert link.exists() and loadable(link) is None, f"last.ckpt -> {os.readlink(link)} does not load"


def flip_bytes(path: Path) -> None:
    """A byte flipped on disk (bit rot, a bad copy): the same size, another sha256."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def tree_digest(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: file contents (sha256), symlink targets, directories."""
    digest = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            digest[rel] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            digest[rel] = "dir"
        else:
            digest[rel] = sha256(path)
    return digest


# -- the matrix's record ----------------------------------------------------------------------------------


@dataclass
class Record:
    """One case's row in the fault matrix, appended to `$FAULT_MATRIX_LOG` (JSON lines) when the test ends.

    Fields stay None until the test gets that far, so a failing case still shows how far it got.
    """

    case: str
    test: str = ""
    """The pytest node id, to join with the test's pass/fail (tests/run_matrix.py)."""
    expected: int | None = None
    """The documented exit code of the fault run."""
    code: int | None = None
    exit_s: float | None = None
    resumed: bool | None = None
    equal: bool | None = None
    saved: int | None = None
    """The step last.ckpt holds after the fault run (where the case records it)."""

    def outcome(self, outcome: Outcome, fired: Path | None = None, expected: int = 0) -> None:
        """The fault run's exit code and its seconds to exit (from the fault when it has a marker)."""
        self.code, self.expected = outcome.code, expected
        self.exit_s = outcome.since(fired) if fired is not None and fired.exists() else outcome.seconds

    def write(self) -> None:
        path = os.environ.get("FAULT_MATRIX_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(self.__dict__) + "\n")
