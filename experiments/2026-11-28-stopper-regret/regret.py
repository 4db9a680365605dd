"""The diminishing-returns stopper judged by its decisions (issue 48 item 5), replayed on held-out recorded curves.

Each curve of the two forecast ladders (tests/fixtures/ladder37, ladder20: 12 runs, wsd with a 5% warm-up and
the last 20% decayed, validation every 5%) is priced at $100 for its whole plan, dollars proportional to steps.
At each validation the stopper's rule is applied to the points seen so far, at several thresholds
(`early_stopping.max_usd_per_loss_point`), three ways:

- `window`: the stopper as configured by default: lm.callbacks.stopper.marginal_usd_per_loss_point over the
  trailing `window` = 4 validations (no smoothing);
- `window_fit`: the quieter target: the same window's least-squares slope
  (lm.numbers.loss_law.usd_per_loss_point_fit);
- `forecast`: `use_forecast=true`: the schedule law fitted to the points so far (>= 5), the price of training
  1% of the plan more before cooling down, against cooling down now (ScheduleForecast.usd_per_loss_point_now).

A stop decided at step s runs the stopper's LR cooldown (10% of s) first. What each ending would have scored
comes from the oracle's world: the schedule law fitted to the whole curve (every point from 10% on), which predicts the
final loss of a cooldown from any step. The oracle knows that curve and picks the ending (a cooldown from a
validation step, or the full plan) that minimises dollars + threshold x final loss, the trade the threshold
states. "Stopped" counts endings that spend less than the plan (a stop at 95% whose cooldown ends at the plan's
end is the plan). Regret: dollars spent past the oracle's stop, loss forgone by stopping before it, and the excess of
dollars + threshold x loss over the oracle's (always >= 0).

Also measured: one validation's noise (second differences of the stable phase, 30-75% of the run, / sqrt 6)
and what an average over the last 3 validations leaves of it.

    python experiments/2026-11-28-stopper-regret/regret.py [--json experiments/2026-11-28-stopper-regret/results.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from lm.callbacks.stopper import marginal_usd_per_loss_point
from lm.checkpoint.run_state import ValPoint
from lm.config import OptimConfig
from lm.numbers.loss_law import fit_schedule_law, schedule_forecast, usd_per_loss_point_fit
from lm.numbers.lr_schedule import multipliers

ROOT = Path(__file__).resolve().parents[2]
LADDERS = ("ladder37", "ladder20")
PLAN_USD = 100.0
THRESHOLDS = (25, 50, 100, 200, 400, 800)
"""$ per loss point, for a $100 plan (the last 20%'s decay buys ~0.2-0.5 points: $40-100 a point)."""
WINDOW = 4
COOLDOWN = 0.1
MIN_POINTS = 5
VARIANTS = ("window", "window_fit", "forecast")


def load(ladder: str) -> list[dict]:
    out = []
    for p in sorted((ROOT / "tests" / "fixtures" / ladder).glob("*.json")):
        r = json.loads(p.read_text())
        out.append(
            {
                "name": f"{ladder}/{r['name']}",
                "steps": np.asarray(r["steps"], int),
                "losses": np.asarray(r["losses"], float),
                "total": int(r["total_steps"]),
                "optim": OptimConfig(**r["optim"]),
            }
        )
    return out


def usd(step: int, total: int) -> float:
    return PLAN_USD * step / total


def cooldown_of(step: int, total: int) -> int:
    return max(0, min(math.ceil(COOLDOWN * step), total - step))


def world(curve: dict):
    """The oracle's world: the law through every point, and each ending's (dollars, final loss)."""
    optim, total = curve["optim"], curve["total"]
    plan = multipliers(optim, total)
    late = curve["steps"] >= 0.1 * total  # the warm-up transient follows no law (forecast_skip_tokens)
    law = fit_schedule_law(curve["steps"][late], curve["losses"][late], plan, min_points=3)

    def ending(step: int | None) -> tuple[float, float]:
        if step is None or step >= total:
            return usd(total, total), law.predict(plan).loss
        length = cooldown_of(step, total)
        mult = multipliers(optim, total, step + length, cooldown=(step, length))
        return usd(step + length, total), law.predict(mult).loss

    return law, ending


def decision(prices: list[tuple[int, float | None]], threshold: float) -> int | None:
    """The validation step at which the stopper decides to stop (None: it runs the plan)."""
    return next((step for step, price in prices if price is not None and price > threshold), None)


def prices(curve: dict, variant: str) -> list[tuple[int, float | None]]:
    """The price of a loss point the stopper reads at each validation before the plan's end."""
    optim, total = curve["optim"], curve["total"]
    out = []
    plan = multipliers(optim, total)
    points = []
    for step, loss in zip(curve["steps"], curve["losses"], strict=True):
        step = int(step)
        points.append(ValPoint(step, step, usd(step, total), float(loss), float(loss)))
        if step >= total:
            break
        if variant == "window":
            price = marginal_usd_per_loss_point(points, WINDOW)
        elif variant == "window_fit":
            recent = points[-1 - WINDOW :] if len(points) > WINDOW else []
            price = (
                usd_per_loss_point_fit([p.usd for p in recent], [p.loss for p in recent]) if recent else None
            )
        else:
            law = fit_schedule_law(
                [p.step for p in points], [p.loss for p in points], plan, min_points=MIN_POINTS
            )
            if law is None:
                price = None
            else:
                sf = schedule_forecast(law, optim, total, step, math.ceil(COOLDOWN * step), total)
                price = sf.choices(points[-1].usd, PLAN_USD / total)["usd_per_loss_point_now"]
        out.append((step, price))
    return out


def noise(curve: dict) -> float:
    """One validation's noise: second differences over the stable phase (30-75% of the run), sd / sqrt 6."""
    f = curve["steps"] / curve["total"]
    y = curve["losses"][(f >= 0.3) & (f <= 0.75)]
    return float(np.std(np.diff(y, 2), ddof=1) / math.sqrt(6))


def run() -> dict:
    curves = [c for ladder in LADDERS for c in load(ladder)]
    rows = []
    for c in curves:
        law, ending = world(c)
        candidates = [int(s) for s in c["steps"] if s < c["total"]] + [None]
        read = {v: prices(c, v) for v in VARIANTS}
        for threshold in THRESHOLDS:
            score = {s: ending(s)[0] + threshold * ending(s)[1] for s in candidates}
            oracle = min(candidates, key=lambda s: score[s])
            o_usd, o_loss = ending(oracle)
            for variant in VARIANTS:
                stop = decision(read[variant], threshold)
                s_usd, s_loss = ending(stop)
                rows.append(
                    {
                        "curve": c["name"],
                        "threshold": threshold,
                        "variant": variant,
                        "stop": stop,
                        "oracle": oracle,
                        "stopped_early": s_usd < PLAN_USD - 1e-9,
                        "oracle_early": o_usd < PLAN_USD - 1e-9,
                        "usd": s_usd,
                        "oracle_usd": o_usd,
                        "usd_past_oracle": max(0.0, s_usd - o_usd),
                        "loss_forgone": max(0.0, s_loss - o_loss),
                        "regret_usd": s_usd + threshold * s_loss - (o_usd + threshold * o_loss),
                        "law_rms": law.rms,
                    }
                )
    table = []
    for threshold in THRESHOLDS:
        for variant in VARIANTS:
            rs = [r for r in rows if r["threshold"] == threshold and r["variant"] == variant]
            table.append(
                {
                    "threshold": threshold,
                    "variant": variant,
                    "curves": len(rs),
                    "stopped": sum(r["stopped_early"] for r in rs),
                    "oracle_stopped": sum(r["oracle_early"] for r in rs),
                    "usd_past_oracle": float(np.mean([r["usd_past_oracle"] for r in rs])),
                    "loss_forgone": float(np.mean([r["loss_forgone"] for r in rs])),
                    "regret_usd": float(np.mean([r["regret_usd"] for r in rs])),
                    "worst_regret_usd": float(max(r["regret_usd"] for r in rs)),
                }
            )
    sigmas = {c["name"]: noise(c) for c in curves}
    return {
        "rows": rows,
        "table": table,
        "noise": sigmas,
        "law_rms": {c["name"]: r["law_rms"] for c in curves for r in rows if r["curve"] == c["name"]},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = run()
    print(
        "| $/loss point | stopper | stopped (oracle) | $ past the oracle's stop | loss forgone | regret $ mean / worst |"
    )
    print("|---|---|---|---|---|---|")
    for t in res["table"]:
        print(
            f"| {t['threshold']} | {t['variant']} | {t['stopped']}/{t['curves']} ({t['oracle_stopped']}) | "
            f"{t['usd_past_oracle']:.1f} | {t['loss_forgone']:.3f} | {t['regret_usd']:.1f} / {t['worst_regret_usd']:.1f} |"
        )
    s = np.array(list(res["noise"].values()))
    print(
        f"\none validation's noise (stable phase, 12 curves): median {np.median(s):.4f}, range "
        f"{s.min():.4f}-{s.max():.4f}; an average of the last 3: median {np.median(s) / math.sqrt(3):.4f}"
    )
    r = np.array(list(res["law_rms"].values()))
    print(f"the oracle's law through every point: rms {np.median(r):.4f} median, {r.max():.4f} worst")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
