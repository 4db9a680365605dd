"""The training process on its machine: it always exits (and at once), one process per run directory, and a full
disk anywhere in the run directory is exit 74 with nothing half-written. Real subprocesses with DataLoader
workers, real locks, a real (tmpfs) full disk; faults come from `tests/faults_process.py`."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lm.base.exits import EXIT_SAVE_FAILED, EXIT_UNAVAILABLE, DiskFull
from lm.checkpoint.checkpointer import archive_run
from lm.store.atomic import append_atomic, write_atomic
from lm.store.lock import RunLock, RunLocked

from ..conftest import CONF, TINY
from ..faults import fill
from ..harness import command

ROOT = CONF.parent
RUN = [
    "trainer.max_steps=8",
    "optim.total_steps=8",
    "optim.warmup_steps=2",
    "trainer.val_every_steps=4",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=2",
    "checkpoint.every_n_steps=2",
]


def overrides(root: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return [*TINY, f"run.root={root}", f"data.cache_dir={cache}", f"run.name={name}", *RUN, *extra]


def fault(marker_dir: Path, action: str, step: int, path: Path | None = None) -> list[str]:
    node = "+callbacks.pfault"
    return [
        f"{node}._target_=tests.faults_process.ProcessFault",
        f"{node}.action={action}",
        f"{node}.step={step}",
        f"{node}.marker={marker_dir / f'{action}-{step}.fired'}",
        *([f"{node}.path={path}"] if path is not None else []),
    ]


def start(cmd: list[str]) -> subprocess.Popen:
    """A command in its own session (its process group holds the DataLoader workers too)."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr); a process still running after `timeout` s is killed with its whole group
    (workers included) and the test fails: a hung trainer is the failure."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout:.0f} s (hung on the way out?):\n{(out + err)[-3000:]}")
    return proc.returncode, out + err


def processes_with(text: str) -> list[int]:
    """Live processes whose command line mentions `text` (a test's own run directory)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def gone(pid: int, within: float) -> bool:
    """Whether process `pid` ends (or is a zombie: dead, waiting to be reaped) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def temporaries(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if ".tmp-" in p.name]


def last_step(run_dir: Path) -> int:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return ckpt["global_step"]


# -- 15a: the process exits, at once, however it ends ----------------------------------------------------------


def test_an_error_on_the_way_out_still_exits_at_once_and_stops_the_workers(tmp_path, data_cache):
    # An error raised while Lightning handles another skips its teardown: the DataLoader workers (2 training,
    # 2 validation), which ignore SIGTERM, used to keep multiprocessing's exit handler waiting for ever.
    root = tmp_path / "runs"
    args = overrides(root, data_cache, "twice", *fault(tmp_path, "raise_twice", step=3))
    proc = start(command(args))
    code, out = finish(proc, timeout=180)
    assert code == 1, out[-3000:]  # a crash: `lm supervise` restarts it
    assert "a second fault" in out
    assert "did not exit within" not in out  # stopped cleanly, not by the last-resort bound
    time.sleep(1)
    assert processes_with(str(root)) == []  # no worker left behind


