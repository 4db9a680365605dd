"""Intervals over a few seeds: how `lm ablate` tells a lever that pays from one that was lucky.

With three to five seeds the normal approximation is far too narrow (z = 1.96 against t = 4.30 at n = 3), so
every interval is Student's t (95%, two-sided, scipy's exact quantiles). A lever is compared with its baseline
seed by seed where both ran the same
seed (the same data order, and the same initialisation where the shapes agree): the paired difference removes
the seed-to-seed spread the two share, which is most of it. Welch's interval serves the unpaired case, its p
with Welch-Satterthwaite's degrees of freedom.

A seed whose value is not finite (a diverged run) has no difference to take: it leaves the comparison, and the
caller lists it; every interval drops such a value and counts it (`Interval.dropped`), and a bound refuses it. A
value known only as a bound (a seed that never reached a target) is never averaged as if observed: `mean_bound`
gives the one-sided bound of the mean those bounds imply. Seeds that all give the same value (a seed that is
never applied) have no spread to test against: `NO_SPREAD`, never p = 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from lm.base.exits import Refused


def t_quantile(df: float, level: float = 0.95) -> float:
    """The two-sided `level` Student t quantile for `df` degrees of freedom (Welch's are fractional): exact,
    from scipy."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    return float(stats.t.ppf(0.5 + level / 2, df))


NO_SPREAD = "no seed spread"
"""The verdict when two or more seeds give exactly the same value: no test is possible (the seed may not have
been applied), so there is no p and no win."""


SPREAD_EPS = 1e-12
"""A half-width at most this (relative to the mean, at least 1) is float rounding, not a spread of seeds."""


def finite_values(values: Sequence[float]) -> tuple[list[float], int]:
    """The finite values, and how many were not (a diverged seed's inf, a NaN)."""
    xs = [float(v) for v in values]
    kept = [x for x in xs if math.isfinite(x)]
    return kept, len(xs) - len(kept)


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided confidence interval; `low == high == mean` with a single value, or with values
    that are all equal (`no_spread`)."""

    mean: float
    low: float
    high: float
    n: int
    df: float | None = None
    """Degrees of freedom of the t the interval was built with (n - 1 unless Welch's); None: not a t interval."""
    dropped: int = 0
    """Values left out because they were not finite (counted, never averaged in)."""

    @property
    def half(self) -> float:
        return (self.high - self.low) / 2

    @property
    def no_spread(self) -> bool:
        """Two or more values and no spread among them beyond float rounding (a shift added to each value
        leaves ~1e-16 of it): nothing to test a difference against."""
        return self.n >= 2 and self.half <= SPREAD_EPS * max(1.0, abs(self.mean))

    def __str__(self) -> str:
        if self.no_spread:
            return f"{self.mean:.4f} ({NO_SPREAD})"
        return f"{self.mean:.4f} ± {self.half:.4f}" if self.n > 1 else f"{self.mean:.4f} (1 seed)"


def t_interval(values: Sequence[float]) -> Interval | None:
    """Student's t interval of the mean of the finite `values` (the others counted in `dropped`); None when
    none is finite."""
    xs, dropped = finite_values(values)
    if not xs:
        return None
    mean = math.fsum(xs) / len(xs)
    if len(xs) == 1:
        return Interval(mean, mean, mean, 1, dropped=dropped)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    half = t_quantile(len(xs) - 1) * sd / math.sqrt(len(xs))
    return Interval(mean, mean - half, mean + half, len(xs), len(xs) - 1, dropped)


def welch_interval(a: Sequence[float], b: Sequence[float]) -> Interval | None:
    """Interval of mean(a) - mean(b) for independent samples (Welch-Satterthwaite degrees of freedom), over
    each side's finite values (the others counted in `dropped`)."""
    (a, drop_a), (b, drop_b) = finite_values(a), finite_values(b)
    dropped = drop_a + drop_b
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = math.fsum(a) / len(a), math.fsum(b) / len(b)
    va = math.fsum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = math.fsum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(va + vb)
    n = min(len(a), len(b))
    if se == 0:
        return Interval(ma - mb, ma - mb, ma - mb, n, len(a) + len(b) - 2, dropped)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(df) * se
    return Interval(ma - mb, ma - mb - half, ma - mb + half, n, df, dropped)


def finite(values: dict[int, float]) -> dict[int, float]:
    """The seeds whose value is a finite number (a diverged run's inf or a NaN leaves)."""
    return {s: v for s, v in values.items() if math.isfinite(v)}


def difference(variant: dict[int, float], baseline: dict[int, float]) -> tuple[Interval | None, str]:
    """Interval of variant - baseline, and how it was formed: paired over the seeds both have with finite
    values (two or more), else Welch over each arm's finite values. A non-finite value of either arm leaves
    (an inf - inf has no meaning, and one inf made every mean inf and every interval NaN)."""
    variant, baseline = finite(variant), finite(baseline)
    shared = sorted(set(variant) & set(baseline))
    if len(shared) >= 2:
        return t_interval([variant[s] - baseline[s] for s in shared]), "paired"
    return welch_interval(list(variant.values()), list(baseline.values())), "welch"


def verdict(diff: Interval | None, lower_is_better: bool = True) -> str:
    """`wins`, `loses` or `within noise` from the interval of a difference (variant - baseline); `NO_SPREAD`
    when every seed gave the same difference."""
    if diff is None or diff.n < 2:
        return "too few seeds"
    if diff.no_spread:
        return NO_SPREAD
    if diff.high < 0:
        return "wins" if lower_is_better else "loses"
    if diff.low > 0:
        return "loses" if lower_is_better else "wins"
    return "within noise"


def p_value(diff: Interval | None) -> float | None:
    """Two-sided p of "no difference" for a difference interval formed by `difference`, with the degrees of
    freedom its interval was built with (a paired difference's n - 1; Welch-Satterthwaite's for Welch's).
    None with fewer than two values, and with no spread among them (no test: `NO_SPREAD`, never p = 0)."""
    if diff is None or diff.n < 2 or diff.no_spread:
        return None
    df = diff.df if diff.df is not None else diff.n - 1
    se = diff.half / t_quantile(df)
    return float(2 * stats.t.sf(abs(diff.mean) / se, df))


def holm(p_values: dict[str, float | None]) -> dict[str, float | None]:
    """Holm's step-down adjustment of several comparisons' p values (family-wise error at the chosen level):
    the k-th smallest of m is multiplied by m - k + 1, kept monotone, capped at 1. None (no test) stays None;
    a NaN is refused: sorted among numbers it lands anywhere and silently reorders the family."""
    bad = sorted(name for name, p in p_values.items() if p is not None and not 0 <= p <= 1)
    if bad:
        raise Refused(
            f"Holm's correction got p values that are not in [0, 1] for {bad}: a comparison took a non-finite "
            "value (a diverged seed) into its test; leave such seeds out of the difference first "
            "(lm.numbers.stats.difference does) and list them beside the row"
        )
    known = sorted((p, name) for name, p in p_values.items() if p is not None)
    adjusted: dict[str, float | None] = {name: None for name, p in p_values.items() if p is None}
    running = 0.0
    for k, (p, name) in enumerate(known):
        running = max(running, min(1.0, (len(known) - k) * p))
        adjusted[name] = running
    return adjusted


def holm_verdict(diff: Interval | None, p_adjusted: float | None, alpha: float = 0.05) -> str:
    """`wins` / `loses` when the Holm-adjusted p is below `alpha` (lower is better), else `within noise`;
    `NO_SPREAD` when every seed gave the same difference."""
    if diff is not None and diff.no_spread:
        return NO_SPREAD
    if diff is None or diff.n < 2 or p_adjusted is None:
        return "too few seeds"
    if p_adjusted >= alpha:
        return "within noise"
    return "wins" if diff.mean < 0 else "loses"


def crossing_interval(
    x: Sequence[float],
    curves: np.ndarray,
    targets: Sequence[float],
    at: float,
    level: float = 0.95,
    grid: int = 4001,
) -> tuple[float, float, bool, bool] | None:
    """Where the seeds' mean curve crosses their mean target, with its `level` interval: each seed's curve is
    piecewise linear through `curves[seed]` at the points `x` (increasing), and the interval is every x on the
    component holding the estimate `at` at which a paired t test over seeds does not reject "the mean curve
    equals the mean target" (Fieller's test inversion). At a fixed x the interpolation is linear in the losses,
    so each seed's curve minus its target is one value per seed and the test is Student's: the interval's
    coverage is exact under normal seed noise at any seed count, the interpolation's kinks included (a
    jackknife-t covered 92-93% with the crossing next to a point, a percentile bootstrap 83-84%; measured in
    tests/numbers/test_coverage.py and experiments/2026-11-28-audit). Returns (low, high, low_open,
    high_open): an open end reached the first or last point still not rejected, so past it the interval is
    only a bound. None with fewer than two seeds or a value that is not finite."""
    xs = np.asarray(x, float)
    ys, ts = np.asarray(curves, float), np.asarray(targets, float)
    n = len(ts)
    if n < 2 or ys.shape != (n, len(xs)) or not (np.isfinite(ys).all() and np.isfinite(ts).all()):
        return None
    g = np.linspace(xs[0], xs[-1], grid)
    d = np.stack([np.interp(g, xs, row) for row in ys]) - ts[:, None]  # (seeds, grid)
    mean, sd = d.mean(axis=0), d.std(axis=0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(sd > 0, np.abs(mean) * math.sqrt(n) / sd, np.where(mean == 0, 0.0, np.inf))
    accept = t <= t_quantile(n - 1, level)
    i = int(np.clip(np.searchsorted(g, at), 0, grid - 1))
    if not accept[i]:  # the estimate sits between grid points on a steep stretch: take the nearest accepted
        i = int(np.argmin(np.where(accept, np.abs(g - at), np.inf))) if accept.any() else i
        if not accept[i]:
            return float(at), float(at), False, False
    lo = hi = i
    while lo > 0 and accept[lo - 1]:
        lo -= 1
    while hi < grid - 1 and accept[hi + 1]:
        hi += 1
    return float(g[lo]), float(g[hi]), lo == 0, hi == grid - 1


def percentile_interval(values: Sequence[float], estimate: float, level: float = 0.95) -> Interval:
    """A bootstrap's percentile interval around `estimate`, over the finite draws (the others counted in
    `dropped`; refused when none is finite)."""
    xs, dropped = finite_values(values)
    if not xs:
        raise Refused(
            f"a bootstrap's {len(values)} draws are all not finite: no interval; look for a diverged seed"
        )
    lo, hi = np.quantile(np.asarray(xs, dtype=float), [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(estimate), float(lo), float(hi), len(xs), dropped=dropped)


def mean_bound(values: Sequence[float], side: str, level: float = 0.95) -> float | None:
    """The one-sided `level` confidence bound of the mean of values that are themselves bounds: `upper` when
    each is an upper bound on its seed's true value (the true mean is then below the bounds' mean, so the
    bounds' upper confidence limit is one for it too), `lower` the mirror. None for fewer than two values; a
    value that is not finite is refused (a bound of inf or NaN says nothing about the mean)."""
    xs, dropped = finite_values(values)
    if dropped:
        raise Refused(
            f"mean_bound got {dropped} value(s) that are not finite among {len(values)}: leave diverged seeds "
            "out of the bounds first and list them"
        )
    if len(xs) < 2:
        return None
    mean = math.fsum(xs) / len(xs)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    margin = float(stats.t.ppf(level, len(xs) - 1)) * sd / math.sqrt(len(xs))
    if side == "upper":
        return mean + margin
    if side == "lower":
        return mean - margin
    raise ValueError(f"side must be 'upper' or 'lower', got {side!r}")
