"""The reference-curve forecast against the laws, on held-out recorded curves, scored on the validation loss the
stopper itself sees (`val_in_run`). Every target curve is forecast only from curves that are not itself:

- `pair`: from each other curve with the same key (schedule shape, tokens per step), one at a time;
- `set`: from all of them at once (lm.numbers.reference.forecast: the nearest reference, the interval from
  leave-one-curve-out over the set);
- `schedule` / `multi_power`: the laws without a prior, fitted to the target's own points so far (>= 3).

At 10/20/30/50/80% of the run a forecast sees the points before that fraction. Prints the tables and writes the
`RECORDED_ERRORS` that lm.numbers.reference's one-reference interval uses (the largest |error| of `pair`).

    python experiments/2026-11-26-forecast-reference/bench.py [--json experiments/2026-11-26-forecast-reference/results.json]

`--ladder DIR` scores the held-out ladder that record_ladder.sh trains instead (4 shapes <= 3x apart at ~4 tokens
per parameter, validation every 5%, the largest at 3 init seeds), read from its run directories: each target is
forecast from the strictly smaller shapes (`smaller`, the case a user has) and from every other run (`others`).

    python experiments/2026-11-26-forecast-reference/bench.py --ladder /tmp/ladder37 --json .../ladder.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np

from lm.config import OptimConfig
from lm.numbers import reference
from lm.numbers.loss_law import fit_schedule_law
from lm.numbers.loss_prior import fit_forecast
from lm.numbers.lr_schedule import multipliers
from lm.run.references import read_reference, typed
from lm.store import rundir

ROOT = Path(__file__).resolve().parents[2]
CURVES = ROOT / "tests" / "fixtures" / "curves"
FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.8)
METHODS = ("pair", "set", "pair_ratio", "set_ratio", "schedule", "multi_power")
"""`*_ratio`: the same forecasts with `early_stopping.forecast_reference_map=ratio` (lm.numbers.reference.MAPS)."""


LADDER = {"d32": 24_576, "d52": 64_896, "d72": 186_624, "d96": 442_368}
"""record_ladder.sh's shapes by name prefix, with their non-embedding parameters (12 L d^2)."""
LADDER |= {"e24": 13_824, "e36": 31_104, "e52": 64_896, "e72": 186_624}
"""record_ladder.sh's at ~20 tokens per parameter (its second argument `20`)."""


def law_forecast(method: str, record: dict, steps, losses) -> reference.Prediction | None:
    optim = record["optim"]
    if not isinstance(optim, OptimConfig):
        optim = OptimConfig(**{k: v for k, v in optim.items() if k in OptimConfig.__dataclass_fields__})
    mult = multipliers(optim, record["total_steps"])
    if method == "schedule":
        law = fit_schedule_law(steps, losses, mult, min_points=3)
    else:
        law = fit_forecast(steps, losses, mult, "multi_power", {}, min_points=3)
    return None if law is None else law.predict(mult)


def run(laws: bool = True) -> dict:
    records = {p.stem: json.loads(p.read_text()) for p in sorted(CURVES.glob("*.json"))}
    curves = {name: read_reference(CURVES / f"{name}.json") for name in records}
    refs_of = {
        name: [c for n, c in curves.items() if n != name and reference.mismatch(c, target.key) is None]
        for name, target in curves.items()
    }
    pairs = {}  # (target, donor, fraction, map) -> error: every out-of-sample forecast of one curve from another
    for name, target in curves.items():
        for f in FRACTIONS:
            seen = target.fractions <= f + 1e-9
            for r, how in itertools.product(refs_of[name], ("offset", "ratio")):
                e = (
                    reference.offset_forecast(r, target.fractions[seen], target.losses[seen], how)
                    - target.final
                )
                pairs[name, r.name, f, how] = e
    rows = []
    for name, target in curves.items():
        refs = refs_of[name]
        for f in FRACTIONS:
            seen = target.fractions <= f + 1e-9  # the points up to and at this fraction
            if not seen.any():
                continue
            steps, losses = target.steps[seen], target.losses[seen]
            row = {"target": name, "fraction": f, "points": int(seen.sum()), "final": target.final}
            for how, tag in (("offset", ""), ("ratio", "_ratio")):
                row["pair" + tag] = {
                    d: e for (t, d, g, h), e in pairs.items() if t == name and g == f and h == how
                }
                # The interval's calibration without any pair that involves this target: out of sample here too.
                held_out = tuple(
                    abs(e) for (t, d, g, h), e in pairs.items() if g == f and h == how and name not in (t, d)
                )
                s = (
                    reference.forecast(refs, steps, losses, target.total_steps, how, held_out)
                    if refs
                    else None
                )
                if s is not None:
                    row["set" + tag] = scored(s, target.final)
            for law in ("schedule", "multi_power") if laws else ():
                p = law_forecast(law, records[name], steps, losses) if seen.sum() >= 3 else None
                if p is not None:
                    row[law] = {"error": p.loss - target.final, "covered": p.low <= target.final <= p.high}
            rows.append(row)
    table = summary(rows)
    return {
        "rows": rows,
        "recorded_errors": recorded_errors(rows),
        "recorded_ratio_errors": recorded_errors(rows, "pair_ratio"),
        "summary": table,
        "goals": goals({"all": table}, None, ("set", "set_ratio", "schedule", "multi_power")),
    }


