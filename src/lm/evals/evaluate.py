"""The one entry for benchmarks: `evaluate` scores a `Subject` (a model and what each kind of task needs of
it) on an `EvalsConfig`, and both `lm eval` (`evaluate_path`) and the milestone callback call it.

CORE and the @olmo sets are scored by lm itself (lm.evals.own), on every rank's share of the items; every
other task name is an lm-evaluation-harness task (lm.interop.harness), run where `harness_here` (rank 0 at a
milestone) on a transformers copy made only then. A Subject is an lm run (its own model, tokenizer and
end-of-text) or any transformers causal LM folder (Llama, Qwen, GPT-2 ...), so both are on one yardstick.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from lm.base.exits import Refused
from lm.base.scores import core_markdown, is_core
from lm.base.tables import evals_markdown
from lm.config import EvalsConfig
from lm.evals import own
from lm.evals.progress import Progress
from lm.evals.scorer import Backbone, HFBackbone, Scorer
from lm.interop import harness, hf
from lm.model import Transformer
from lm.store import rundir


@dataclass
class Subject:
    """A model to benchmark: the scorer's view of it, and its transformers form for lm-eval, made on demand."""

    backbone: Backbone
    tokenizer: Tokenizer
    """A `tokenizers.Tokenizer`: what lm's scorer encodes with."""
    prefix_id: int
    """The token every prompt starts with: lm's end of text, a transformers model's bos (else eos)."""
    transformers: Callable[[], tuple[Any, Any]]
    """() -> (a transformers causal LM, its tokenizer) for lm-eval."""
    about: dict[str, Any] = field(default_factory=dict)
    """What eval.json says was scored (the run, checkpoint and step, or the folder)."""


def of_lm(
    model: Transformer,
    tokenizer_path: Path,
    eot_token: str,
    eot_id: int,
    about: dict | None = None,
    hf_dtype: torch.dtype = torch.float32,
) -> Subject:
    """An lm model with its run's tokenizer; lm-eval gets the same model converted in memory (in `hf_dtype`)."""

    def transformers() -> tuple[Any, Any]:
        device = next(model.parameters()).device
        copy = hf.to_hf_model(model, eos_id=eot_id, dtype=hf_dtype).to(device)
        return copy, hf.hf_tokenizer(tokenizer_path, eot_token)

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    return Subject(Backbone(model), tokenizer, eot_id, transformers, about or {})


def of_folder(path: Path, device: str) -> Subject:
    """A transformers causal LM folder (an `lm export`, or any Llama, Qwen, GPT-2 ...), in fp32, offline."""
    transformers = hf.require_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = model.to(device).eval()
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    fast = getattr(tokenizer, "backend_tokenizer", None)
    if prefix is None or fast is None:
        raise Refused(
            f"{path}: lm's scorer needs a fast tokenizer (tokenizer.json) with a bos or eos token to start each "
            "prompt with; score lm-eval tasks on it instead"
        )
    return Subject(HFBackbone(model), fast, prefix, lambda: (model, tokenizer), {"model": str(path)})


@dataclass
class Result:
    """One evaluation: scores (task -> metric -> value), the CORE record, tasks that failed and why."""

    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    core: dict | None = None
    errors: dict[str, str] = field(default_factory=dict)
    samples: dict[str, list] = field(default_factory=dict)
    seconds: float = 0.0

    def markdown(self) -> str:
        """CORE's table, the other tasks' table and what failed: eval.md, TensorBoard's text."""
        text = (core_markdown(self.core) + "\n\n" if self.core else "") + evals_markdown(
            {t: m for t, m in self.scores.items() if not is_core(t)}
        )
        return text + "\n" + "".join(f"\n{task} failed: {why}\n" for task, why in self.errors.items())


def prepare(cfg: EvalsConfig, *, reach: bool = False) -> own.Plan | None:
    """Everything that can be refused, before a model is loaded: CORE's files, the @olmo data, lm-eval's task
    names (and with `reach`, each task's data within reach). The plan of lm's own tasks, or None."""
    mine, theirs = own.split(cfg.tasks)
    plan = own.resolve(mine, cfg.data_dir, partial=cfg.partial, fill_olmo=cfg.fill_olmo) if mine else None
    if theirs:
        harness.require_harness()
        if reach:
            harness.refuse_unreachable(theirs, cfg.include_path)
        else:
            harness.task_manager(theirs, cfg.include_path)
    return plan


