"""The diminishing-returns stopper judged on real endings (issue 55 item 3): the ladder's measured cooldowns.

experiments/2026-11-25-ladder trained every rung's baseline and QK-norm + Muon at their best LR to 0.5, 0.6, 0.8
and 1.0 of the tokens, 5 seeds, each run a complete wsd schedule (the same 5%-of-the-full-run warm-up, flat, the
last 20% of its own steps decayed). On the same seed and data order a shorter run is the full run until its own
decay starts (their validation losses agree to float rounding there), so each shorter run is a real ending of
the full run: "stop at the start of my decay, cool down over 20% of my steps". 30 curves (3 rungs x 2 arms x 5
seeds), 90 real early endings, plus each full run's own end.

Each plan is priced at $100, dollars proportional to tokens. At each ending's decision step (its decay start:
0.4, 0.48, 0.64 of the plan) a stopper reads a price of a loss point from the full curve's validations up to
that step, and stops (takes that ending) at the first whose price exceeds the threshold; else it runs the plan.
The oracle takes the ending with the least dollars + threshold x final loss, every final loss measured.

- `window`: the default, lm.callbacks.stopper.marginal_usd_per_loss_point over the last 4 validations;
- `window_fit`: the same window's least-squares slope (lm.numbers.loss_law.usd_per_loss_point_fit);
- `forecast`: `use_forecast=true`, the schedule law through the points so far (>= 5), training 1% of the plan
  more before the same cooldown against cooling down now (its cooldown: the ending's own, 25% of the step);
- `forecast4`: the same with `early_stopping.forecast_min_points=4`, so that it can decide at 0.4 of the plan;
- trivial rules: `never stop`, and `always end at 0.5` / `0.6` / `0.8` of the plan.

The validations are every 10% of each run (the ladder's cadence), so at the 0.5 and 0.6 endings' decision steps
(0.4 and 0.48 of the plan) the stoppers see 4 points: the window (5 needed) and the forecast (5) cannot price
there, and decide only at the 0.8 ending's (6 points). Regret per curve; means with 95% t intervals over the 30
curves, and each rule's regret minus the forecast stopper's, paired by curve.

Also measured: how far the schedule law fitted to the whole full curve (the old study's oracle world) is from
each real ending, and the regret table that world gives on these same curves.

    python experiments/2026-11-28-stopper-real-endings/regret.py --json experiments/2026-11-28-stopper-real-endings/results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from lm.callbacks.stopper import marginal_usd_per_loss_point
from lm.checkpoint.run_state import ValPoint
from lm.config import OptimConfig
from lm.numbers.loss_law import fit_schedule_law, schedule_forecast, usd_per_loss_point_fit
from lm.numbers.lr_schedule import multipliers
from lm.numbers.stats import t_interval

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "2026-11-25-ladder" / "results"
PLAN_USD = 100.0
THRESHOLDS = (25, 50, 100, 200, 400, 800)
FRACTIONS = (0.5, 0.6, 0.8)
WINDOW = 4
MIN_POINTS = 5
RULES = (
    "window",
    "window_fit",
    "forecast",
    "forecast4",
    "never stop",
    "always 0.5",
    "always 0.6",
    "always 0.8",
)


def load() -> list[dict]:
    """The 30 curves: each full run with its three shorter complete runs (same shape, arm, LR and seed)."""
    runs: dict[tuple, dict[float, dict]] = {}
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        r = record["result"]
        key = (r["shape"], r["arm"], json.dumps(r["lr"], sort_keys=True), r["seed"])
        warmup = next(int(o.split("=")[1]) for o in record["config"] if o.startswith("optim.warmup_steps="))
        runs.setdefault(key, {})[r["fraction"]] = {**r, "total": record["steps"], "warmup": warmup}
    curves = []
    for (shape, arm, _, seed), by_f in sorted(runs.items()):
        if not all(f in by_f for f in (*FRACTIONS, 1.0)):
            continue
        full = by_f[1.0]
        endings = {f: by_f[f] for f in (*FRACTIONS, 1.0)}
        curves.append(
            {"name": f"{shape}/{arm}/s{seed}", "shape": shape, "arm": arm, "full": full, "endings": endings}
        )
    return curves


def optim_of(curve: dict) -> OptimConfig:
    return OptimConfig(warmup_steps=curve["full"]["warmup"])


def decision_step(run: dict) -> int:
    """Where a shorter run's decay starts (lm.numbers.lr_schedule's wsd): its last step as the full run."""
    return run["total"] - int(OptimConfig().decay_fraction * run["total"])


def check_prefix(curve: dict) -> float:
    """The largest gap between a shorter run's validations before its decay and the full run's at those steps."""
    full = dict(zip(curve["full"]["steps"], curve["full"]["val_loss"], strict=True))
    gaps = [
        abs(loss - full[step])
        for f in FRACTIONS
        for step, loss in zip(curve["endings"][f]["steps"], curve["endings"][f]["val_loss"], strict=True)
        if step <= decision_step(curve["endings"][f])
    ]
    return max(gaps)


def price(curve: dict, rule: str, step: int, length: int) -> float | None:
    """The price of a loss point a stopper reads at `step` (a cooldown of `length` steps would follow)."""
    full, total = curve["full"], curve["full"]["total"]
    points = [
        ValPoint(s, s, PLAN_USD * s / total, loss, loss)
        for s, loss in zip(full["steps"], full["val_loss"], strict=True)
        if s <= step
    ]
    if rule == "window":
        return marginal_usd_per_loss_point(points, WINDOW)
    if rule == "window_fit":
        recent = points[-1 - WINDOW :] if len(points) > WINDOW else []
        return usd_per_loss_point_fit([p.usd for p in recent], [p.loss for p in recent]) if recent else None
    optim = optim_of(curve)
    law = fit_schedule_law(
        [p.step for p in points],
        [p.loss for p in points],
        multipliers(optim, total),
        min_points=4 if rule == "forecast4" else MIN_POINTS,
    )
    if law is None:
        return None
    forecast = schedule_forecast(law, optim, total, step, length, total)
    return forecast.choices(PLAN_USD * step / total, PLAN_USD / total)["usd_per_loss_point_now"]


def decide(curve: dict, rule: str, threshold: float) -> float:
    """The ending (a fraction of the plan) the rule takes."""
    if rule == "never stop":
        return 1.0
    if rule.startswith("always "):
        return float(rule.split()[1])
    for f in FRACTIONS:
        run = curve["endings"][f]
        step = decision_step(run)
        p = price(curve, rule, step, run["total"] - step)
        if p is not None and p > threshold:
            return f
    return 1.0


def law_world(curve: dict) -> dict[float, float]:
    """The old study's world: each ending's final loss as the schedule law fitted to the whole full curve
    (points from 10% of the run) predicts it, every ending a wsd run of its own length."""
    full, optim = curve["full"], optim_of(curve)
    steps, losses = np.array(full["steps"]), np.array(full["val_loss"])
    late = steps >= 0.1 * full["total"]
    law = fit_schedule_law(steps[late], losses[late], multipliers(optim, full["total"]), min_points=3)
    return {f: law.predict(multipliers(optim, curve["endings"][f]["total"])).loss for f in (*FRACTIONS, 1.0)}


def regrets(curves: list[dict], losses: list[dict[float, float]], decisions: dict) -> dict:
    """Per threshold and rule: each curve's regret against the oracle, with the ending it took."""
    out = {}
    for threshold in THRESHOLDS:
        for rule in RULES:
            rows = []
            for i, (c, loss) in enumerate(zip(curves, losses, strict=True)):
                score = {f: PLAN_USD * f + threshold * loss[f] for f in (*FRACTIONS, 1.0)}
                oracle = min(score, key=score.get)
                took = decisions[(threshold, rule)][i]
                rows.append(
                    {
                        "curve": c["name"],
                        "took": took,
                        "oracle": oracle,
                        "regret": score[took] - score[oracle],
                    }
                )
            out[(threshold, rule)] = rows
    return out


