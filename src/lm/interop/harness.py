"""EleutherAI's lm-evaluation-harness, as lm.evals drives it for every task lm does not score itself.

An lm model is converted in memory into a `transformers` Llama (`lm.interop.hf.to_hf_model`: numerically the same
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import EvalsConfig

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
        raise Refused(
            f"unknown lm-eval task(s) {', '.join(unknown)}: not in lm-eval's registry{where}. "
            "`lm_eval ls tasks` lists the built-in ones; a task of your own needs its YAML in a folder "
            "passed as --include-path (evals.include_path)"
        )
    return manager


HUB_TIMEOUT_S = 5.0
"""How long the reachability check waits for the Hugging Face Hub to answer one request."""


@contextlib.contextmanager
def hub_offline():
    """The Hugging Face Hub switched off for a moment, as `HF_HUB_OFFLINE=1` does: datasets then load from
    the local cache or fail at once, where online they would retry an unreachable Hub for ~25 s. The flag is
    read from the modules at each request (the environment variable only at import)."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (offline mode, no network), or None."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_TIMEOUT_S)
    except Exception as e:  # any failure to get an answer: DNS, refused, timeout, proxy
        return f"{constants.ENDPOINT} does not answer: {one_line(e)}"
    return None


def unreachable_tasks(tasks: list[str], include_path: str | Path | None = None) -> dict[str, str]:
    """Each task whose data cannot be had here -> why: neither local (task files, the Hugging Face datasets
    cache) nor downloadable (the Hub unreachable). Loads each task from local data only, so a task already
    cached costs no request and the Hub is asked once, only when one is not."""
    manager = task_manager(tasks, include_path)
    problems: dict[str, str] = {}
    hub: list[str | None] = []  # the Hub's answer, asked at most once
    for task in tasks:
        try:  # building a task draws from the global generators (lm-eval's own seeding): kept as they were
            with hub_offline(), generators_kept(torch.device("cpu")):
                manager.load([task])
        except ConnectionError as e:  # not in the local cache: only a reachable Hub can supply it
            if not hub:
                hub.append(hub_unreachable())
            if hub[0] is not None:
                problems[task] = (
                    f"not in the local cache ({one_line(e)}) and the Hub cannot be reached ({hub[0]})"
                )
        except Exception as e:  # a local file missing, a task's own loader failing
            problems[task] = one_line(e)
    return problems


def refuse_unreachable(tasks: list[str], include_path: str | Path | None = None) -> None:
    """A ValueError in one line naming each task whose data cannot be had here (`unreachable_tasks`)."""
    problems = unreachable_tasks(tasks, include_path)
    if problems:
        raise Refused(
            f"the data of lm-eval task(s) {', '.join(problems)} cannot be had here: "
            + "; ".join(f"{task}: {why}" for task, why in problems.items())
            + ". Run once where the Hub is reachable (datasets are cached in ~/.cache/huggingface), point "
            "HF_HOME at a copied cache, or drop the task(s)"
        )


def one_line(error: BaseException) -> str:
    """`Type: message` on one line (an exception's text may span several)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


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
    """Run `tasks` on a `transformers` causal LM: {"scores": task -> metric -> value, "errors": task -> why
    it failed, "samples": ...}. Each task runs on its own, so one that fails (its data out of reach) costs
    only its own scores.

    Metric names drop lm-eval's default filter suffix (`acc,none` -> `acc`; another filter stays as
    `exact_match/flexible`); stderr is `<metric>_stderr`. `samples` (per-example log-likelihoods) only with
    `log_samples`.
    """
    require_harness()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(tasks, include_path)
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    scores, errors, samples = {}, {}, {}
    was_training = model.training
    model.eval()
    try:
        for task in tasks:
            try:
                out = lm_eval.simple_evaluate(
                    model=wrapped, tasks=[task], limit=limit, task_manager=manager, log_samples=log_samples
                )
            except Exception as e:  # this task's alone: the others are still scored
                errors[task] = one_line(e)
                continue
            scores |= {name: metrics_of(values) for name, values in out["results"].items()}
            samples |= out.get("samples") or {}
    finally:
        model.train(was_training)
    return {"scores": scores, "errors": errors, "samples": samples if log_samples else None}


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


def example(sample: dict[str, Any]) -> dict[str, Any]:
    """One logged example, kept small: its requests ((context, continuation) for a loglikelihood task) and
    each one's response: the log-likelihood, or a generation task's text."""
    return {
        "doc_id": sample["doc_id"],
        "target": sample["target"],
        "requests": [list(map(str, args)) for args in sample["arguments"]],
        "responses": [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sample["resps"]],
    }


def harness_findings(evals: EvalsConfig, tasks: list[str]) -> list[Finding]:
    """lm-evaluation-harness installed, its tasks known and their data within reach."""
    problem = missing_harness()
    if problem is None and evals.include_path and not Path(evals.include_path).expanduser().is_dir():
        problem = f"evals.include_path={evals.include_path} is not a folder of task YAMLs"
    if problem:
        return [Finding("evals", "error", problem, fix="evals=off, or the fix above")]
    try:
        unreachable = unreachable_tasks(tasks, evals.include_path)
    except Refused as e:  # an unknown task
        return [Finding("evals", "error", str(e), fix="evals.tasks=[...] without it")]
    if unreachable:
        return [
            Finding(
                "evals",
                "error",
                f"task {task}'s data cannot be had here: {why}",
                fix="evals.tasks=[...] without it",
            )
            for task, why in unreachable.items()
        ]
    return [Finding("evals", "ok", f"benchmarks at milestones: {', '.join(tasks)}")]