def scored(s: reference.ReferenceForecast, final: float) -> dict:
    p = s.prediction
    return {
        "error": p.loss - final,
        "covered": p.low <= final <= p.high,
        "half": (p.high - p.low) / 2,
        "reference": Path(s.reference).name,
    }


def read_ladder(root: Path) -> tuple[dict, dict]:
    """The ladder's curves and optimizer settings, from its run directories or from curve JSON files that
    `--save-curves` wrote (tests/fixtures/ladder37: the benchmark runs without retraining)."""
    curves, records = {}, {}
    for p in sorted(root.iterdir()):
        if (p / rundir.CONFIG).is_file():
            optim = typed(rundir.read_config(p), "optim", OptimConfig)
        elif p.suffix == ".json":
            optim = OptimConfig(**json.loads(p.read_text())["optim"])
        else:
            continue
        curve = read_reference(p)
        name = Path(curve.name).name
        curves[name] = curve
        records[name] = {"optim": optim, "total_steps": curve.total_steps}
    return curves, records


def save_curves(root: Path, out: Path) -> None:
    """Each run directory of the ladder as one curve JSON (lm's own form, plus the optimizer settings)."""
    out.mkdir(parents=True, exist_ok=True)
    curves, records = read_ladder(root)
    for name, c in curves.items():
        record = {
            "name": name,
            "steps": [int(x) for x in c.steps],
            "losses": [round(float(x), 5) for x in c.losses],
            "total_steps": c.total_steps,
            "key": c.key,
            "optim": dataclasses.asdict(records[name]["optim"]),
        }
        (out / f"{name}.json").write_text(json.dumps(record) + "\n")


def run_ladder(root: Path, laws: bool = True) -> dict:
    """The ladder: each run forecast from the strictly smaller shapes and from every other run."""
    curves, records = read_ladder(root)
    size = {name: LADDER[name.split("_")[0]] for name in curves}
    largest = max(size.values())
    seeds = [c.final for n, c in curves.items() if size[n] == largest]
    rows = []
    for name, target in curves.items():
        pools = {
            "smaller": [c for n, c in curves.items() if size[n] < size[name]],
            "others": [c for n, c in curves.items() if n != name],
            # The floor: the best reference there is, the same shape from another init seed.
            "seeds": [c for n, c in curves.items() if n != name and size[n] == size[name]],
        }
        for f in FRACTIONS:
            seen = target.fractions <= f + 1e-9
            steps, losses = target.steps[seen], target.losses[seen]
            row = {"target": name, "fraction": f, "points": int(seen.sum()), "final": target.final}
            row["largest"] = size[name] == largest
            if pools["seeds"]:  # the floor, one reference at a time (a user has one sibling)
                row["seed_pairs"] = {
                    Path(c.name).name: reference.offset_forecast(c, target.fractions[seen], losses)
                    - target.final
                    for c in pools["seeds"]
                }
            for (pool, refs), (how, tag) in itertools.product(
                pools.items(), (("offset", ""), ("ratio", "_ratio"))
            ):
                if not refs:
                    continue
                s = reference.forecast(refs, steps, losses, target.total_steps, how)
                row[pool + tag] = scored(s, target.final)
            for law in ("schedule", "multi_power") if laws else ():
                p = law_forecast(law, records[name], steps, losses) if seen.sum() >= 3 else None
                if p is not None:
                    row[law] = {"error": p.loss - target.final, "covered": p.low <= target.final <= p.high}
            rows.append(row)
    finals = {n: c.final for n, c in curves.items()}
    table, largest_only = (
        summary(rows, LADDER_METHODS),
        summary([r for r in rows if r["largest"]], LADDER_METHODS),
    )
    return {
        "rows": rows,
        "finals": finals,
        "seed_spread": float(np.std(seeds, ddof=1)) if len(seeds) > 1 else None,
        "summary": table,
        "largest": largest_only,
        "goals": goals(
            {"all": table, "largest": largest_only}, largest_only["seed_pairs|30%"], LADDER_METHODS[1:]
        ),
    }


