"""Forecast benchmark that keeps score: replay every recorded curve (tests/fixtures/curves) point by point and
predict its final validation loss at 10/20/30/50/80% of the run, for each law (schedule, multi_power, auto)
and each prior (none; `smaller`: fitted on the full curves of the smaller model shapes only; `loo`: fitted on
every other curve; `own`: the curve's own, an oracle), with the 90% interval's coverage of the measured final loss.

    python experiments/2026-11-24-forecast-priors/forecast_bench.py            # table to stdout
    python experiments/2026-11-24-forecast-priors/forecast_bench.py --json experiments/2026-11-24-forecast-priors/results.json

tests/numbers/test_forecast_bench.py replays it and fails when the error at 30% grows past what results.json records.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import cache
from pathlib import Path

import numpy as np

from lm.config import OptimConfig
from lm.numbers.loss_law import fit_schedule_law
from lm.numbers.loss_prior import (
    MODELS,
    default_prior,
    fit_forecast,
    fit_shape,
    middle,
    prior_from_shapes,
)
from lm.numbers.lr_schedule import multipliers
from lm.tools.calibrate import train_points

CURVES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "curves"
FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.8)
SHAPES = ("tiny", "small", "medium")
"""Model shapes by size (record_runs.sh): a `smaller` prior comes from the shapes before a curve's own."""
PRIORS = ("none", "smaller", "loo", "own")
"""`own`: the curve's own full-curve shape at the least spread (MIN_SD), an oracle: what a perfect shape prior
leaves to the level."""


def load_curves() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(CURVES.glob("*.json"))}


def plan_mult(curve: dict) -> np.ndarray:
    optim = OptimConfig(**{k: v for k, v in curve["optim"].items() if k in OptimConfig.__dataclass_fields__})
    return multipliers(optim, curve["total_steps"])


def shape_of(name: str) -> str:
    return name.split("_")[0]


PRIOR_FROM = "val"
"""What a prior is fitted to on the donor curves: `val` (the precise validation points) or `train` (block means
of 5 training losses, what `lm plan --calibrate` fits, its runs validating only once)."""


@cache
def shape_fit(name: str, model: str, source: str, fixed: tuple | None = None) -> tuple | None:
    curve = CURVE_SET[name]
    if source == "train":
        warmup = curve["optim"]["warmup_steps"]
        steps, losses = train_points(np.array(curve["train"]["step"]), curve["train"]["loss"], warmup)
    else:
        steps, losses = curve["val"]["step"], curve["val"]["loss"]
    shape = fit_shape(steps, losses, plan_mult(curve), model, dict(fixed) if fixed else None)
    return None if shape is None else tuple(sorted(shape.items()))


def prior_for(name: str, kind: str, model: str):
    """The prior `kind` for curve `name` (None: the law's default; `smaller` None when no smaller shape)."""
    if kind == "none":
        return default_prior(model)
    rank = SHAPES.index(shape_of(name))
    if kind == "smaller":
        donors = [n for n in CURVE_SET if SHAPES.index(shape_of(n)) < rank]
    elif kind == "own":
        donors = [name]
    else:
        donors = [n for n in CURVE_SET if n != name]
    shapes = [dict(s) for s in (shape_fit(n, model, PRIOR_FROM) for n in donors) if s is not None]
    if not shapes:
        return None
    if model == "multi_power":  # as priors_from_curves: every donor's (alpha, b) under one C, beta, gamma
        fixed = tuple(sorted(middle(shapes).items()))
        shapes = [dict(s) for s in (shape_fit(n, model, PRIOR_FROM, fixed) for n in donors) if s is not None]
    return prior_from_shapes(model, shapes, f"{kind}: {', '.join(donors)}")


def forecast(name: str, model: str, kind: str, fraction: float) -> dict | None:
    """The prediction of the curve's final loss from its points up to `fraction` of the run."""
    curve = CURVE_SET[name]
    mult = plan_mult(curve)
    steps, losses = np.array(curve["val"]["step"]), np.array(curve["val"]["loss"])
    seen = steps <= fraction * curve["total_steps"]
    if model == "today":  # the stopper without a prior: lm.numbers.loss_law as before this benchmark
        law = fit_schedule_law(steps[seen], losses[seen], mult, min_points=3)
    else:
        priors = {m: prior_for(name, kind, m) for m in MODELS}
        if any(p is None for p in priors.values()):
            return None
        law = fit_forecast(steps[seen], losses[seen], mult, model, priors)
    if law is None:
        return None
    p = law.predict(mult)
    final = float(losses[-1])
    return {
        "error": p.loss - final,
        "low": p.low - final,
        "high": p.high - final,
        "covered": p.low <= final <= p.high,
    }