def evaluate(
    subject: Subject,
    cfg: EvalsConfig,
    plan: own.Plan | None,
    *,
    harness_here: bool = True,
    rank: int = 0,
    world: int = 1,
    reduce: own.Reduce | None = None,
    with_samples: bool = False,
    progress: Progress | None = None,
) -> Result:
    """Score `subject` on `cfg.tasks`: lm's own tasks (`plan`, from `prepare`) on this rank's share, summed by
    `reduce`; lm-eval's where `harness_here`. A failure of lm-eval (its data out of reach, a task's own
    error) is recorded per task in `errors`; the other tasks' scores are kept."""
    result = Result()
    started = time.monotonic()
    device = subject.backbone.device
    with harness.generators_kept(device):
        if plan is not None:
            scorer = Scorer(subject.backbone, subject.tokenizer, subject.prefix_id, rows=cfg.batch_size)
            counts, kept = own.score_tasks(
                scorer, plan.tasks, limit=cfg.limit, convention=cfg.convention, rank=rank, world=world,
                reduce=reduce, examples=with_samples, progress=progress,
            )  # fmt: skip
            result.scores, result.core = own.summary(plan, counts, cfg.limit, cfg.convention)
            result.samples |= kept
        theirs = own.split(cfg.tasks)[1]
        if theirs and harness_here:
            run_harness(subject, cfg, theirs, result, with_samples)
    result.seconds = time.monotonic() - started
    return result


def run_harness(subject: Subject, cfg: EvalsConfig, tasks: list[str], result: Result, samples: bool) -> None:
    """lm-eval's tasks on the subject's transformers form, into `result`."""
    try:
        model, tokenizer = subject.transformers()
        out = harness.score(
            model, tokenizer, tasks, limit=cfg.limit, include_path=cfg.include_path,
            batch_size=cfg.batch_size, log_samples=samples,
        )  # fmt: skip
    except Exception as e:  # a benchmark's data out of reach must not end a paid-for run
        result.errors |= {task: harness.one_line(e) for task in tasks}
        return
    result.scores |= out["scores"]
    result.errors |= out["errors"]
    if samples:
        result.samples |= {task: [harness.example(s) for s in rows] for task, rows in out["samples"].items()}


def is_hf_folder(path: Path) -> bool:
    """A transformers model folder (config.json), not an lm run directory."""
    return (path / "config.json").is_file() and not (path / rundir.CHECKPOINTS).is_dir()


def evaluate_path(
    path: str | Path,
    cfg: EvalsConfig,
    *,
    device: str | None = None,
    with_samples: bool = False,
    into_folder: bool = False,
    progress: Progress | None = None,
) -> tuple[Path, dict[str, Any]]:
    """`lm eval`: score a run (or a checkpoint in one) or a transformers model folder on `cfg`, and write
    eval.json and eval.md. Returns (the eval.json written, its record).

    A run's files go into its directory. A model folder's go beside it, as `<folder>.eval.json` and
    `<folder>.eval.md`, so that uploading the folder uploads the model and not a local evaluation of it;
    `into_folder` writes them into it instead. `with_samples` keeps each example's log-likelihoods."""
    path = Path(path)
    plan = prepare(cfg, reach=True)  # refused before a model is loaded
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with harness.generators_kept(torch.device(device)):  # building a model draws its initial weights
        if is_hf_folder(path):
            subject, folder = of_folder(path, device), path.resolve()
        else:
            run = hf.load_run(path, device)
            about = {"model": str(run.run_dir), "checkpoint": str(run.ckpt), "step": run.step}
            subject = of_lm(run.model, run.tokenizer_path, run.eot_token, run.eot_id, about)
            folder = run.run_dir
    result = evaluate(subject, cfg, plan, with_samples=with_samples, progress=progress)
    record = {
        **subject.about,
        "tasks": list(cfg.tasks),
        "limit": cfg.limit,
        "device": device,
        "seconds": result.seconds,  # the scoring, without loading
        "scores": result.scores,
    }
    record |= {"core": result.core} if result.core is not None else {}
    record |= {"errors": result.errors} if result.errors else {}
    record |= {"samples": result.samples} if with_samples else {}
    if "checkpoint" in subject.about or into_folder:
        return rundir.write_eval(folder, record, result.markdown()), record
    return rundir.write_eval(folder.parent, record, result.markdown(), prefix=f"{folder.name}."), record
