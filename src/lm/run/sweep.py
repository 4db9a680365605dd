"""What a sweep found: `sweep_summary.md` and `.csv`, one row per job, best validation loss first.

A multirun gives each job its own run directory under the sweep's folder `<run.root>/<run.name>/` (named by
its swept values, see `lm.store.rundir.job_dirname`). `SweepSummary`, a Hydra callback, writes `job.json` into each
job's directory when the job starts and when it ends (its overrides, status, objective, error) and rebuilds
the summary from disk after every job, so a sweep that dies half-way still leaves a summary of what ran. The
rows are read from what the runs left on disk (`job.json`, `cost.json`, `stop.json`, `config.yaml`, TensorBoard
events), never from one process's memory: the same code serves launchers that run jobs elsewhere and
`lm sweep-summary DIR`, which rebuilds the summary of an interrupted sweep.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lm.base.exits import JobFailed
from lm.store import rundir
from lm.store.atomic import write_atomic
from lm.store.rundir import JOB, read_record

log = logging.getLogger(__name__)

SUMMARY_MD = "sweep_summary.md"
SUMMARY_CSV = "sweep_summary.csv"


@dataclass
class JobRow:
    """One job of a sweep, as read back from its run directory."""

    job: str
    """The job's directory name: its swept values (`optim.lr=0.0003`)."""
    swept: dict[str, str]
    """The swept keys and this job's values."""
    status: str
    """`completed` (reached max_steps or stopped early), `failed`, or `incomplete` (interrupted or running)."""
    stop: str
    """Why it stopped: `max_steps`, the early stopper's reason, the error, or how far it got."""
    val_loss: float | None = None
    usd: float | None = None
    tokens: int | None = None
    step: int | None = None
    tokens_per_sec: float | None = None
    usd_per_billion_tokens: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The jobs' run directories: the sweep folder's children holding a job record or a run's config."""
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir} is not a directory; pass a sweep's folder, runs/<run.name>")
    return sorted(
        d
        for d in sweep_dir.iterdir()
        if d.is_dir() and ((d / JOB).is_file() or (d / rundir.CONFIG).is_file())
    )


def last_val_loss(run_dir: Path) -> float | None:
    """The last `val/loss` TensorBoard holds for a run (for jobs whose return value was not recorded)."""
    series = rundir.read_scalars(run_dir).get("val/loss")
    return float(series.values[-1]) if series is not None and len(series) else None


def finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def read_job(run_dir: Path) -> JobRow:
    """A job's row from its run directory."""
    record = read_record(run_dir / JOB) or {}
    ledger = rundir.read_ledger(run_dir) or {}
    stop = read_record(run_dir / rundir.STOP) or {}
    cfg = rundir.read_config(run_dir)
    max_steps = OmegaConf.select(cfg, "trainer.max_steps") if cfg is not None else None
    swept = dict(o.split("=", 1) for o in record.get("swept", []) if "=" in o)
    if not swept and "=" in run_dir.name:  # a job from before job records: its name is its swept values
        swept = dict(o.split("=", 1) for o in run_dir.name.split(",") if "=" in o)

    step = ledger.get("step")
    if record.get("status") == "failed":
        status, reason = "failed", f"failed: {record.get('error', 'unknown error')}"
    elif stop.get("stopped"):
        status = "completed"
        reason = f"early stop at step {stop.get('step')} ({stop.get('criterion')}): {stop.get('reason')}"
    elif step is not None and max_steps is not None and step >= max_steps:
        status, reason = "completed", f"max_steps ({max_steps})"
    else:
        status = "incomplete"
        where = f"step {step} of {max_steps}" if step is not None else "no cost ledger yet"
        reason = f"incomplete: {where} (interrupted, or still running)"

    val_loss = finite(record.get("objective"))
    if val_loss is None and status != "failed":
        val_loss = last_val_loss(run_dir)
    usd, tokens = finite(ledger.get("usd")), ledger.get("tokens")
    train_s = (ledger.get("seconds") or {}).get("train") or 0.0
    return JobRow(
        job=run_dir.name,
        swept=swept,
        status=status,
        stop=reason,
        val_loss=val_loss,
        usd=usd,
        tokens=tokens,
        step=step,
        tokens_per_sec=tokens / train_s if tokens and train_s > 0 else None,
        usd_per_billion_tokens=usd / tokens * 1e9 if usd is not None and tokens else None,
        extra={k: (ledger.get("run") or {}).get(k) for k in ("gpu", "pricing", "price_per_hour")},
    )


