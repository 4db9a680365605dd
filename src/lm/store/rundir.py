"""The run directory: where a run lives, and the one reader and writer of each file it holds.

    <run.root>/<run.name>[/<swept values>]/
        config.yaml      the composed config of the latest invocation     write_config / read_config
        cost.json        the cost meter's ledger                          write_ledger / read_ledger
        phases.csv       one row per phase                                write_phases / read_phases
        samples.jsonl    milestone samples, appended                      append_samples / read_samples
        stop.json        the early stopper's decision                     write_record / read_record
        forecast.json    the latest loss (and CORE) forecast              write_record / read_record
        job.json         a sweep job's status (multiruns only)            write_record / read_record
        run.json         the run's id, shared with its remote pointer     write_run_id / read_run_id
        remote.json      does the bucket hold the latest checkpoint?     write_record / read_record
        tokenizer.json   the run's tokenizer (+ tokenizer_info.json)      keep_tokenizer / read_tokenizer
        tb/              TensorBoard events                               read_scalars
        checkpoints/     step-<N>.ckpt, last.ckpt, rollbacks.json         (lm.checkpoint.local)

Callbacks write through this module and `lm report`, `lm sweep-summary` read through it, so a file's format
lives in one place. Every write goes through `lm.store.atomic`: a crash leaves the old file or the whole new one, and a
full disk is `DiskFull` (exit 74) with no temporary left behind.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lm.base.exits import Refused
from lm.store.atomic import append_atomic, write_atomic

log = logging.getLogger(__name__)

CONFIG = "config.yaml"
LEDGER = "cost.json"
PHASES = "phases.csv"
SAMPLES = "samples.jsonl"
STOP = "stop.json"
FORECAST = "forecast.json"
JOB = "job.json"
RUN = "run.json"
REMOTE = "remote.json"
"""Whether the bucket holds the run's latest checkpoint, checked at the end of a run with checkpoint.remote."""
TOKENIZER = "tokenizer.json"
TOKENIZER_INFO = "tokenizer_info.json"
"""Beside the run's tokenizer.json: its sha256, end-of-text token and id (what sampling stops at)."""
TB = "tb"
CHECKPOINTS = "checkpoints"
ROLLBACKS = "rollbacks.json"
"""In `checkpoints/`: how often each checkpoint was rolled back to after non-finite steps."""
EVALS = "evals.jsonl"
"""Benchmark scores at training milestones (`evals=`), one line per milestone."""
FAILURES = "failures.jsonl"
"""Optional work that failed (milestone samples or benchmarks, the report): step, what, rank, error; one line
each, the run went on without it."""
EVAL = "eval.json"
"""The last `lm eval` of the run or export folder."""
EVAL_MD = "eval.md"
"""eval.json's scores as a Markdown table."""

# -- where a run lives ------------------------------------------------------------------------------------