LADDER_METHODS = (
    "seed_pairs",
    "seeds",
    "smaller",
    "others",
    "smaller_ratio",
    "others_ratio",
    "schedule",
    "multi_power",
)
"""`seed_pairs`: the same-shape other-seed floor, each of the largest shape's seeds forecast from each other
one alone (6 forecasts); `seeds`: from both at once."""


def goals(summary_of: dict, floor: dict | None, methods) -> list[dict]:
    """Issue 48's goals per forecaster: RMS from 30% of the run within 1.25x the same-shape other-seed floor
    (on the largest shape's seeds, where the floor is measured), and 90% intervals covering >= 85% of the
    forecasts from 30% on (30, 50, 80%), out of sample."""
    out = []
    for m in methods:
        rms = summary_of["largest" if floor else "all"].get(f"{m}|30%", {}).get("rms")
        cells = [summary_of["all"].get(f"{m}|{f}") for f in ("30%", "50%", "80%")]
        cells = [c for c in cells if c and c["covered"] is not None]
        covered, n = sum(c["covered"] for c in cells), sum(c["n"] for c in cells)
        ratio = rms / floor["rms"] if floor and rms is not None else None
        out.append(
            {
                "method": m,
                "rms_30": rms,
                "floor_rms_30": floor["rms"] if floor else None,
                "rms_over_floor": ratio,
                "rms_goal_met": None if ratio is None else ratio <= 1.25,
                "covered": covered,
                "n": n,
                "coverage_goal_met": None if not n else covered / n >= 0.85,
            }
        )
    return out


def recorded_errors(rows: list[dict], method: str = "pair") -> dict[float, tuple[float, ...]]:
    """Every pair's |error| by fraction, sorted: lm.numbers.reference.RECORDED_ERRORS (the interval's
    calibration errors)."""
    return {
        f: tuple(sorted(round(abs(e), 3) for r in rows if r["fraction"] == f for e in r[method].values()))
        for f in FRACTIONS
    }


def summary(rows: list[dict], methods=METHODS) -> dict:
    out = {}
    for method in methods:
        for f in FRACTIONS:
            if method.startswith("pair") or method == "seed_pairs":
                errs = [e for r in rows if r["fraction"] == f and method in r for e in r[method].values()]
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
    ap.add_argument("--ladder", type=Path)
    ap.add_argument(
        "--save-curves", type=Path, help="with --ladder: write its curves as JSON into this folder"
    )
    args = ap.parse_args()
    if args.save_curves:
        save_curves(args.ladder, args.save_curves)
    res = run_ladder(args.ladder) if args.ladder else run()
    print("| method | fraction | forecasts | worst |err| | RMS | within 0.02 | 90% interval covers |")
    print("|---|---|---|---|---|---|---|")
    for k, v in res["summary"].items():
        method, f = k.split("|")
        cov = "-" if v["covered"] is None else f"{v['covered']}/{v['n']}"
        print(
            f"| {method} | {f} | {v['n']} | {v['worst']:.3f} | {v['rms']:.3f} | {v['within_0.02']} | {cov} |"
        )
    if "largest" in res:
        print("\nthe largest shape's seeds only (where the floor is measured):")
        for k, v in res["largest"].items():
            cov = "-" if v["covered"] is None else f"{v['covered']}/{v['n']}"
            print(f"| {k.replace('|', ' | ')} | {v['n']} | {v['worst']:.3f} | {v['rms']:.3f} | {cov} |")
    print(
        "\n| forecaster | RMS from 30% | floor RMS | x floor (goal <= 1.25) | 90% interval covers, 30-80% (goal >= 85%) |"
    )
    print("|---|---|---|---|---|")
    for g in res["goals"]:
        rms = "-" if g["rms_30"] is None else f"{g['rms_30']:.3f}"
        floor = "-" if g["floor_rms_30"] is None else f"{g['floor_rms_30']:.3f}"
        x = (
            "-"
            if g["rms_over_floor"] is None
            else f"{g['rms_over_floor']:.2f}x " + ("met" if g["rms_goal_met"] else "missed")
        )
        cov = (
            "-"
            if not g["n"]
            else f"{g['covered']}/{g['n']} = {g['covered'] / g['n']:.0%} "
            + ("met" if g["coverage_goal_met"] else "missed")
        )
        print(f"| {g['method']} | {rms} | {floor} | {x} | {cov} |")
    if "recorded_errors" in res:
        print("\nRECORDED_ERRORS =", res["recorded_errors"])
        print("RECORDED_RATIO_ERRORS =", res["recorded_ratio_errors"])
    else:
        print(
            "\nfinal losses:",
            {n: round(v, 4) for n, v in res["finals"].items()},
            "seed sd:",
            res["seed_spread"],
        )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
