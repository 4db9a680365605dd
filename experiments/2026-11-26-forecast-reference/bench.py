"""The reference-curve forecast against the laws, on held-out recorded curves, scored on the validation loss the
stopper itself sees (`val_in_run`). Every target curve is forecast only from curves that are not itself:

- `pair`: from each other curve with the same key (schedule shape, tokens per step), one at a time;
- `set`: from all of them at once (lm.numbers.reference.forecast: the nearest reference, the interval from
  leave-one-curve-out over the set);
- `schedule` / `multi_power`: the laws without a prior, fitted to the target's own points so far (>= 3).

At 10/20/30/50/80% of the run a forecast sees the points before that fraction. Prints the tables and writes the
`RECORDED_ERRORS` that lm.numbers.reference's one-reference interval uses (the largest |error| of `pair`).

    python experiments/2026-11-26-forecast-reference/bench.py [--json experiments/2026-11-26-forecast-reference/results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from lm.config import OptimConfig
from lm.numbers import reference
from lm.numbers.loss_law import fit_schedule_law
from lm.numbers.loss_prior import fit_forecast
from lm.numbers.lr_schedule import multipliers
from lm.run.references import read_reference

ROOT = Path(__file__).resolve().parents[2]
CURVES = ROOT / "tests" / "fixtures" / "curves"
FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.8)
METHODS = ("pair", "set", "schedule", "multi_power")


def law_forecast(method: str, record: dict, steps, losses) -> reference.Prediction | None:
    optim = OptimConfig(**{k: v for k, v in record["optim"].items() if k in OptimConfig.__dataclass_fields__})
    mult = multipliers(optim, record["total_steps"])
    if method == "schedule":
        law = fit_schedule_law(steps, losses, mult, min_points=3)
    else:
        law = fit_forecast(steps, losses, mult, "multi_power", {}, min_points=3)
    return None if law is None else law.predict(mult)


def run(laws: bool = True) -> dict:
    records = {p.stem: json.loads(p.read_text()) for p in sorted(CURVES.glob("*.json"))}
    curves = {name: read_reference(CURVES / f"{name}.json") for name in records}
    rows = []
    for name, target in curves.items():
        refs = [c for n, c in curves.items() if n != name and reference.mismatch(c, target.key) is None]
        for f in FRACTIONS:
            seen = target.fractions <= f + 1e-9  # the points up to and at this fraction
            if not seen.any():
                continue
            steps, losses = target.steps[seen], target.losses[seen]
            fr = target.fractions[seen]
            row = {"target": name, "fraction": f, "points": int(seen.sum()), "final": target.final}
            row["pair"] = {r.name: reference.offset_forecast(r, fr, losses) - target.final for r in refs}
            s = reference.forecast(refs, steps, losses, target.total_steps) if refs else None
            if s is not None:
                p = s.prediction
                row["set"] = {
                    "error": p.loss - target.final,
                    "covered": p.low <= target.final <= p.high,
                    "half": (p.high - p.low) / 2,
                    "reference": s.reference,
                }
            for law in ("schedule", "multi_power") if laws else ():
                p = law_forecast(law, records[name], steps, losses) if seen.sum() >= 3 else None
                if p is not None:
                    row[law] = {"error": p.loss - target.final, "covered": p.low <= target.final <= p.high}
            rows.append(row)
    return {"rows": rows, "recorded_errors": recorded_errors(rows), "summary": summary(rows)}


def recorded_errors(rows: list[dict]) -> list[list[float]]:
    out = []
    for f in FRACTIONS:
        errs = [abs(e) for r in rows if r["fraction"] == f for e in r["pair"].values()]
        out.append([f, round(max(errs), 3)])
    return out


def summary(rows: list[dict]) -> dict:
    out = {}
    for method in METHODS:
        for f in FRACTIONS:
            if method == "pair":
                errs = [e for r in rows if r["fraction"] == f for e in r["pair"].values()]
                cov = []
            else:
                picked = [r[method] for r in rows if r["fraction"] == f and method in r]
                errs, cov = [p["error"] for p in picked], [p["covered"] for p in picked]
            if errs:
                a = np.abs(errs)
                out[f"{method}|{f:.0%}"] = {
                    "n": len(errs),
                    "worst": float(a.max()),
                    "rms": float(np.sqrt(np.mean(a**2))),
                    "within_0.02": int((a <= 0.02).sum()),
                    "covered": int(sum(cov)) if cov else None,
                }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = run()
    print("| method | fraction | forecasts | worst |err| | RMS | within 0.02 | 90% interval covers |")
    print("|---|---|---|---|---|---|---|")
    for k, v in res["summary"].items():
        method, f = k.split("|")
        cov = "-" if v["covered"] is None else f"{v['covered']}/{v['n']}"
        print(
            f"| {method} | {f} | {v['n']} | {v['worst']:.3f} | {v['rms']:.3f} | {v['within_0.02']} | {cov} |"
        )
    print("\nRECORDED_ERRORS =", tuple(tuple(x) for x in res["recorded_errors"]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
