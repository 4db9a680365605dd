"""The coverage of every interval `lm ablate` prints, measured by simulation (issue 55 item 1): at 3, 5 and 8
seeds each 95% interval covers its target within 2 points of 95%. Seeded and vectorised where it can be: a few
seconds in all.

The speed-up's world is the ladder's s128 rung (experiments/2026-11-25-ladder): final loss c + b / f at a
fraction f of the tokens (2.328 / 2.240 / 2.131 / 2.065 at 0.5 / 0.6 / 0.8 / 1.0 against the measured 2.328 /
2.270 / 2.144 / 2.065), the variant the same law at k times the tokens, each run's final off by a seed effect
shared by every run of that seed (sd 0.01) and its own noise (sd 0.012; the baseline's measured seed sd at s128
is 0.0125). The target is what the estimator reads from the noiseless means (its interpolation in log tokens
included): an interval over seeds claims seed noise only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lm.numbers.stats import mean_bound, t_interval
from lm.tools.ablate.analysis import RunResult, complete_runs
from lm.tools.ablate.spec import BASELINE, Spec

FRACTIONS = (0.5, 0.6, 0.8, 1.0)
C, B = 1.802, 0.263
SEED_SD, RUN_SD = 0.01, 0.012
REPS = 1000
TOLERANCE = 0.02
TOKENS = 1_000_000


def law(f, k: float = 1.0):
    """Final loss of a complete run at fraction f of the tokens, for an arm that needs k times the tokens."""
    return C + B * k / np.asarray(f, float)


def run(arm: str, seed: int, f: float, final: float) -> RunResult:
    return RunResult(f"{arm}-f{f}-s{seed}", arm, seed, f, "done", [1], [f * TOKENS], [final], final)


def world(n: int, side: str, k: float) -> dict:
    """The spec and arms of one simulated rung: `side` ran every fraction, the other arm its full run; the
    variant needs k times the baseline's tokens."""
    arm = "v"
    ladder_arm, other_arm = (BASELINE, arm) if side == BASELINE else (arm, BASELINE)
    return {
        "spec": Spec(name="sim", variants={arm: []}, seeds=list(range(n)), fractions={ladder_arm: list(FRACTIONS[:-1])}),
        "arm": arm, "ladder_arm": ladder_arm, "other_arm": other_arm,
        "ladder_k": 1.0 if side == BASELINE else k, "other_k": k if side == BASELINE else 1.0,
    }  # fmt: skip


def draw(w: dict, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[RunResult]]:
    """One simulated rung: the ladder's finals (seeds x fractions), the other arm's, and their run records."""
    seed = rng.normal(0, SEED_SD, size=n)
    ladder = (
        law(FRACTIONS, w["ladder_k"])[None, :] + seed[:, None] + rng.normal(0, RUN_SD, (n, len(FRACTIONS)))
    )
    other = float(law(1.0, w["other_k"])) + seed + rng.normal(0, RUN_SD, n)
    results = [run(w["ladder_arm"], s, f, ladder[s, j]) for s in range(n) for j, f in enumerate(FRACTIONS)]
    return ladder, other, results + [run(w["other_arm"], s, 1.0, other[s]) for s in range(n)]


def simulate(n: int, side: str, k: float, rng: np.random.Generator) -> float:
    """How often lm ablate's speed-up interval over n seeds holds the target (what it reads without noise)."""
    w = world(n, side, k)
    noiseless = [run(w["ladder_arm"], 0, f, float(law(f, w["ladder_k"]))) for f in FRACTIONS]
    noiseless.append(run(w["other_arm"], 0, 1.0, float(law(1.0, w["other_k"]))))
    truth = complete_runs(noiseless, w["spec"], w["arm"], w["ladder_arm"]).interval.mean
    covered = 0
    for _ in range(REPS):
        _, _, results = draw(w, n, rng)
        iv = complete_runs(results, w["spec"], w["arm"], w["ladder_arm"]).interval
        covered += iv is not None and iv.low <= truth <= iv.high
    return covered / REPS


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize(("side", "k"), [("arm", 0.61), ("arm", 0.7), (BASELINE, 1.3)])
def test_the_speedups_inverted_t_interval_covers_95_percent(n, side, k):
    """QK-norm + Muon's 0.61x read on its own complete runs (side `arm`: the crossing next to the 0.6 run, where
    a jackknife-t covered 92-93%), 0.7x, and a worse variant's 1.3x read on the baseline's runs (side
    `baseline`). The percentile bootstrap this replaces covered 83-84% at 5 seeds."""
    coverage = simulate(n, side, k, np.random.default_rng(1000 * n + int(100 * k)))
    assert abs(coverage - 0.95) <= TOLERANCE, coverage


@pytest.mark.parametrize("n", [3, 5, 8])
def test_the_paired_difference_and_the_mean_bound_cover_95_percent(n):
    """Δ final loss (paired t over seeds) and the one-sided bound of a mean of bounds, on the seed noise of the
    s128 rung: a difference's sd is the two runs' own noise (the seed effect cancels in the pair)."""
    rng = np.random.default_rng(n)
    delta, sd = -0.179, RUN_SD * math.sqrt(2)
    draws = delta + rng.normal(0, sd, size=(20_000, n))
    means, sds = draws.mean(axis=1), draws.std(axis=1, ddof=1)
    t = t_interval(list(draws[0]))  # the quantile the interval uses, checked against the library's own
    half = (t.high - t.low) / 2 / (sds[0] / math.sqrt(n))
    two_sided = np.mean(np.abs(means - delta) <= half * sds / math.sqrt(n))
    assert abs(two_sided - 0.95) <= TOLERANCE, two_sided
    upper = mean_bound(list(draws[0]), "upper")
    margin = (upper - means[0]) / (sds[0] / math.sqrt(n))
    one_sided = np.mean(means + margin * sds / math.sqrt(n) >= delta)
    assert abs(one_sided - 0.95) <= TOLERANCE, one_sided
