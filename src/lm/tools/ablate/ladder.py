"""A lever's gain across a ladder of shapes, fitted against model size and carried to a larger config.

Two quantities, each seed by seed at each shape: the difference in final loss to the baseline (paired), and the
tokens ratio where every seed of a rung is measured (a speed-up from the baseline's complete runs, or the arm's
own shorter runs; a rung with bounded seeds stays out of the fit and is named). The trend is a line in
log(non-embedding parameters) through the shapes' means; its interval a bootstrap that resamples each shape's
seeds, so it carries the seed noise of every rung but not the doubt about the line itself. That doubt is shown
instead: beside the fit on every rung, the fit without each rung in turn and the fit on the largest rungs;
"grows / holds / shrinks" is said only where they all agree. A rung whose LR grid may cost more loss than the
effects it compares is named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lm.numbers.stats import Interval, percentile_interval
from lm.tools.ablate.analysis import MEASURED, ArmRow
from lm.tools.ablate.spec import BASELINE

BOOTSTRAP = 4000
TOKENS, DELTA = "tokens ratio", "Δ final loss"
DISAGREE = "fits disagree"


@dataclass
class Fit:
    """One line through some of the rungs."""

    label: str
    rungs: list[str]
    slope: Interval
    """Change of the quantity per e-fold of non-embedding parameters."""
    at_target: Interval
    direction: str


NEAR_TARGET = 3.0
"""How far past the largest rung (in non-embedding parameters) a trend's line may be carried and stated: beyond
it (plan_1b is ~900x the CPU ladder's largest rung) the report says the target is unmeasured rather than print
an extrapolation over decades as a value (issue 55)."""


@dataclass
class Trend:
    """One arm's quantity against model size, and where the lines land at the target size."""

    arm: str
    quantity: str
    shapes: list[str]
    params: list[int]
    means: list[float]
    slope: Interval
    """The fit on every rung."""
    at_target: Interval
    target_params: int
    flops_ratio_at_target: float | None = None
    usd_at_target: Interval | None = None
    direction: str = "holds"
    """The fits' common direction, or DISAGREE."""
    fits: list[Fit] = field(default_factory=list)
    """Every fit: all rungs first, then each rung left out, then the largest rungs."""
    flagged: list[str] = field(default_factory=list)
    """Rungs whose LR grid may cost more loss than the effects they compare."""
    left_out: list[str] = field(default_factory=list)
    """Rungs without a value for every seed (bounded tokens ratios): not in any fit."""

    @property
    def near_target(self) -> bool:
        """The target is within `NEAR_TARGET` x the largest rung: only then is a value there stated."""
        return self.target_params <= NEAR_TARGET * max(self.params)


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def direction(slope: Interval) -> str:
    """The gain (a lower ratio or Δ is better) `grows` when the quantity falls with size (the slope's interval
    below 0), `shrinks` when it rises (above 0), else `holds` (within noise)."""
    if slope.high < 0:
        return "grows"
    if slope.low > 0:
        return "shrinks"
    return "holds"


def rung_values(row: ArmRow, quantity: str) -> np.ndarray | None:
    """The row's per-seed values of `quantity`, or None where a seed is missing or only bounded."""
    if quantity == DELTA:
        values = list(row.delta_per_seed.values())
    else:
        statuses = set(row.tokens.status.values())
        values = list(row.tokens.per_seed.values()) if statuses == {MEASURED} else []
    return np.array(values) if values else None


def subsets(names: list[str]) -> list[tuple[str, list[int]]]:
    """(label, rung indices) of every fit: all rungs, each left out (with three or more), the largest half
    (at least two; with three rungs it is the fit without the smallest, labelled both ways once)."""
    n = len(names)
    found = [("all rungs", list(range(n)))]
    if n >= 3:
        found += [(f"without {names[i]}", [j for j in range(n) if j != i]) for i in range(n)]
        largest = list(range(n - max(2, math.ceil(n / 2)), n))
        if largest != found[1][1]:
            found.append((f"largest {len(largest)}", largest))
        else:
            found[1] = (f"{found[1][0]} (the largest {len(largest)})", largest)
    return found


def trend(
    arm: str, rows_by_shape: dict[str, list[ArmRow]], target_params: int, flops_ratio_at_target: float | None,
    seed: int = 0, quantity: str = TOKENS,
) -> Trend | None:  # fmt: skip
    """The arm's trend of `quantity` over the shapes where every seed has a value (at least two shapes)."""
    rungs, left_out, flagged = [], [], []
    for shape, rows in rows_by_shape.items():
        if any(r.lr_flag for r in rows):
            flagged.append(shape)
        row = next((r for r in rows if r.arm == arm), None)
        if row is None:
            continue
        values = rung_values(row, quantity)
        if values is None:
            left_out.append(shape)
        else:
            rungs.append((shape, row.params, values))
    if len(rungs) < 2 or len({p for _, p, _ in rungs}) < 2:
        return None
    rungs.sort(key=lambda r: r[1])
    names = [n for n, _, _ in rungs]
    x = np.log([p for _, p, _ in rungs])
    means = np.array([v.mean() for _, _, v in rungs])
    x_target = math.log(target_params)
    rng = np.random.default_rng(seed)
    resampled = np.array([[rng.choice(v, size=len(v)).mean() for _, _, v in rungs] for _ in range(BOOTSTRAP)])
    fits, preds_all = [], None
    for label, idx in subsets(names):
        intercept, slope = fit_line(x[idx], means[idx])
        slopes, preds = np.empty(BOOTSTRAP), np.empty(BOOTSTRAP)
        for i in range(BOOTSTRAP):
            b0, b1 = fit_line(x[idx], resampled[i, idx])
            slopes[i], preds[i] = b1, b0 + b1 * x_target
        slope_ci = percentile_interval(slopes, slope)
        at = percentile_interval(preds, intercept + slope * x_target)
        fits.append(Fit(label, [names[i] for i in idx], slope_ci, at, direction(slope_ci)))
        preds_all = preds if preds_all is None else preds_all
    directions = {f.direction for f in fits}
    usd = None
    if flops_ratio_at_target is not None and quantity == TOKENS:
        full = fits[0].at_target
        usd = percentile_interval(preds_all * flops_ratio_at_target, full.mean * flops_ratio_at_target)
    return Trend(
        arm, quantity, names, [p for _, p, _ in rungs], [float(m) for m in means], fits[0].slope,
        fits[0].at_target, target_params, flops_ratio_at_target, usd,
        directions.pop() if len(directions) == 1 else DISAGREE, fits, flagged, left_out,
    )  # fmt: skip


def trends(
    rows_by_shape: dict[str, list[ArmRow]], arms: list[str], target_params: int,
    flops_at_target: dict[str, float | None],
) -> list[Trend]:  # fmt: skip
    """Every variant's trends: Δ final loss, and the tokens ratio where rungs measure it (the baseline's is 1)."""
    found = []
    for arm in arms:
        if arm == BASELINE:
            continue
        for quantity in (DELTA, TOKENS):
            t = trend(arm, rows_by_shape, target_params, flops_at_target.get(arm), quantity=quantity)
            if t is not None:
                found.append(t)
    return found
