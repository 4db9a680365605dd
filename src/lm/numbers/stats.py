"""Intervals over a few seeds: how `lm ablate` tells a lever that pays from one that was lucky.

With three to five seeds the normal approximation is far too narrow (z = 1.96 against t = 4.30 at n = 3), so
every interval is Student's t (95%, two-sided, scipy's exact quantiles). A lever is compared with its baseline
seed by seed where both ran the same
seed (the same data order, and the same initialisation where the shapes agree): the paired difference removes
the seed-to-seed spread the two share, which is most of it. Welch's interval serves the unpaired case.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


def t_quantile(df: float, level: float = 0.95) -> float:
    """The two-sided `level` Student t quantile for `df` degrees of freedom (Welch's are fractional): exact,
    from scipy."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    return float(stats.t.ppf(0.5 + level / 2, df))


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided confidence interval; `low == high == mean` with a single value (no spread)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.half:.4f}" if self.n > 1 else f"{self.mean:.4f} (1 seed)"


def t_interval(values: Sequence[float]) -> Interval | None:
    """Student's t interval of the mean of `values`; None for no values."""
    xs = [float(v) for v in values]
    if not xs:
        return None
    mean = math.fsum(xs) / len(xs)
    if len(xs) == 1:
        return Interval(mean, mean, mean, 1)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    half = t_quantile(len(xs) - 1) * sd / math.sqrt(len(xs))
    return Interval(mean, mean - half, mean + half, len(xs))


def welch_interval(a: Sequence[float], b: Sequence[float]) -> Interval | None:
    """Interval of mean(a) - mean(b) for independent samples (Welch-Satterthwaite degrees of freedom)."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = math.fsum(a) / len(a), math.fsum(b) / len(b)
    va = math.fsum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = math.fsum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(ma - mb, ma - mb, ma - mb, min(len(a), len(b)))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(df) * se
    return Interval(ma - mb, ma - mb - half, ma - mb + half, min(len(a), len(b)))


def difference(variant: dict[int, float], baseline: dict[int, float]) -> tuple[Interval | None, str]:
    """Interval of variant - baseline, and how it was formed: paired over the seeds both have (two or more),
    else Welch over all values."""
    shared = sorted(set(variant) & set(baseline))
    if len(shared) >= 2:
        return t_interval([variant[s] - baseline[s] for s in shared]), "paired"
    return welch_interval(list(variant.values()), list(baseline.values())), "welch"


def verdict(diff: Interval | None, lower_is_better: bool = True) -> str:
    """`wins`, `loses` or `within noise` from the interval of a difference (variant - baseline)."""
    if diff is None or diff.n < 2:
        return "too few seeds"
    if diff.high < 0:
        return "wins" if lower_is_better else "loses"
    if diff.low > 0:
        return "loses" if lower_is_better else "wins"
    return "within noise"


def p_value(diff: Interval | None) -> float | None:
    """Two-sided p of "no difference" for a difference interval formed by `difference` (t with n - 1 degrees
    of freedom; a paired difference's n is its seed count). None with fewer than two values."""
    if diff is None or diff.n < 2:
        return None
    if diff.half == 0:
        return 0.0 if diff.mean != 0 else 1.0
    se = diff.half / t_quantile(diff.n - 1)
    return float(2 * stats.t.sf(abs(diff.mean) / se, diff.n - 1))


def holm(p_values: dict[str, float | None]) -> dict[str, float | None]:
    """Holm's step-down adjustment of several comparisons' p values (family-wise error at the chosen level):
    the k-th smallest of m is multiplied by m - k + 1, kept monotone, capped at 1."""
    known = sorted((p, name) for name, p in p_values.items() if p is not None)
    adjusted: dict[str, float | None] = {name: None for name, p in p_values.items() if p is None}
    running = 0.0
    for k, (p, name) in enumerate(known):
        running = max(running, min(1.0, (len(known) - k) * p))
        adjusted[name] = running
    return adjusted


def holm_verdict(diff: Interval | None, p_adjusted: float | None, alpha: float = 0.05) -> str:
    """`wins` / `loses` when the Holm-adjusted p is below `alpha` (lower is better), else `within noise`."""
    if diff is None or diff.n < 2 or p_adjusted is None:
        return "too few seeds"
    if p_adjusted >= alpha:
        return "within noise"
    return "wins" if diff.mean < 0 else "loses"


def percentile_interval(values: Sequence[float], estimate: float, level: float = 0.95) -> Interval:
    """A bootstrap's percentile interval around `estimate`."""
    lo, hi = np.quantile(np.asarray(values, dtype=float), [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(estimate), float(lo), float(hi), len(values))
