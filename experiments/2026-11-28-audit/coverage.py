"""Coverage of three 95% intervals for lm ablate's speed-up, by simulation (issue 55 item 1).

    python experiments/2026-11-28-audit/coverage.py        # ~6 min on 2 shared CPU cores; writes coverage.json

The world is tests/numbers/test_coverage.py's (the ladder's s128 rung: final loss c + b k / f at a fraction f of
the tokens, a seed effect sd 0.01 shared by the seed's runs, run noise sd 0.012). Compared: the percentile
bootstrap over seeds lm ablate used until issue 55 (1,000 draws), a jackknife-t (the audit's suggestion), and
the paired t test inverted over seeds that lm ablate uses now (lm.numbers.stats.crossing_interval).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from lm.numbers.stats import t_quantile
from lm.tools.ablate.analysis import baseline_tokens_for, complete_runs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "numbers"))
from test_coverage import BASELINE, FRACTIONS, draw, law, world

REPS, DRAWS = 2000, 1000


def point(ladder: np.ndarray, other: np.ndarray, side: str) -> float:
    """complete_runs' estimate from the chosen seeds' rows: the ladder's mean finals against the other arm's mean
    full final, linear in log tokens (lm.tools.ablate.analysis.baseline_tokens_for)."""
    at, _ = baseline_tokens_for(list(zip(FRACTIONS, ladder.mean(axis=0), strict=True)), float(other.mean()))
    return 1.0 / at if side == BASELINE else at


def coverage(n: int, side: str, k: float, rng: np.random.Generator) -> dict[str, float]:
    w = world(n, side, k)
    truth = point(law(FRACTIONS, w["ladder_k"])[None, :], np.array([float(law(1.0, w["other_k"]))]), side)
    hits = {"percentile bootstrap": 0, "jackknife-t": 0, "inverted paired t (lm ablate)": 0}
    for _ in range(REPS):
        ladder, other, results = draw(w, n, rng)
        iv = complete_runs(results, w["spec"], w["arm"], w["ladder_arm"]).interval
        hits["inverted paired t (lm ablate)"] += iv.low <= truth <= iv.high
        est = point(ladder, other, side)
        assert abs(est - iv.mean) < 1e-9  # the same estimate lm ablate prints
        keep = [np.array([j for j in range(n) if j != i]) for i in range(n)]
        loo = np.array([point(ladder[c], other[c], side) for c in keep])
        half = t_quantile(n - 1) * math.sqrt((n - 1) / n * ((loo - loo.mean()) ** 2).sum())
        hits["jackknife-t"] += est - half <= truth <= est + half
        draws = [point(ladder[c], other[c], side) for c in rng.integers(0, n, size=(DRAWS, n))]
        lo, hi = np.quantile(draws, [0.025, 0.975])
        hits["percentile bootstrap"] += lo <= truth <= hi
    return {name: h / REPS for name, h in hits.items()}


if __name__ == "__main__":
    out = {}
    for side, k in [("arm", 0.61), ("arm", 0.7), (BASELINE, 1.3)]:
        for n in (3, 5, 8):
            got = coverage(n, side, k, np.random.default_rng(n + int(100 * k)))
            out[f"{side} k={k} n={n}"] = got
            print(
                f"{side:8s} k={k:<4} n={n}: " + ", ".join(f"{m} {c:.3f}" for m, c in got.items()), flush=True
            )
    (Path(__file__).parent / "coverage.json").write_text(json.dumps(out, indent=1) + "\n")