def in_multirun() -> bool:
    """Whether this process runs a job of a Hydra multirun (`-m`)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_directory(root: str | Path, name: str) -> Path:
    """`<root>/<name>/`; in a multirun, one sub-directory per job named by its swept values (so a rerun of the
    same sweep resumes each job, and adding a value to the sweep never hands a job another's run)."""
    run_dir = Path(root) / name
    if in_multirun():
        run_dir = run_dir / job_dirname(swept_overrides())
    return run_dir


def swept_overrides() -> list[str]:
    """This multirun job's overrides of the keys its sweep varies (from the command line, or the sweeper's
    `hydra.sweeper.params`, which experiments like sweep_lr and the Optuna sweeper use)."""
    hc = HydraConfig.get()
    params = OmegaConf.select(hc, "sweeper.params") or {}
    return job_overrides(
        list(hc.overrides.task),
        sys.argv[1:],
        set(hc.job.config.override_dirname.exclude_keys),
        {str(k) for k in params},
    )


def job_overrides(
    task_overrides: list[str],
    argv: list[str],
    excluded: set[str] = frozenset(),
    sweeper_keys: set[str] = frozenset(),
) -> list[str]:
    """The overrides that tell a job apart: its values of the keys the command line (or the sweeper's params)
    sweeps; all of its overrides when the sweep is not on this process's command line (a launcher that runs
    jobs elsewhere)."""

    def key(override: str) -> str:
        return override.split("=", 1)[0].lstrip("+~")

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
        swept = {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}
    except Exception:  # argv is another program's (a remote launcher): name by every override instead
        swept = set()
    swept |= set(sweeper_keys)
    chosen = [o for o in task_overrides if key(o) in swept] or task_overrides
    return sorted(o for o in chosen if key(o) not in excluded)


def job_dirname(
    task_overrides: list[str],
    argv: list[str] | None = None,
    excluded: set[str] = frozenset(),
    sweeper_keys: set[str] = frozenset(),
) -> str:
    """A job's directory name: its values of the keys the sweep varies (`optim.lr=0.0003`), see
    `job_overrides`; pass the chosen overrides alone (argv None) to name them as they are. A long name keeps
    a readable prefix and a hash of the whole."""
    chosen = task_overrides if argv is None else job_overrides(task_overrides, argv, excluded, sweeper_keys)
    name = ",".join(sorted(chosen)).replace("/", "_") or "default"
    if len(name) > 120:
        name = f"{name[:80]}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    return name


# -- config.yaml ------------------------------------------------------------------------------------------


def write_config(run_dir: Path, cfg: DictConfig) -> None:
    """The composed config, resolved."""
    write_atomic(run_dir / CONFIG, OmegaConf.to_yaml(cfg, resolve=True))


def read_config(run_dir: Path) -> DictConfig | None:
    path = run_dir / CONFIG
    return OmegaConf.load(path) if path.is_file() else None


BUCKETS = ("startup", "train", "eval", "checkpoint", "restart")
"""The ledger's buckets of wall-clock time. `restart`: a resumed process's start-up plus the work its
predecessor did after its last checkpoint (measured from the ledger), i.e. what preemptions and crashes cost."""

# -- JSON records: cost.json, stop.json, forecast.json, job.json, rollbacks.json --------------------------


def write_record(path: Path, record: Any) -> None:
    """A JSON record; inf and NaN (a loss that stopped falling) are written as null, which JSON can hold."""
    write_atomic(path, json.dumps(finite_only(record), indent=1))


def read_record(path: Path) -> Any | None:
    """A JSON record, or None when the file is missing or unreadable (a run that has not written it yet)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def finite_only(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_only(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_only(v) for v in value]
    return value


def write_run_id(run_dir: Path, run_id: str) -> None:
    """run.json: the id that ties this directory to its checkpoints on object storage (`lm.checkpoint.remote`)."""
    write_record(run_dir / RUN, {"run_id": run_id})


def read_run_id(run_dir: Path) -> str | None:
    """The run's id, or None for a directory that has none yet (fresh, or written before run ids)."""
    return (read_record(run_dir / RUN) or {}).get("run_id")


def write_ledger(run_dir: Path, record: dict[str, Any]) -> None:
    """cost.json: seconds per bucket, tokens, step, dollars, price, devices and what the run resolved."""
    write_record(run_dir / LEDGER, record)


def read_ledger(run_dir: Path) -> dict[str, Any] | None:
    return read_record(run_dir / LEDGER)


# -- tokenizer.json --------------------------------------------------------------------------------------


def keep_tokenizer(
    run_dir: Path, tokenizer_json: Path, eot_token: str, eot_id: int, *, resumed: bool
) -> None:
    """Copy the tokenizer the run trains with into the run directory; a resumed run must train with the one
    it kept (a fresh start in the directory, with no checkpoint to continue, replaces it), and a damaged copy
    of it is restored from `tokenizer_json` when that is the same tokenizer (`restore_tokenizer`).

    The copy makes a run directory self-contained: sampling, export and evaluation read it, never the data
    cache, which another machine or Python version would rebuild with another tokenizer."""
    data = tokenizer_json.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    kept = read_record(run_dir / TOKENIZER_INFO) if resumed else None
    if kept is not None:
        restore_tokenizer(run_dir, tokenizer_json)
    if kept is not None and kept["sha256"] != sha:
        raise Refused(
            f"{run_dir} trained with the tokenizer in {run_dir / TOKENIZER} (sha256 {kept['sha256']}), but "
            f"this config's data gives {tokenizer_json} (sha256 {sha}): its ids mean other strings. Resume "
            f"with the run's tokenizer (data.tokenizer={run_dir / TOKENIZER}) or start a new run "
            f"(run.resume=false or another run.name)"
        )
    if kept is None:
        write_atomic(run_dir / TOKENIZER, data)
        write_record(run_dir / TOKENIZER_INFO, {"sha256": sha, "eot_token": eot_token, "eot_id": eot_id})


def tokenizer_intact(run_dir: Path, info: dict[str, Any]) -> bool:
    """Whether the run's tokenizer.json is the one tokenizer_info.json records (its sha256): the one check that
    export, sampling and evaluation (`read_tokenizer`) and every resume (`restore_tokenizer`) make."""
    path = run_dir / TOKENIZER
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == info["sha256"]


def restore_tokenizer(run_dir: Path, prepared: Path | None, *, write: bool = True) -> Path | None:
    """Check the run's tokenizer.json against tokenizer_info.json at start; a damaged copy (bytes flipped on
    disk, an edit, a lost file) is rewritten from `prepared`, the prepared data's tokenizer.json, when that one
    has the recorded sha256.

    Returns the file it restored from (with `write=False`: would restore from); None when the copy is intact,
    when no tokenizer is recorded yet, or when the data is not prepared yet (`prepared` None: checked again
    once it is). Raises ValueError naming both files when `prepared` is not the recorded tokenizer either:
    then nothing says which strings the run's ids mean, and export would refuse the run days later.
    """
    info = read_record(run_dir / TOKENIZER_INFO)
    if info is None or tokenizer_intact(run_dir, info) or prepared is None:
        return None
    path, want = run_dir / TOKENIZER, info["sha256"]
    data = prepared.read_bytes() if prepared.is_file() else None
    if data is None or hashlib.sha256(data).hexdigest() != want:
        got = "is missing" if data is None else f"has sha256 {hashlib.sha256(data).hexdigest()}"
        raise Refused(
            f"{path} is not the tokenizer {run_dir / TOKENIZER_INFO} records (sha256 {want}), and the prepared "
            f"data's {prepared} cannot restore it: it {got}. Copy a tokenizer.json with sha256 {want} to {path} "
            f"(an `lm export` of this run holds one), or start a new run (run.resume=false or another run.name)"
        )
    if write:
        write_atomic(path, data)
        log.warning(
            "%s was not the tokenizer %s records (sha256 %s): repaired it from the prepared data's %s",
            path, TOKENIZER_INFO, want, prepared,
        )  # fmt: skip
    return prepared


def read_tokenizer(run_dir: Path) -> dict[str, Any]:
    """tokenizer_info.json (sha256, eot_token, eot_id), once `tokenizer.json` is checked against it."""
    info = read_record(run_dir / TOKENIZER_INFO)
    path = run_dir / TOKENIZER
    if info is None or not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} holds no {TOKENIZER} + {TOKENIZER_INFO} (runs keep their tokenizer since lm's export "
            f"verb); resume the run once (python train.py <its overrides>): it copies the tokenizer in at start"
        )
    if not tokenizer_intact(run_dir, info):
        raise Refused(
            f"{path} is not the tokenizer {TOKENIZER_INFO} records (sha256 differs): restore it (resuming the "
            f"run restores it from the prepared data when that holds the same tokenizer)"
        )
    return info