def summary(table: dict) -> list[dict]:
    rows = []
    for threshold in THRESHOLDS:
        forecast = [r["regret"] for r in table[(threshold, "forecast")]]
        for rule in RULES:
            rs = table[(threshold, rule)]
            regret = [r["regret"] for r in rs]
            iv = t_interval(regret)
            vs = (
                t_interval([a - b for a, b in zip(regret, forecast, strict=True)])
                if rule != "forecast"
                else None
            )
            rows.append(
                {
                    "threshold": threshold,
                    "rule": rule,
                    "stopped": sum(r["took"] < 1.0 for r in rs),
                    "oracle_stopped": sum(r["oracle"] < 1.0 for r in rs),
                    "right": sum(r["took"] == r["oracle"] for r in rs),
                    "regret": iv.mean,
                    "regret_low": iv.low,
                    "regret_high": iv.high,
                    "worst": max(regret),
                    "minus_forecast": None if vs is None else [vs.mean, vs.low, vs.high],
                    "vs_forecast": None
                    if vs is None
                    else "forecast better"
                    if vs.low > 0
                    else "forecast worse"
                    if vs.high < 0
                    else (
                        "equal on every curve" if vs.no_spread or vs.half == 0 else "no difference measured"
                    ),
                }
            )
    return rows