def rank(rows: list[JobRow]) -> list[JobRow]:
    """Completed jobs by validation loss, then incomplete ones by loss, then those without a loss."""
    order = {"completed": 0, "incomplete": 1, "failed": 2}
    return sorted(
        rows,
        key=lambda r: (r.val_loss is None, order[r.status], r.val_loss or 0.0, r.job),
    )


def best(rows: list[JobRow]) -> JobRow | None:
    """The completed job with the lowest validation loss."""
    done = [r for r in rows if r.status == "completed" and r.val_loss is not None]
    return min(done, key=lambda r: r.val_loss) if done else None


def fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def render_md(sweep_dir: Path, rows: list[JobRow]) -> str:
    """The summary as Markdown: a headline naming the best job, then the ranked table."""
    keys = sorted({k for r in rows for k in r.swept})
    top = best(rows)
    counts = {s: sum(r.status == s for r in rows) for s in ("completed", "failed", "incomplete")}
    lines = [
        f"# Sweep summary: {sweep_dir}",
        "",
        f"{len(rows)} jobs: {counts['completed']} completed, {counts['failed']} failed, "
        f"{counts['incomplete']} incomplete. Ranked by final validation loss (lower is better); "
        f"written {time.strftime('%Y-%m-%d %H:%M:%S')}.",
        "",
    ]
    if top is not None:
        setting = " ".join(f"{k}={v}" for k, v in sorted(top.swept.items())) or top.job
        lines += [
            f"**Best: `{setting}`**: validation loss {top.val_loss:.4f} after {top.tokens or 0:,} tokens "
            f"for ${top.usd or 0:.4g}. Train with it: add `{setting}` to the command.",
            "",
        ]
        spans = {r.tokens for r in rows if r.status == "completed"}
        if len(spans) > 1:
            lines += [
                "Completed jobs trained on different token counts (early stops): compare losses with care.",
                "",
            ]
    else:
        lines += ["No job has completed yet.", ""]
    head = ["rank", "", "job", *keys, "val loss", "$", "tokens", "tokens/s", "$/B tokens", "stop"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows, 1):
        cells = [
            str(i),
            "**best**" if r is top else "",
            f"`{r.job}`",
            *[r.swept.get(k, "") for k in keys],
            fmt(r.val_loss, ".4f"),
            fmt(r.usd, ".4g"),
            f"{r.tokens:,}" if r.tokens is not None else "",
            fmt(r.tokens_per_sec, ",.0f"),
            fmt(r.usd_per_billion_tokens, ".4g"),
            r.stop.replace("|", "/").replace("\n", " "),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "$ = wall-clock seconds x $/h x GPUs (start-up, evaluation, checkpoints and restarts included); "
        "tokens/s = tokens / seconds spent training. `lm sweep-summary DIR` rebuilds this file.",
        "",
    ]
    return "\n".join(lines)


