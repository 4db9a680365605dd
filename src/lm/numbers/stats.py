"""Intervals over a few seeds: how `lm ablate` tells a lever that pays from one that was lucky.

With three to five seeds the normal approximation is far too narrow (z = 1.96 against t = 4.30 at n = 3), so
every interval is Student's t (95%, two-sided; the quantiles are tabulated: scipy is no dependency of lm). A lever is compared with its baseline seed by seed where both ran the same
seed (the same data order, and the same initialisation where the shapes agree): the paired difference removes
the seed-to-seed spread the two share, which is most of it. Welch's interval serves the unpaired case.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip
"""Student's t 0.975 quantile by degrees of freedom (standard tables); 1.960 in the limit."""


def t_quantile(df: float) -> float:
    """The two-sided 95% t quantile for `df` degrees of freedom (Welch's are fractional): linear in 1/df
    between tabulated values, within 0.2% of the exact quantile for every df >= 1."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df in T975:
        return T975[int(df)]
    inverse = [1 / d for d in T975] + [0.0]
    values = [*T975.values(), 1.960]
    return float(np.interp(1 / df, inverse[::-1], values[::-1]))


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