# -- phases.csv -------------------------------------------------------------------------------------------

PHASE_COLUMNS = (
    "phase", "name", "status", "start_step", "end_step", "steps", "tokens", "wall_hours", "start_loss",
    "end_loss", "loss_drop", "usd", "usd_per_loss_point", "tokens_per_sec", "goal_loss", "goal_met",
    "source_losses", "core_label", "core", "core_stderr", "core_gain",
    "usd_per_0.01_core",
)  # fmt: skip
INT_COLUMNS = ("phase", "start_step", "end_step", "steps", "tokens")


def write_phases(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=PHASE_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(run_dir / PHASES, table.getvalue())


def read_phases(run_dir: Path) -> list[dict[str, Any]]:
    """phases.csv back as typed rows (numbers as numbers, empty cells as None)."""
    path = run_dir / PHASES
    if not path.is_file():
        return []
    rows = []
    for raw in csv.DictReader(io.StringIO(path.read_text())):
        row: dict[str, Any] = {}
        for key, value in raw.items():
            if value == "":
                row[key] = None
            elif value in ("True", "False"):
                row[key] = value == "True"
            elif key in ("name", "status", "source_losses", "core_label"):
                row[key] = value
            else:
                number = float(value)
                row[key] = int(number) if number.is_integer() and key in INT_COLUMNS else number
        rows.append(row)
    return rows


# -- samples.jsonl ----------------------------------------------------------------------------------------


def append_samples(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Append one milestone's samples (append-only: a torn last line is skipped by the reader)."""
    append_atomic(run_dir / SAMPLES, "".join(json.dumps(r) + "\n" for r in records))


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """samples.jsonl as records; a resumed run may have appended a milestone twice: the last one wins."""
    latest = read_jsonl_latest(run_dir / SAMPLES, lambda r: (r["step"], r["prompt"], r["mode"]))
    return sorted(latest, key=lambda r: r["step"])


def read_jsonl_latest(path: Path, key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """The records of an append-only JSON-lines file, the last of each `key` kept; none if it is missing.
    A torn last line (a process killed mid-append) is skipped."""
    if not path.is_file():
        return []
    latest: dict[Any, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if r is not None:
            latest[key(r)] = r
    return list(latest.values())


# -- evals.jsonl, eval.json: benchmark scores -------------------------------------------------------------


def append_evals(run_dir: Path, record: dict[str, Any]) -> None:
    """Append one milestone's scores (append-only: a torn last line is skipped by the reader)."""
    append_atomic(run_dir / EVALS, json.dumps(finite_only(record)) + "\n")


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """evals.jsonl as records by step; a milestone evaluated twice (a crash before its checkpoint): the last wins."""
    return sorted(read_jsonl_latest(run_dir / EVALS, lambda r: r["step"]), key=lambda r: r["step"])


def append_failure(run_dir: Path, record: dict[str, Any]) -> None:
    """Append one failure of optional work (append-only: a torn last line is skipped by the reader)."""
    append_atomic(run_dir / FAILURES, json.dumps(record) + "\n")


def read_failures(run_dir: Path) -> list[dict[str, Any]]:
    """failures.jsonl as records, oldest first (none if the run had no failure)."""
    return read_jsonl_latest(run_dir / FAILURES, lambda r: (r["step"], r["what"], r["rank"], r["error"]))


def write_eval(folder: Path, record: dict[str, Any], markdown: str, prefix: str = "") -> Path:
    """`lm eval`'s result: `<prefix>eval.json` and the table `<prefix>eval.md` (each atomically); returns
    the first."""
    write_record(folder / f"{prefix}{EVAL}", record)
    write_atomic(folder / f"{prefix}{EVAL_MD}", markdown)
    return folder / f"{prefix}{EVAL}"


# -- TensorBoard ------------------------------------------------------------------------------------------


class Series:
    """One TensorBoard scalar: steps, values and wall-clock times (seconds since the epoch)."""

    def __init__(self, events: list) -> None:
        # A resumed run logs some steps twice (work redone after a restart): keep the latest write of each.
        latest = {e.step: e for e in sorted(events, key=lambda e: e.wall_time)}
        ordered = [latest[s] for s in sorted(latest)]
        self.steps = np.array([e.step for e in ordered], dtype=np.int64)
        self.values = np.array([e.value for e in ordered], dtype=np.float64)
        self.times = np.array([e.wall_time for e in ordered], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.steps)

    def at(self, steps: np.ndarray) -> np.ndarray:
        """Values interpolated at other steps (e.g. dollars at the steps validation ran)."""
        return np.interp(steps, self.steps, self.values)


def read_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar of a run's TensorBoard events, across all its event files."""
    tb_dir = run_dir / TB
    if not tb_dir.is_dir():
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow to import

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: Series(acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
