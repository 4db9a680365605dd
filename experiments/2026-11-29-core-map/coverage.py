"""Out-of-sample checks of lm's loss-to-CORE map (lm.numbers.core_map) on the public testbed.

    python experiments/2026-11-29-core-map/coverage.py > experiments/2026-11-29-core-map/coverage.txt

1. prior, leave one training set out: the prior fitted on two sets predicts the third set's models.
2. calibrated, leave one set out and fit small, test large: the shape from the other two sets, the shift
   calibrated on the held-out set's models below cutoff FLOPs (its cheap ladder), tested on its models at
   cutoff and above. Only models at CORE >= SIGNAL are predicted (below, CORE is near chance).
Coverage is of the 90% interval, with a Wilson 95% interval over the test models; the models of one set share
its shift error, so the per-set rows matter more than the pooled count.
"""

import math
import sys

import numpy as np

from lm.base.exits import Refused
from lm.numbers.core_map import (
    LEVEL,
    SIGNAL,
    CoreMap,
    calibrate,
    fit_shape,
    prior_from,
    public_points,
    public_source,
)

CUTOFFS = (2e19, 6e19)
"""Calibration ladders: the held-out set's models below 2e19 or 6e19 FLOPs (1B at 20 tokens per parameter is
2.9e20, the testbed's largest 5.7e21)."""


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def check(name: str, cmap, tests) -> tuple[int, int, list[float]]:
    forecasts = [cmap.predict(p.loss) for p in tests]
    hits = sum(f.low <= p.core <= f.high for f, p in zip(forecasts, tests))
    errors = [p.core - f.core for f, p in zip(forecasts, tests)]
    e = np.array(errors)
    width = np.mean([f.high - f.low for f in forecasts]) if tests else math.nan
    rmse = math.sqrt(np.mean(e**2)) if len(e) else math.nan
    worst = float(np.max(np.abs(e))) if len(e) else math.nan
    print(
        f"  {name:<26} n={len(tests):>3}  covered {hits:>3}/{len(tests):<3}  mean error {np.mean(e):+.4f}  "
        f"RMSE {rmse:.4f}  worst {worst:.4f}  mean 90% width {width:.3f}  shift {cmap.shift:+.3f} "
        f"sd {cmap.shift_sd:.3f}"
    )
    return hits, len(tests), errors


def main(version: str, cutoff: float) -> None:
    points = public_points(version, "own")
    sets = sorted({p.group for p in points})
    print(f"CORE {version}, own-data validation loss, {len(points)} models, {public_source()}")
    print(f"SIGNAL {SIGNAL}, LEVEL {LEVEL}, calibration ladder below {cutoff:.0e} FLOPs\n")
    for title, make in (
        ("1. prior, leave one set out", "prior"),
        ("2. calibrated, fit small, test large", "cal"),
    ):
        print(title)
        total_hits = total = 0
        all_errors = []
        for held in sets:
            rest = [p for p in points if p.group != held]
            prior = prior_from(rest, version, "testbed without " + held)
            mine = [p for p in points if p.group == held]
            if make == "prior":
                cmap, tests = prior, [p for p in mine if p.core >= SIGNAL]
            else:
                ladder = [p for p in mine if p.compute < cutoff]
                try:
                    cmap = calibrate(prior, ladder, f"{held} below {cutoff:.0e}")
                except Refused as refusal:
                    print(f"  {held}: ladder {len(ladder)} models: refused: {refusal}")
                    continue
                tests = [p for p in mine if p.compute >= cutoff and p.core >= SIGNAL]
                print(f"  {held}: ladder {len(ladder)} models, {cmap.points} at CORE >= {SIGNAL}")
            h, n, e = check(held, cmap, tests)
            total_hits, total, all_errors = total_hits + h, total + n, all_errors + e
        if total == 0:
            print("  pooled: nothing to test\n")
            continue
        lo, hi = wilson(total_hits, total)
        e = np.array(all_errors)
        print(
            f"  pooled: covered {total_hits}/{total} = {total_hits / total:.2f} (Wilson 95% {lo:.2f}-{hi:.2f}), "
            f"RMSE {math.sqrt(np.mean(e**2)):.4f}, worst {np.max(np.abs(e)):.4f}\n"
        )


def small_to_large(version: str, cutoff: float) -> None:
    """3. The whole map fitted small, tested large: shape and every set's shift from the models below cutoff
    of all three sets, tested on their models at cutoff and above (the prior's in-range error is not this)."""
    points = public_points(version, "own")
    small = [p for p in points if p.compute < cutoff]
    (k, gamma, c), shifts, noise = fit_shape(small)
    print(f"3. shape and shifts fitted below {cutoff:.0e} FLOPs ({len(small)} models), tested above")
    errors = []
    for held, shift in shifts.items():
        cmap = CoreMap(k, gamma, c, shift, 0.0, noise, version, True, "small", len(small))
        _, _, e = check(
            held, cmap, [p for p in points if p.group == held and p.compute >= cutoff and p.core >= SIGNAL]
        )
        errors += e
    e = np.array(errors)
    print(
        f"  pooled: RMSE {math.sqrt(np.mean(e**2)):.4f}, worst {np.max(np.abs(e)):.4f} (noise sd {noise:.4f})\n"
    )


if __name__ == "__main__":
    for v in sys.argv[1:] or ["v1", "v2"]:
        for cutoff in CUTOFFS:
            main(v, cutoff)
            small_to_large(v, cutoff)