@pytest.mark.parametrize("stuck", ["child", "thread"])
def test_a_process_stuck_on_the_way_out_is_ended_with_its_code_and_its_stacks(tmp_path, stuck):
    # The last resort: a daemon child that ignores SIGTERM (multiprocessing joins it at exit for ever) or a
    # non-daemon thread that never ends; the worker init also makes the child die with its parent.
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import multiprocessing, os, threading, time
        from lm.data.datamodule import ignore_stop_signals
        from lm.base.exits import exit_within

        def child():
            ignore_stop_signals(0)
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(600)

        if __name__ == "__main__":
            exit_within(74, seconds=1.0)
            if {stuck!r} == "child":
                multiprocessing.Process(target=child, daemon=True).start()
                while not os.path.exists({str(pid_file)!r}):
                    time.sleep(0.05)
            else:
                threading.Thread(target=time.sleep, args=(600,)).start()
    """)
    started = time.monotonic()
    code, out = finish(start([sys.executable, "-c", script]), timeout=60)
    assert code == EXIT_SAVE_FAILED, out
    assert time.monotonic() - started < 30
    assert "did not exit within 1 s" in out and "Thread 0x" in out  # every thread's stack
    if stuck == "child":
        assert gone(int(pid_file.read_text()), within=10)  # killed with its parent


# -- 15b, 19.8: one trainer per run directory ------------------------------------------------------------------


@pytest.mark.slow  # 26-74 s on 2 cores: the README command stays under 10 min
def test_a_second_trainer_on_a_live_run_is_refused_and_archives_nothing(tmp_path, data_cache):
    root, release = tmp_path / "runs", tmp_path / "release"
    run_dir = root / "live"
    live = start(command(overrides(root, data_cache, "live", *fault(tmp_path, "hold", step=3, path=release))))
    deadline = time.monotonic() + 180
    while not (tmp_path / "hold-3.fired").exists():
        assert live.poll() is None and time.monotonic() < deadline, finish(live, 1)[1][-3000:]
        time.sleep(0.2)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if "hydra" not in p.parts)
    # A second launch by mistake, and one that starts the run over (which used to archive the live files).
    second = [
        start(command(overrides(root, data_cache, "live", *extra))) for extra in ([], ["run.resume=false"])
    ]
    for proc in second:
        code, out = finish(proc, timeout=180)
        assert code == EXIT_UNAVAILABLE, out[-3000:]
        assert f"pid {live.pid} on host {socket.gethostname()}" in out
    assert not (run_dir / "archive").exists()
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if "hydra" not in p.parts) == before
    release.touch()
    code, out = finish(live, timeout=180)
    assert code == 0, out[-3000:]
    assert last_step(run_dir) == 8


def test_the_lock_dies_with_its_holder(tmp_path):
    holder = start([sys.executable, "-c", f"from pathlib import Path; from lm.store.lock import RunLock; RunLock(Path({str(tmp_path)!r})).acquire(); "
                    "print('held', flush=True); import time; time.sleep(600)"])  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunLocked, match=f"pid {holder.pid} on host {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
    holder.wait()
    lock = RunLock(tmp_path).acquire()
    assert f'"pid": {os.getpid()}' in (tmp_path / ".lock").read_text()
    lock.release()


def test_starting_over_archives_the_run_but_keeps_it_locked(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "cost.json").write_text("{}")
    lock = RunLock(run_dir).acquire()
    assert archive_run(run_dir) is None
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "archive"]
    with pytest.raises(RunLocked):
        RunLock(run_dir).acquire()
    lock.release()


# -- 19.6: a full disk anywhere in the run directory is exit 74, with nothing half-written ----------------------


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A real 16 MiB filesystem (tmpfs) that a test can fill."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_writes_on_a_full_disk_raise_disk_full_and_keep_the_old_file(small_disk):
    from ..faults_process import BALLAST

    record, samples = small_disk / "cost.json", small_disk / "samples.jsonl"
    write_atomic(record, "old")
    append_atomic(samples, "line 1\n")
    fill(small_disk / BALLAST)
    with pytest.raises(DiskFull, match=r"cost.json failed: the disk is full .* free space"):
        write_atomic(record, "new" * 10_000)
    with pytest.raises(DiskFull, match="samples.jsonl"):
        append_atomic(samples, "line 2\n" * 10_000)
    assert record.read_text() == "old" and samples.read_text() == "line 1\n"
    assert temporaries(small_disk) == []


def test_writes_on_a_read_only_filesystem_raise_one_error_naming_the_file_and_the_fix(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    record, samples = folder / "cost.json", folder / "samples.jsonl"
    write_atomic(record, "old")
    append_atomic(samples, "line 1\n")
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here (needs root): {mounted.stderr.decode().strip()}")
    try:
        # The temporary's removal meets EROFS too: it must not replace the error that names the file.
        with pytest.raises(
            DiskFull, match=rf"{record} failed: {folder} is on a read-only filesystem.*remount"
        ):
            write_atomic(record, "new")
        with pytest.raises(DiskFull, match=rf"{samples} failed: .* read-only filesystem"):
            append_atomic(samples, "line 2\n")
    finally:
        subprocess.run(["umount", str(folder)], check=False)
    assert record.read_text() == "old" and samples.read_text() == "line 1\n"


@pytest.mark.slow
def test_a_full_disk_mid_run_stops_the_supervisor_at_once_and_a_rerun_resumes(
    small_disk, data_cache, tmp_path
):
    run_dir = small_disk / "full"
    # The disk fills after step 3; step 4's ledger write meets it (checkpoints at steps 2, 4, ...).
    args = overrides(small_disk, data_cache, "full", *fault(tmp_path, "fill_disk", step=3, path=small_disk))
    started = time.monotonic()
    code, out = finish(start(command(args, supervised=True)), timeout=240)
    assert code == EXIT_SAVE_FAILED, out[-3000:]
    assert "not restarting" in out and "restart 1" not in out  # one attempt: a rerun would only fail again
    assert f"writing {run_dir / 'cost.json'} failed: the disk is full" in out
    assert time.monotonic() - started < 180
    assert temporaries(run_dir) == []
    (small_disk / "ballast.bin").unlink()  # space is freed; a stale temporary of a dead process is cleared
    stale = run_dir / "tb" / ".events.tmp-999999999"
    stale.write_bytes(b"\0" * 100)
    code, out = finish(start(command(args)), timeout=240)
    assert code == 0, out[-3000:]
    assert "resuming from" in out and last_step(run_dir) == 8
    assert not stale.exists()
