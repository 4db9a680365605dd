"""A lever's gain across a ladder of shapes, fitted against model size and carried to a larger config.

The gain is the tokens ratio (tokens to the baseline's final loss, over the baseline's), seed by seed at each
shape. The trend is a line in log(non-embedding parameters) through the shapes' means; its interval is a
bootstrap that resamples each shape's seeds, so it carries the seed noise of every rung but not the doubt
about the line itself (three rungs cannot test that): the extrapolation is labelled so wherever it appears.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lm.numbers.stats import Interval, percentile_interval
from lm.tools.ablate.analysis import ArmRow
from lm.tools.ablate.spec import BASELINE

BOOTSTRAP = 4000


@dataclass
class Trend:
    """One arm's tokens ratio against model size, and where the line lands at the target size."""

    arm: str
    params: list[int]
    means: list[float]
    slope: Interval
    """Change of the tokens ratio per e-fold of non-embedding parameters."""
    at_target: Interval
    target_params: int
    flops_ratio_at_target: float | None = None
    usd_at_target: Interval | None = None
    direction: str = "holds"
    per_shape: dict[str, Interval | None] = field(default_factory=dict)


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def direction(slope: Interval) -> str:
    """The gain (1 - ratio) `grows` when the ratio falls with size (the slope's interval below 0), `shrinks`
    when it rises (above 0), else `holds` (within noise)."""
    if slope.high < 0:
        return "grows"
    if slope.low > 0:
        return "shrinks"
    return "holds"


def trend(
    arm: str, rows_by_shape: dict[str, list[ArmRow]], target_params: int, flops_ratio_at_target: float | None,
    seed: int = 0,
) -> Trend | None:  # fmt: skip
    """The arm's trend over the shapes where it has per-seed ratios (at least two shapes), else None."""
    rungs = []
    for shape, rows in rows_by_shape.items():
        row = next((r for r in rows if r.arm == arm), None)
        if row is not None and len(row.tokens.per_seed) >= 1:
            rungs.append((shape, row.params, np.array(list(row.tokens.per_seed.values()))))
    if len(rungs) < 2 or len({p for _, p, _ in rungs}) < 2:
        return None
    rungs.sort(key=lambda r: r[1])
    x = np.log([p for _, p, _ in rungs])
    means = np.array([v.mean() for _, _, v in rungs])
    intercept, slope = fit_line(x, means)
    x_target = math.log(target_params)
    rng = np.random.default_rng(seed)
    slopes, preds = np.empty(BOOTSTRAP), np.empty(BOOTSTRAP)
    for i in range(BOOTSTRAP):
        resampled = np.array([rng.choice(v, size=len(v)).mean() for _, _, v in rungs])
        b0, b1 = fit_line(x, resampled)
        slopes[i], preds[i] = b1, b0 + b1 * x_target
    slope_ci = percentile_interval(slopes, slope)
    at_target = percentile_interval(preds, intercept + slope * x_target)
    usd = None
    if flops_ratio_at_target is not None:
        usd = percentile_interval(preds * flops_ratio_at_target, at_target.mean * flops_ratio_at_target)
    per_shape = {}
    for shape, rows in rows_by_shape.items():
        row = next((r for r in rows if r.arm == arm), None)
        per_shape[shape] = row.tokens.interval if row else None
    return Trend(
        arm, [p for _, p, _ in rungs], [float(m) for m in means], slope_ci, at_target, target_params,
        flops_ratio_at_target, usd, direction(slope_ci), per_shape,
    )  # fmt: skip


def trends(
    rows_by_shape: dict[str, list[ArmRow]], arms: list[str], target_params: int,
    flops_at_target: dict[str, float | None],
) -> list[Trend]:  # fmt: skip
    """Every variant's trend (the baseline's ratio is 1 by construction)."""
    found = []
    for arm in arms:
        if arm == BASELINE:
            continue
        t = trend(arm, rows_by_shape, target_params, flops_at_target.get(arm))
        if t is not None:
            found.append(t)
    return found