def run(fractions=FRACTIONS) -> dict:
    """{"curve|model|prior": {"30%": cell or None}}: `today` is the stopper's law without a prior."""
    rows = {}
    for name in CURVE_SET:
        for model in ("today", *MODELS, "auto"):
            for kind in ("none",) if model == "today" else PRIORS:
                cells = {f"{f:.0%}": forecast(name, model, kind, f) for f in fractions}
                rows[f"{name}|{model}|{kind}"] = cells
    return rows


def summary(rows: dict) -> dict:
    """Per (model, prior): worst |error| at each fraction over the curves it applies to, and the coverage."""
    out = {}
    for key, cells in rows.items():
        _, model, kind = key.split("|")
        s = out.setdefault(f"{model}|{kind}", {"worst": {}, "covered": 0, "points": 0})
        for frac, cell in cells.items():
            if cell is None:
                continue
            s["worst"][frac] = max(s["worst"].get(frac, 0.0), abs(cell["error"]))
            s["covered"] += cell["covered"]
            s["points"] += 1
    return out


def table(rows: dict) -> str:
    lines = [
        "| curve | model | prior | " + " | ".join(f"{f:.0%}" for f in FRACTIONS) + " | covered |",
        "|---" * 9 + "|",
    ]
    for key, cells in rows.items():
        cov = [c["covered"] for c in cells.values() if c]
        text = [
            "n/a" if c is None else f"{c['error']:+.3f} [{c['low']:+.2f}, {c['high']:+.2f}]"
            for c in cells.values()
        ]
        lines.append(f"| {' | '.join(key.split('|'))} | " + " | ".join(text) + f" | {sum(cov)}/{len(cov)} |")
    lines += [
        "",
        "| model | prior | worst abs error " + " / ".join(f"{f:.0%}" for f in FRACTIONS) + " | coverage |",
    ]
    lines.append("|---|---|---|---|")
    for key, s in summary(rows).items():
        worst = " / ".join(
            f"{s['worst'][f]:.3f}" if f in s["worst"] else "n/a" for f in (f"{x:.0%}" for x in FRACTIONS)
        )
        rate = s["covered"] / s["points"] if s["points"] else math.nan
        lines.append(
            f"| {' | '.join(key.split('|'))} | {worst} | {s['covered']}/{s['points']} = {rate:.0%} |"
        )
    return "\n".join(lines)


def goal(rows: dict) -> str:
    """The issue's goal per model, with the prior from the smaller shapes: the final loss within 0.02 from 30%
    of the run on every curve that has one (30/50/80%), and the 90% interval covering it on >= 85% of the
    (curve, fraction) points."""
    lines = ["| model (prior: smaller shapes) | worst abs error from 30% | within 0.02 | coverage | goal |"]
    lines.append("|---|---|---|---|---|")
    for model in (*MODELS, "auto"):
        cells = [c for k, r in rows.items() if k.endswith(f"|{model}|smaller") for c in r.values() if c]
        late = [
            c
            for k, r in rows.items()
            if k.endswith(f"|{model}|smaller")
            for f, c in r.items()
            if c and int(f[:-1]) >= 30
        ]
        if not cells:
            continue
        worst = max(abs(c["error"]) for c in late)
        inside = sum(abs(c["error"]) <= 0.02 for c in late)
        rate = sum(c["covered"] for c in cells) / len(cells)
        met = worst <= 0.02 and rate >= 0.85
        lines.append(
            f"| {model} | {worst:.3f} | {inside}/{len(late)} | {rate:.0%} ({len(cells)} points) | "
            f"{'MET' if met else 'MISSED'} |"
        )
    return "\n".join(lines)


CURVE_SET = load_curves()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, help="also write every cell and the summary here")
    parser.add_argument("--prior-from", choices=("val", "train"), default="val", help="see PRIOR_FROM")
    args = parser.parse_args()
    global PRIOR_FROM
    PRIOR_FROM = args.prior_from
    rows = run()
    print(table(rows))
    print()
    print(goal(rows))
    if args.json:
        record = {"prior_from": PRIOR_FROM, "rows": rows, "summary": summary(rows)}
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
