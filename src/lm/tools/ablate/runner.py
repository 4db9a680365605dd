"""Running an ablation's jobs: `python train.py` children, a few at a time, stoppable and resumable."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lm.base.exits import EXIT_DIVERGED, EXIT_PREEMPTED
from lm.store import rundir
from lm.tools.ablate.spec import Job, Spec, compose_objects

log = logging.getLogger(__name__)

STOP_GRACE_S = 120.0
"""How long runs get to save and exit after `lm ablate` itself is told to stop."""
MAX_RESTARTS = 3
"""Times a run that exits 75 on its own (a rollback after non-finite steps) is started again."""


def exit_file(out: Path, job: Job) -> Path:
    return out / "logs" / (job.key.replace("/", "__") + ".exit")


def exit_code(out: Path, job: Job) -> int | None:
    path = exit_file(out, job)
    return int(path.read_text().strip()) if path.is_file() else None


def diverged(out: Path, job: Job) -> bool:
    """The run ended with EXIT_DIVERGED (non-finite again after a rollback): a result, not a failure: at that
    LR the arm diverges."""
    return exit_code(out, job) == EXIT_DIVERGED


def result_file(out: Path, job: Job) -> Path:
    return out / "results" / (job.key.replace("/", "__") + ".json")


def run_config(job: Job) -> list[str]:
    """What decides a run's result: its overrides without where it is written (`run.root`, `run.name`)."""
    return [o for o in job.overrides if not o.startswith(("run.root=", "run.name="))]


DATA = "data.json"
"""`<out>/data.json`: the key of the prepared dataset the ablation's runs read (`prepare_data`)."""


def data_key(out: Path) -> str | None:
    """The prepared dataset's key for this ablation's runs (None: not prepared here, e.g. `--report-only`)."""
    return (rundir.read_record(out / DATA) or {}).get("key")


def recorded(out: Path, job: Job) -> dict | None:
    """The run's result record (`<out>/results/<key>.json`), written once it ended; None when there is none, or
    when it was recorded under another config (the spec changed: the run is trained again, and says why) or
    on another prepared dataset (the same overrides give another corpus, tokenizer or validation split when
    lm's data format changes: its losses are not comparable). A record made before records kept the data's key
    is reused as it is."""
    record = rundir.read_record(result_file(out, job))
    if record is None:
        return None
    if record.get("config") != run_config(job) or record.get("steps") != job.steps:
        log.warning("lm ablate: %s was recorded under another config; it runs again", result_file(out, job))
        return None
    theirs, ours = record.get("data_key"), data_key(out)
    if theirs is not None and ours is not None and theirs != ours:
        log.warning(
            "lm ablate: %s was validated on another prepared dataset (key %s, now %s); it runs again",
            result_file(out, job), theirs, ours,
        )  # fmt: skip
        return None
    return record


def machine() -> str:
    """The CPU model, core count and torch version a record was made on: runs of one seed on two hosts agree to
    float rounding only (other kernels), so a campaign continued elsewhere says where each result came from."""
    import platform
    from importlib.metadata import version

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    return f"{model}, {os.cpu_count()} cores, torch {version('torch')}"


def finished(job: Job, out: Path | None = None) -> bool:
    """The run reached its last step (its cost ledger says so), its early stopper ended it, it diverged, or its
    result is recorded (a campaign continued from another machine's records)."""
    if out is not None and recorded(out, job) is not None:
        return True
    ledger = rundir.read_ledger(job.run_dir) or {}
    stop = rundir.read_record(job.run_dir / rundir.STOP) or {}
    done = (ledger.get("step") or 0) >= job.steps or bool(stop.get("stopped"))
    return done or (out is not None and diverged(out, job))


