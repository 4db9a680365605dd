"""The reference forecast's coverage and its distance from the floor, each with its uncertainty (issue 55 item 4).

    python experiments/2026-11-28-audit/coverage_floor.py --json experiments/2026-11-28-audit/coverage_floor.json

On the two held-out ladders (tests/fixtures/ladder37 at ~4 tokens per parameter, ladder20 at ~20: 3 smaller
shapes and the largest at 3 seeds, a validation every 5% of the run), every validation point from 30% to 80% of
each run (11 points a curve) is a forecast of that curve's final loss:

- `smaller`: from every strictly smaller shape (the default, `offset`; `_ratio`: the ratio map);
- `sibling`: from the next smaller shape alone, the one reference `lm plan --sibling` gives a user;
- the floor: the largest shape's seeds, each forecast from each other seed alone (6 ordered pairs).

**Coverage** (90% intervals, goal >= 85%): the share of forecasts covered, and a 95% Clopper-Pearson interval
with one trial per curve (a curve's 11 forecasts share its errors, so they are counted as one: the
conservative end of the correlation). "met" / "missed" only where that interval excludes 85%, else "undecided".

**The floor ratio** (goal: RMS within 1.25x the floor): per target seed of the largest shape, the forecaster's
RMS over its 11 points against the floor's RMS over the same points (its two other seeds as references); the
geometric mean of the 3 ratios with a 95% t interval over the 3 seeds on the log scale; the floor's spread over
pairs and points beside it. "met" / "missed" only where the interval excludes 1.25.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from lm.numbers import reference
from lm.numbers.stats import t_interval

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "2026-11-26-forecast-reference"))
from bench import LADDER, read_ladder  # noqa: E402

LADDERS = {
    "~4 tokens/param": ROOT / "tests/fixtures/ladder37",
    "~20 tokens/param": ROOT / "tests/fixtures/ladder20",
}
FROM, TO = 0.3, 0.8
COVERAGE_GOAL, FLOOR_GOAL = 0.85, 1.25


def clopper_pearson(k: float, n: int, level: float = 0.95) -> tuple[float, float]:
    a = (1 - level) / 2
    low = 0.0 if k <= 0 else float(stats.beta.ppf(a, k, n - k + 1))
    high = 1.0 if k >= n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return low, high


def decide(low: float, high: float, goal: float, higher_is_better: bool) -> str:
    if higher_is_better:
        return "met" if low >= goal else "missed" if high < goal else "undecided"
    return "met" if high <= goal else "missed" if low > goal else "undecided"


def points(curve: reference.Curve) -> list[int]:
    """Indices of the validations from 30% to 80% of the run."""
    return [i for i, f in enumerate(curve.fractions) if FROM - 1e-9 <= f <= TO + 1e-9]


def forecast_at(refs, target: reference.Curve, i: int, how: str):
    return reference.forecast(refs, target.steps[: i + 1], target.losses[: i + 1], target.total_steps, how)


def run() -> dict:
    out = {}
    for label, root in LADDERS.items():
        curves, _ = read_ladder(root)
        size = {n: LADDER[n.split("_")[0]] for n in curves}
        sizes = sorted(set(size.values()))
        largest = sizes[-1]
        methods = {}
        for name, target in curves.items():
            smaller = [c for n, c in curves.items() if size[n] < size[name]]
            if not smaller:
                continue
            below = max(size[n] for n in curves if size[n] < size[name])
            sibling = [c for n, c in curves.items() if size[n] == below]
            for method, refs, how in (
                ("smaller", smaller, "offset"),
                ("smaller_ratio", smaller, "ratio"),
                ("sibling", sibling, "offset"),
                ("sibling_ratio", sibling, "ratio"),
            ):
                rows = []
                for i in points(target):
                    s = forecast_at(refs, target, i, how)
                    p = s.prediction
                    rows.append({"fraction": float(target.fractions[i]), "error": p.loss - target.final,
                                 "covered": bool(p.low <= target.final <= p.high)})  # fmt: skip
                methods.setdefault(method, {})[name] = rows
        coverage = {}
        for method, by_curve in methods.items():
            shares = [np.mean([r["covered"] for r in rows]) for rows in by_curve.values()]
            k = sum(r["covered"] for rows in by_curve.values() for r in rows)
            n = sum(len(rows) for rows in by_curve.values())
            at_three = [r["covered"] for rows in by_curve.values() for r in rows
                        if any(abs(r["fraction"] - f) < 1e-6 for f in (0.3, 0.5, 0.8))]  # fmt: skip
            low, high = clopper_pearson(float(np.sum(shares)), len(shares))
            coverage[method] = {
                "covered": k, "n": n, "curves": len(shares), "share": k / n,
                "per_curve": dict(zip(by_curve, map(float, shares), strict=True)),
                "at_30_50_80": [int(sum(at_three)), len(at_three)],
                "interval": [low, high], "verdict": decide(low, high, COVERAGE_GOAL, True),
            }  # fmt: skip
        seeds = {n: c for n, c in curves.items() if size[n] == largest}
        floor_errors, ratios = [], {}
        for method in methods:
            per_target = []
            for name, target in seeds.items():
                others = [c for n, c in seeds.items() if n != name]
                idx = points(target)
                floor = [reference.offset_forecast(o, target.fractions[: i + 1], target.losses[: i + 1]) - target.final
                         for o in others for i in idx]  # fmt: skip
                if method == next(iter(methods)):
                    floor_errors += [(name, Path(o.name).name, float(target.fractions[i]), e)
                                     for (o, i), e in zip([(o, i) for o in others for i in idx], floor, strict=True)]  # fmt: skip
                mine = [r["error"] for r in methods[method][name]]
                per_target.append(math.sqrt(np.mean(np.square(mine))) / math.sqrt(np.mean(np.square(floor))))
            iv = t_interval(np.log(per_target))
            ratios[method] = {
                "per_seed": per_target, "geometric_mean": math.exp(iv.mean), "interval": [math.exp(iv.low), math.exp(iv.high)],
                "verdict": decide(math.exp(iv.low), math.exp(iv.high), FLOOR_GOAL, False),
            }  # fmt: skip
        by_point = {}
        for _, _, f, e in floor_errors:
            by_point.setdefault(round(f, 3), []).append(e)
        point_rms = [math.sqrt(np.mean(np.square(v))) for v in by_point.values()]
        pair_abs = [abs(e) for *_, e in floor_errors]
        out[label] = {
            "coverage": coverage,
            "floor": {
                "rms": math.sqrt(np.mean(np.square([e for *_, e in floor_errors]))),
                "rms_by_point": {f"{f:.2f}": math.sqrt(np.mean(np.square(v))) for f, v in sorted(by_point.items())},
                "rms_by_point_range": [min(point_rms), max(point_rms)],
                "abs_error_one_pair_one_point": [float(np.min(pair_abs)), float(np.median(pair_abs)), float(np.max(pair_abs))],
            },
            "ratio": ratios,
        }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = run()
    for label, r in res.items():
        fl = r["floor"]
        print(
            f"\n## ladder {label}: the floor (largest shape, each seed from each other, {FROM:.0%}-{TO:.0%})"
        )
        print(f"RMS {fl['rms']:.4f}; by validation point {fl['rms_by_point_range'][0]:.4f}-{fl['rms_by_point_range'][1]:.4f}; "
              f"|error| of one pair at one point: min {fl['abs_error_one_pair_one_point'][0]:.4f}, median "
              f"{fl['abs_error_one_pair_one_point'][1]:.4f}, max {fl['abs_error_one_pair_one_point'][2]:.4f}")  # fmt: skip
        print(
            "\n| forecaster | covered (30-80%, every point) | at 30/50/80% | 95% (one trial a curve) | >= 85% | RMS / floor [95%, 3 seeds] | <= 1.25x |"
        )
        print("|---|---|---|---|---|---|---|")
        for m, c in r["coverage"].items():
            q = r["ratio"][m]
            print(f"| {m} | {c['covered']}/{c['n']} = {c['share']:.0%} ({c['curves']} curves) | "
                  f"{c['at_30_50_80'][0]}/{c['at_30_50_80'][1]} | [{c['interval'][0]:.0%}, {c['interval'][1]:.0%}] | "
                  f"{c['verdict']} | {q['geometric_mean']:.2f}x [{q['interval'][0]:.2f}, {q['interval'][1]:.2f}] "
                  f"(seeds {', '.join(f'{x:.2f}' for x in q['per_seed'])}) | {q['verdict']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