def versus(table: dict, rule: str, others: tuple[str, ...]) -> list[dict]:
    """`rule`'s regret minus each other rule's, paired by curve, with a 95% t interval over the curves."""
    out = []
    for threshold in THRESHOLDS:
        mine = [r["regret"] for r in table[(threshold, rule)]]
        for other in others:
            theirs = [r["regret"] for r in table[(threshold, other)]]
            iv = t_interval([a - b for a, b in zip(mine, theirs, strict=True)])
            out.append(
                {"threshold": threshold, "rule": rule, "other": other, "diff": [iv.mean, iv.low, iv.high]}
            )
    return out


def run() -> dict:
    curves = load()
    real = [{f: c["endings"][f]["final"] for f in (*FRACTIONS, 1.0)} for c in curves]
    modelled = [law_world(c) for c in curves]
    decisions = {(t, rule): [decide(c, rule, t) for c in curves] for t in THRESHOLDS for rule in RULES}
    errors = [m[f] - r[f] for m, r in zip(modelled, real, strict=True) for f in FRACTIONS]
    cost_errors = [
        (m[f] - m[1.0]) - (r[f] - r[1.0]) for m, r in zip(modelled, real, strict=True) for f in FRACTIONS
    ]
    return {
        "curves": [c["name"] for c in curves],
        "prefix_gap_max": max(check_prefix(c) for c in curves),
        "real": summary(table := regrets(curves, real, decisions)),
        "forecast4_vs": versus(
            table, "forecast4", ("never stop", "always 0.5", "always 0.6", "always 0.8", "forecast")
        ),
        "law_world": summary(regrets(curves, modelled, decisions)),
        "law_error_rms": float(np.sqrt(np.mean(np.square(errors)))),
        "law_cost_of_stopping_error_rms": float(np.sqrt(np.mean(np.square(cost_errors)))),
        "loss_given_up": {f"{f}": t_interval([r[f] - r[1.0] for r in real]).__dict__ for f in FRACTIONS},
    }


def fmt(row: dict) -> str:
    vs = row["minus_forecast"]
    against = "-" if vs is None else f"{vs[0]:+.1f} [{vs[1]:+.1f}, {vs[2]:+.1f}]: {row['vs_forecast']}"
    return (
        f"| {row['threshold']} | {row['rule']} | {row['stopped']}/30 ({row['oracle_stopped']}) | {row['right']}/30 | "
        f"{row['regret']:.1f} [{row['regret_low']:.1f}, {row['regret_high']:.1f}] | {row['worst']:.1f} | {against} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = run()
    head = (
        "| $/loss point | rule | stopped (oracle) | took the oracle's ending | regret $ mean [95% over curves] | "
        "worst | regret minus the forecast stopper's [95%] |\n|---|---|---|---|---|---|---|"
    )
    print(
        f"{len(res['curves'])} curves; shorter runs' pre-decay validations vs the full run's: max gap {res['prefix_gap_max']:.2e}"
    )
    print("\n## Real endings\n\n" + head)
    print("\n".join(fmt(r) for r in res["real"]))
    print("\n`forecast4` (the forecast from 4 points) minus each rule, paired by curve [95%]:\n")
    for threshold in THRESHOLDS:
        cells = [
            f"{v['other']} {v['diff'][0]:+.1f} [{v['diff'][1]:+.1f}, {v['diff'][2]:+.1f}]"
            for v in res["forecast4_vs"]
            if v["threshold"] == threshold
        ]
        print(f"- ${threshold}: " + "; ".join(cells))
    print("\n## The law's world (every ending the law fitted to the whole curve)\n\n" + head)
    print("\n".join(fmt(r) for r in res["law_world"]))
    print(
        f"\nthe law through the whole curve vs the real early endings: RMS {res['law_error_rms']:.4f}; "
        f"its cost of stopping early (ending - plan) off by RMS {res['law_cost_of_stopping_error_rms']:.4f}"
    )
    for f, iv in res["loss_given_up"].items():
        print(
            f"real loss given up by ending at {f} instead of the plan: {iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"
        )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
