"""Markdown renderings shared by the callbacks (TensorBoard's text tab) and `lm report`."""

from __future__ import annotations

from typing import Any


def fmt_money(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"${value:,.2f}" if value >= 1 else f"${value:.4f}"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>") or " "


def phases_markdown(
    rows: list[dict[str, Any]], benchmark: list[str] | None = None, priced: bool = True
) -> str:
    """The rows of phases.csv as a Markdown table; `benchmark`, one cell per row, adds that column; an unpriced
    run (a CPU's $0/h) says so in its dollar columns instead of $0.0000."""
    head = ["phase", "steps", "tokens", "hours", "loss", "drop", "$", "$/loss point", "tok/s", "goal"]
    head += ["benchmark"] if benchmark is not None else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        goal = "" if r["goal_loss"] is None else f"{r['goal_loss']} {'met' if r['goal_met'] else 'missed'}"
        cells = [
            f"{r['phase']}. {r['name']}" + (" (partial)" if r["status"] == "partial" else ""),
            f"{r['start_step']:,}-{r['end_step']:,}",
            f"{r['tokens']:,}",
            f"{r['wall_hours']:.3f}",
            f"{r['start_loss']:.3f} -> {r['end_loss']:.3f}"
            + (f" ({r['source_losses']})" if r.get("source_losses") else ""),
            f"{r['loss_drop']:.3f}",
            fmt_money(r["usd"]) if priced else "unpriced",
            fmt_money(r["usd_per_loss_point"]) if priced else "unpriced",
            "" if r["tokens_per_sec"] is None else f"{r['tokens_per_sec']:,.0f}",
            goal,
            *([benchmark[i]] if benchmark is not None else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def samples_markdown(records: list[dict[str, Any]]) -> str:
    """One milestone's samples as a prompt x mode table."""
    lines = ["| prompt | mode | continuation |", "|---|---|---|"]
    lines += [f"| {cell(r['prompt'])} | {r['mode']} | {cell(r['text'])} |" for r in records]
    return "\n".join(lines)


def main_metric(metrics: dict[str, float]) -> str | None:
    """The metric a task is reported by: length-normalised accuracy where the task has it, else accuracy,
    else its first metric."""
    for name in ("acc_norm", "acc"):
        if name in metrics:
            return name
    return next((m for m in metrics if not m.endswith("_stderr")), None)


def evals_markdown(scores: dict[str, dict[str, float]]) -> str:
    """Benchmark scores (task -> metric -> value, stderr as `<metric>_stderr`) as a task x metric table."""
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            if metric.endswith("_stderr"):
                continue
            err = metrics.get(f"{metric}_stderr")
            lines.append(f"| {task} | {metric} | {value:.4f} | {'' if err is None else f'{err:.4f}'} |")
    return "\n".join(lines)