class Runner:
    """Runs jobs `parallel` at a time, each a `python train.py` with `threads` CPU threads and a time limit.

    SIGTERM or SIGINT to `lm ablate` is passed to the running jobs (each saves its checkpoint and exits 75),
    then the ablation exits 75 too: rerunning the same command continues. A run that exits 75 on its own (a
    rollback after non-finite steps) is started again in the next round; one that exits 65 is recorded as
    diverged."""

    def __init__(self, out: Path, parallel: int, threads: int | None, timeout: float) -> None:
        self.out, self.parallel, self.threads, self.timeout = out, parallel, threads, timeout
        self.stopping: list[int] = []
        self.running: dict[str, tuple[subprocess.Popen, float, Job, io.TextIOBase]] = {}
        self.failed: dict[str, str] = {}

    def command(self, job: Job) -> list[str]:
        from lm.config.loading import conf_dir

        return [sys.executable, str(conf_dir().parent / "train.py"), *job.overrides]

    def log_path(self, job: Job) -> Path:
        return self.out / "logs" / (job.key.replace("/", "__") + ".log")

    def start(self, job: Job) -> None:
        env = dict(os.environ)
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path(job), "a")  # noqa: SIM115 (closed when the job ends)
        log.info("lm ablate: start %s", job.key)
        child = subprocess.Popen(self.command(job), env=env, stdout=log_file, stderr=subprocess.STDOUT)
        self.running[job.key] = (child, time.monotonic(), job, log_file)

    def reap(self) -> list[Job]:
        """Jobs that ended since the last call (a job past its time limit is stopped and counted failed)."""
        ended = []
        for key, (child, started, job, log_file) in list(self.running.items()):
            code = child.poll()
            if code is None and time.monotonic() - started > self.timeout and not self.stopping:
                stop_child(child)
                code, self.failed[key] = child.returncode, f"over the {self.timeout:.0f} s limit"
            if code is None:
                continue
            log_file.close()
            del self.running[key]
            exit_file(self.out, job).write_text(f"{code}\n")
            expected = code in (0, EXIT_DIVERGED, EXIT_PREEMPTED)
            if not expected and key not in self.failed and not self.stopping:
                self.failed[key] = f"exit {code}; see {self.log_path(job)}"
            ended.append(job)
        return ended

    def run(self, next_jobs, on_end) -> None:
        """Run until nothing is left: `next_jobs()` is asked for the jobs that can start whenever a slot is
        free (so a search's next stage starts as soon as the runs it depends on end), `on_end(job)` is told
        of each job that ended."""

        def forward(signum: int, frame) -> None:
            self.stopping.append(signum)
            for child, *_ in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        started: set[str] = set()
        restarts: dict[str, int] = {}
        try:
            queue = [j for j in next_jobs() if j.key not in started]
            while (queue and not self.stopping) or self.running:
                while queue and len(self.running) < self.parallel and not self.stopping:
                    job = queue.pop(0)
                    started.add(job.key)
                    self.start(job)
                ended = self.reap()
                for job in ended:
                    on_end(job)
                    rollback = exit_code(self.out, job) == EXIT_PREEMPTED and not self.stopping
                    if rollback and job.key not in self.failed:
                        restarts[job.key] = restarts.get(job.key, 0) + 1
                        if restarts[job.key] <= MAX_RESTARTS:
                            started.discard(job.key)  # a rollback after non-finite steps: start it again
                        else:
                            self.failed[job.key] = f"exited 75 {MAX_RESTARTS + 1} times (rollbacks)"
                if ended or not queue:
                    queue = [j for j in next_jobs() if j.key not in started and j.key not in self.running]
                time.sleep(0.2)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def stop_child(child: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM (the run saves and exits 75), then SIGKILL after `grace` seconds."""
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def prepare_data(spec: Spec, out: Path) -> None:
    """`lm prepare` of the base config: the tokenizer and shards every run reads (a no-op when present); its key
    goes to `<out>/data.json`, so a result recorded on other data is not reused (`recorded`)."""
    from lm.data import prepare
    from lm.data.manifest import load_manifest

    cfg = compose_objects(spec.base)
    if not cfg.data.mixture:
        folder = prepare(cfg.data)
        rundir.write_record(out / DATA, {"key": load_manifest(folder)["key"], "dir": str(folder)})


def step_times(arms: dict[str, list[str]], steps: int = 20, warmup: int = 3) -> dict[str, float]:
    """Each arm's seconds per training step: `row_times`' rows, weighted by the steps each runs."""
    rows = row_times(arms, steps, warmup)
    out = {}
    for arm in arms:
        own = [(median, n) for (name, _), (median, n) in rows.items() if name == arm]
        out[arm] = sum(median * n for median, n in own) / sum(n for _, n in own)
    return out


def row_times(
    arms: dict[str, list[str]], steps: int = 20, warmup: int = 3
) -> dict[tuple[str, int], tuple[float, int]]:
    """{(arm, window length): (median seconds, the steps the run trains at it)}: one training step (forward,
    backward, clip, optimizer) of every arm (name -> its full overrides), measured in ONE process with the arms' steps interleaved in rotating order, so a shared
    machine's load falls on all alike (the runs' own times, taken minutes apart, differ by 2x on a loaded
    2-core machine). The module the run builder builds (its kernels, compile), on the CPU or the first GPU, the
    arm's full batch of random tokens. An arm with a sequence-length warm-up (`data.seq_len_warmup_steps`)
    trains shorter windows for part of its run: each stage's window length is timed as its own row of the
    rotation, beside the steps the stage runs (`step_times` weights them: timing the full window alone
    overstated such an arm's step)."""
    import statistics

    import torch

    from lm.engine import optim as lm_optim
    from lm.engine.module import short_windows
    from lm.run import build

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modules, optimizers, batches, weights = {}, {}, {}, {}
    rows: list[tuple[str, int]] = []  # (arm, window length): one timed row each
    for arm, overrides in arms.items():
        cfg = compose_objects(overrides)
        modules[arm] = build.build_module(cfg, init_from=False, eot_id=0).to(device)  # what the run trains
        optimizers[arm] = lm_optim.build(modules[arm].model, cfg.optim, fused=False)
        shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
        batch = torch.randint(0, cfg.model.vocab_size, shape, device=device)
        for length, n_steps in stage_steps(
            modules[arm].window_stages, cfg.data.seq_len, cfg.trainer.max_steps
        ):
            rows.append((arm, length))
            batches[arm, length] = short_windows(batch, length)
            weights[arm, length] = n_steps
    times: dict[tuple[str, int], list[float]] = {row: [] for row in rows}
    for i in range(steps + warmup):
        for row in rows[i % len(rows) :] + rows[: i % len(rows)]:
            module, opt = modules[row[0]], optimizers[row[0]]
            started = time.perf_counter()
            loss = module.objective(batches[row])[0]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:  # first steps: the allocator, first touch of the optimizer's state
                times[row].append(time.perf_counter() - started)
    return {row: (statistics.median(times[row]), weights[row]) for row in rows}


def stage_steps(stages, seq_len: int, max_steps: int | None) -> list[tuple[int, int]]:
    """(window length, steps trained at it) of a run's sequence-length warm-up stages (`stages` as
    `lm.numbers.batch_ramp.seq_len_warmup` gives them, None when off: the full window for every step)."""
    if not stages or len(stages) == 1:
        return [(seq_len, 1)]
    ends = [first for first, _ in stages[1:]] + [max(max_steps or 0, stages[-1][0] + 1)]
    return [(length, end - first) for (first, length), end in zip(stages, ends) if end > first]


def cached_step_times(arms: dict[str, list[str]], out: Path, threads: int | None) -> dict[str, float]:
    """`step_times`, kept in `<out>/step_times.json`; measured again (all arms at once) when an arm is new."""
    path = out / "step_times.json"
    known = rundir.read_record(path) or {}
    if all(arm in known for arm in arms):
        return known
    if threads:
        import torch

        torch.set_num_threads(threads)
    measured = step_times(arms)
    rundir.write_record(path, measured)
    return measured