def render_csv(rows: list[JobRow]) -> str:
    keys = sorted({k for r in rows for k in r.swept})
    top = best(rows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    cols = ["val_loss", "usd", "tokens", "step", "tokens_per_sec", "usd_per_billion_tokens"]
    writer.writerow(["rank", "best", "job", *keys, "status", *cols, "gpu", "pricing", "stop"])
    for i, r in enumerate(rows, 1):
        values = [getattr(r, c) for c in cols]
        writer.writerow(
            [i, int(r is top), r.job, *[r.swept.get(k, "") for k in keys], r.status]
            + ["" if v is None else v for v in values]
            + [r.extra.get("gpu") or "", r.extra.get("pricing") or "", r.stop]
        )
    return out.getvalue()


def write_summary(sweep_dir: str | Path) -> tuple[Path, list[JobRow]]:
    """(Re)build `sweep_summary.md` and `.csv` in `sweep_dir` from its jobs' run directories."""
    sweep_dir = Path(sweep_dir)
    dirs = job_dirs(sweep_dir)
    if not dirs:
        hint = (
            " (it is a single run's directory: pass the folder of a multirun)"
            if (sweep_dir / rundir.CONFIG).is_file()
            else ""
        )
        raise FileNotFoundError(f"{sweep_dir} holds no job directories of a sweep{hint}")
    rows = rank([read_job(d) for d in dirs])
    write_atomic(sweep_dir / SUMMARY_CSV, render_csv(rows))
    path = sweep_dir / SUMMARY_MD
    write_atomic(path, render_md(sweep_dir, rows))
    return path, rows


class SweepSummary(Callback):
    """Hydra callback: per-job records and the sweep summary (registered in conf/train.yaml).

    In a multirun, each job's end rewrites the summary (so a sweep that dies leaves one), and the end of the
    sweep writes the final one. A job that failed with `JobFailed` (a refusal or a divergence, which a rerun
    would meet again) is recorded as a failed row and handed back to the sweeper as a completed job with a
    NaN objective, so the other jobs still run (Optuna counts it a failed trial); the sweep then exits with
    that job's exit code, which `lm supervise` does not retry. Any other exception keeps Hydra's behaviour:
    the basic sweeper runs the rest of the batch, then raises it (exit 1: a crash, which a rerun resumes).
    """

    def __init__(self) -> None:
        self.folders: set[Path] = set()
        self.exit_code: int | None = None

    @staticmethod
    def job_dir(config: DictConfig) -> Path:
        return rundir.run_directory(config.run.root, config.run.name)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not rundir.in_multirun():
            return
        run_dir = self.job_dir(config)
        record = {
            "status": "running",
            "job_num": config.hydra.job.num,
            "overrides": list(config.hydra.overrides.task),
            "swept": rundir.swept_overrides(),
            "started": time.time(),
        }
        rundir.write_record(run_dir / JOB, record)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not rundir.in_multirun():
            return
        run_dir = self.job_dir(config)
        record = read_record(run_dir / JOB) or {}
        record["finished"] = time.time()
        if job_return.status == JobStatus.COMPLETED:
            value = job_return.return_value
            record.update(status="completed", objective=finite(value), error=None)
        else:
            error = raised(job_return)
            cause = error.__cause__ if isinstance(error, JobFailed) and error.__cause__ else error
            record.update(status="failed", objective=None, error=f"{type(cause).__name__}: {error}")
            if isinstance(error, JobFailed):
                record["exit_code"] = error.exit_code
                record["error"] += f" (exit {error.exit_code})"
                self.exit_code = self.exit_code or error.exit_code
                # Keep the sweep going: Optuna records NaN as a failed trial; the basic sweeper moves on.
                job_return.status, job_return.return_value = JobStatus.COMPLETED, math.nan
        rundir.write_record(run_dir / JOB, record)
        self.folders.add(run_dir.parent)
        self.summarize(run_dir.parent)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        folders = set(self.folders)
        sweep_dir = Path(config.run.root) / str(config.run.name)
        if sweep_dir.is_dir():
            folders.add(sweep_dir)
        for folder in sorted(folders):
            self.summarize(folder)
        if self.exit_code is not None:
            log.error("a job of the sweep failed (see the summary); exiting with %d", self.exit_code)
            sys.exit(self.exit_code)

    @staticmethod
    def summarize(folder: Path) -> None:
        try:
            path, rows = write_summary(folder)
        except (FileNotFoundError, OSError) as e:
            log.warning("no sweep summary for %s: %s", folder, e)
            return
        top = best(rows)
        log.info(
            "sweep summary: %s (%d jobs%s)",
            path,
            len(rows),
            f"; best {top.job}, val loss {top.val_loss:.4f}" if top else "",
        )


def raised(job_return: Any) -> BaseException:
    """The exception a failed job raised (Hydra's `return_value` re-raises it)."""
    try:
        _ = job_return.return_value
    except BaseException as e:
        return e
    raise AssertionError("a failed job's return_value did not raise")
