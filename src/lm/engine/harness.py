"""Benchmarks with EleutherAI's lm-evaluation-harness: `lm eval` and the milestone callback (`evals=`).

An lm model is converted in memory into a `transformers` Llama (`lm.engine.hf.to_hf_model`: numerically the same
model) and handed to lm-eval's `HFLM` wrapper with the run's own tokenizer, so the scores are those of the
model `lm export` writes, without writing it. Tasks come from lm-eval's registry or from a folder of task
YAMLs of one's own (`include_path`), so the whole path runs offline when the data is local.

transformers and lm-eval are the `eval` extra, imported only when an evaluation runs: a training run without
`evals=` never pays for them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lm.config import EvalsConfig
from lm.engine import hf
from lm.store import rundir
from lm.store.findings import Finding
from lm.store.tables import evals_markdown

EXTRA = "pip install -e '.[eval]'"


def missing_harness() -> str | None:
    """Why lm-eval cannot run here (a package of the `eval` extra is not installed), or None; imports
    nothing, so the doctor's preflight stays cheap."""
    missing = [name for name in ("lm_eval", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        return (
            f"evaluation needs lm-evaluation-harness and transformers ({', '.join(missing)} missing): {EXTRA}"
        )
    return None


def require_harness() -> None:
    """lm-eval and transformers are installed, or an ImportError naming the extra that brings them."""
    problem = missing_harness()
    if problem:
        raise ImportError(problem)


@functools.cache
def _task_manager(include_path: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager  # heavy: indexing the built-in tasks takes seconds

    return TaskManager(include_path=include_path, include_defaults=defaults)


def task_manager(tasks: list[str], include_path: str | Path | None = None):
    """lm-eval's TaskManager that knows `tasks`, or a ValueError naming the unknown ones and the fix.

    Tasks all found in `include_path` skip indexing lm-eval's thousands of built-in YAMLs (seconds).
    """
    if include_path is not None:
        include_path = str(Path(include_path).expanduser().resolve())
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"--include-path {include_path} is not a folder of task YAMLs")
        manager = _task_manager(include_path, False)
        if set(tasks) <= set(manager.all_tasks):
            return manager
    manager = _task_manager(include_path, True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else ""
        raise ValueError(
            f"unknown lm-eval task(s) {', '.join(unknown)}: not in lm-eval's registry{where}. "
            "`lm_eval ls tasks` lists the built-in ones; a task of your own needs its YAML in a folder "
            "passed as --include-path (evals.include_path)"
        )
    return manager


def score(
    model,
    tokenizer,
    tasks: list[str],
    *,
    limit: int | None = None,
    include_path: str | Path | None = None,
    batch_size: int = 16,
    log_samples: bool = False,
) -> dict[str, Any]:
    """Run `tasks` on a `transformers` causal LM; {"scores": task -> metric -> value, "samples": ...}.

    Metric names drop lm-eval's default filter suffix (`acc,none` -> `acc`; another filter stays as
    `exact_match/flexible`); stderr is `<metric>_stderr`. `samples` (per-example log-likelihoods) only with
    `log_samples`.
    """
    require_harness()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(tasks, include_path)
    was_training = model.training
    model.eval()
    try:
        out = lm_eval.simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size),
            tasks=list(tasks),
            limit=limit,
            task_manager=manager,
            log_samples=log_samples,
        )
    finally:
        model.train(was_training)
    scores = {task: metrics_of(values) for task, values in out["results"].items()}
    return {"scores": scores, "samples": out.get("samples") if log_samples else None}


@contextlib.contextmanager
def generators_kept(device: torch.device):
    """Python's, NumPy's and torch's random generators as they were before: building the HF copy draws
    its initial weights and lm-eval seeds all three globally, and a training run must continue as if no
    evaluation had happened (a resumed run would not have evaluated there)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def metrics_of(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's `{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}` as `{"acc": 0.5, "acc_stderr": 0.1}`."""
    out = {}
    for key, value in values.items():
        if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        metric, filter_name = key.split(",", 1)
        name = metric if filter_name == "none" else f"{metric}/{filter_name}"
        if math.isfinite(value):
            out[name] = float(value)
    return out


def load(path: str | Path, device: str) -> tuple[Any, Any, Path, dict[str, Any]]:
    """(model, tokenizer, folder for eval.json, what was loaded) for a run directory, a checkpoint in one,
    or a Hugging Face model folder (`lm export`'s output or any causal LM's)."""
    transformers = hf.require_transformers()
    path = Path(path)
    if (path / "config.json").is_file() and not (path / rundir.CHECKPOINTS).is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        return model.to(device), tokenizer, path, {"model": str(path)}
    run = hf.load_run(path)
    model = hf.to_hf_model(run.model, eos_id=run.eot_id).to(device)
    tokenizer = hf.hf_tokenizer(run.tokenizer_path, run.eot_token)
    return (
        model,
        tokenizer,
        run.run_dir,
        {"model": str(run.run_dir), "checkpoint": str(run.ckpt), "step": run.step},
    )


def evaluate_path(
    path: str | Path,
    tasks: list[str],
    *,
    limit: int | None = None,
    include_path: str | Path | None = None,
    batch_size: int = 16,
    device: str | None = None,
    with_samples: bool = False,
    into_folder: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """`lm eval`: score a run or an HF folder. Returns (the eval.json written, record).

    A run's eval.json and eval.md go into its directory. An HF folder's go beside it, as
    `<folder>.eval.json` and `<folder>.eval.md`, so that uploading the folder uploads the model and not a
    local evaluation of it; `into_folder` writes them into it instead. `with_samples` keeps each example's
    log-likelihoods in eval.json (what the per-example check reads).
    """
    require_harness()
    task_manager(tasks, include_path)  # an unknown task is refused before the model is loaded
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with generators_kept(torch.device(device)):
        model, tokenizer, folder, about = load(path, device)
        started = time.monotonic()
        out = score(
            model,
            tokenizer,
            tasks,
            limit=limit,
            include_path=include_path,
            batch_size=batch_size,
            log_samples=with_samples,
        )
    record = {
        **about,
        "tasks": list(tasks),
        "limit": limit,
        "device": device,
        "seconds": time.monotonic() - started,  # the scoring, without loading
        "scores": out["scores"],
    }
    if with_samples:
        record["samples"] = {task: [example(s) for s in rows] for task, rows in out["samples"].items()}
    markdown = evals_markdown(out["scores"]) + "\n"
    if "checkpoint" in about or into_folder:  # a run directory (or asked for)
        return rundir.write_eval(folder, record, markdown), record
    folder = folder.resolve()  # `lm eval .` names its folder
    return rundir.write_eval(folder.parent, record, markdown, prefix=f"{folder.name}."), record


def example(sample: dict[str, Any]) -> dict[str, Any]:
    """One logged example, kept small: its requests ((context, continuation) for a loglikelihood task) and
    each one's response: the log-likelihood, or a generation task's text."""
    return {
        "doc_id": sample["doc_id"],
        "target": sample["target"],
        "requests": [list(map(str, args)) for args in sample["arguments"]],
        "responses": [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sample["resps"]],
    }


def evals_findings(evals: EvalsConfig) -> list[Finding]:
    """Benchmarks at milestones (`evals=`) need lm-eval installed: refused now, not at the first phase
    boundary hours in. (Task names are checked by the callback at setup, before the first step: knowing
    lm-eval's registry means indexing thousands of YAMLs.)"""
    if not evals.tasks:
        return []
    problem = missing_harness()
    if problem is None and evals.include_path and not Path(evals.include_path).expanduser().is_dir():
        problem = f"evals.include_path={evals.include_path} is not a folder of task YAMLs"
    if problem:
        return [Finding("evals", "error", problem, fix="evals=off, or the fix above")]
    return [Finding("evals", "ok", f"benchmarks at milestones: {', '.join(evals.tasks)}")]
