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


def phases_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows of phases.csv as a Markdown table."""
    head = ["phase", "steps", "tokens", "hours", "loss", "drop", "$", "$/loss point", "tok/s", "goal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        goal = "" if r["goal_loss"] is None else f"{r['goal_loss']} {'met' if r['goal_met'] else 'missed'}"
        cells = [
            f"{r['phase']}. {r['name']}" + (" (partial)" if r["status"] == "partial" else ""),
            f"{r['start_step']:,}-{r['end_step']:,}",
            f"{r['tokens']:,}",
            f"{r['wall_hours']:.3f}",
            f"{r['start_loss']:.3f} -> {r['end_loss']:.3f}"
            + (f" ({r['source_losses']})" if r.get("source_losses") else ""),
            f"{r['loss_drop']:.3f}",
            fmt_money(r["usd"]),
            fmt_money(r["usd_per_loss_point"]),
            "" if r["tokens_per_sec"] is None else f"{r['tokens_per_sec']:,.0f}",
            goal,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def samples_markdown(records: list[dict[str, Any]]) -> str:
    """One milestone's samples as a prompt x mode table."""
    lines = ["| prompt | mode | continuation |", "|---|---|---|"]
    lines += [f"| {cell(r['prompt'])} | {r['mode']} | {cell(r['text'])} |" for r in records]
    return "\n".join(lines)
