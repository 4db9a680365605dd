"""Loss forecast: a saturating power law L(D) = E + B * D^(-beta) fitted to (tokens, validation loss).

E is the loss the model would reach with unlimited data, B * D^(-beta) the part more tokens still buy. The
fit is robust (Huber-weighted) so one noisy evaluation does not swing the forecast, and needs no scipy: for a
fixed beta the model is linear in (E, B), so a 1-D search over beta with weighted least squares inside finds
the global optimum of the 3-parameter problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BETA_RANGE = (0.01, 3.0)
"""Exponents searched. Language-model data exponents sit around 0.1-0.5; the bounds only keep the search finite."""


@dataclass(frozen=True)
class PowerLaw:
    """L(D) = E + B * D^(-beta), with D in tokens."""

    E: float
    B: float
    beta: float
    rms: float = 0.0
    """Root mean square residual of the fit (loss units)."""
    n_points: int = 0

    def loss(self, tokens: float | np.ndarray) -> float | np.ndarray:
        """Predicted validation loss after `tokens` tokens."""
        return self.E + self.B * np.power(np.asarray(tokens, dtype=np.float64), -self.beta)

    def slope(self, tokens: float) -> float:
        """dL/dD at `tokens` (negative: loss per extra token)."""
        return -self.beta * self.B * tokens ** (-self.beta - 1.0)

    def tokens_for(self, loss: float) -> float:
        """Tokens at which the curve reaches `loss`; inf when it never does (loss <= E)."""
        if loss <= self.E:
            return math.inf
        return (self.B / (loss - self.E)) ** (1.0 / self.beta)


def fit_power_law(
    tokens: np.ndarray | list[float],
    losses: np.ndarray | list[float],
    *,
    min_points: int = 5,
    huber: float | None = None,
    iterations: int = 10,
) -> PowerLaw | None:
    """Fit L(D) = E + B * D^(-beta) robustly; None with fewer than `min_points` usable points.

    `huber` is the residual (loss units) beyond which a point's weight falls as 1/|r|; None takes 1.5 x the
    median absolute residual of an unweighted fit (so the scale adapts to how noisy the curve is).
    Constraints: B > 0 and E >= 0 (a loss is a cross-entropy, never negative).
    """
    d = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    keep = np.isfinite(d) & np.isfinite(y) & (d > 0)
    d, y = d[keep], y[keep]
    if len(d) < max(3, min_points):
        return None
    # D / D_max keeps D^(-beta) within a few orders of magnitude of 1 for any beta: a well-conditioned solve.
    scale = d.max()
    x = d / scale
    weights = np.ones_like(y)
    best = None
    for _ in range(iterations):
        beta = search_beta(x, y, weights)
        E, b = solve_linear(x, y, weights, beta)
        residuals = y - (E + b * x ** (-beta))
        delta = huber if huber is not None else max(1.5 * float(np.median(np.abs(residuals))), 1e-6)
        new = np.minimum(1.0, delta / np.maximum(np.abs(residuals), 1e-12))
        best = (E, b, beta, residuals)
        if np.allclose(new, weights, atol=1e-4):
            break
        weights = new
    E, b, beta, residuals = best
    return PowerLaw(
        E=E,
        B=b * scale**beta,  # undo the D / D_max scaling
        beta=beta,
        rms=float(np.sqrt(np.mean(residuals**2))),
        n_points=len(d),
    )


def solve_linear(x: np.ndarray, y: np.ndarray, w: np.ndarray, beta: float) -> tuple[float, float]:
    """Weighted least squares for (E, b) in y = E + b * x^(-beta), clamped to E >= 0 and b > 0."""
    feature = x ** (-beta)
    sw = np.sqrt(w)
    A = np.stack([np.ones_like(feature), feature], axis=1) * sw[:, None]
    (E, b), *_ = np.linalg.lstsq(A, y * sw, rcond=None)
    if E < 0:  # the unconstrained optimum is infeasible: the best feasible E is on the boundary
        E = 0.0
        b = float(np.sum(w * feature * y) / np.sum(w * feature * feature))
    if b <= 0:  # a flat or rising curve: nothing left to buy, the loss is its weighted mean
        b = 1e-12
        E = float(np.sum(w * y) / np.sum(w))
    return float(E), float(b)


def weighted_sse(x: np.ndarray, y: np.ndarray, w: np.ndarray, beta: float) -> float:
    E, b = solve_linear(x, y, w, beta)
    return float(np.sum(w * (y - E - b * x ** (-beta)) ** 2))


def search_beta(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """The exponent minimising the weighted error: a log-spaced grid, then golden-section refinement."""
    grid = np.geomspace(*BETA_RANGE, 120)
    errors = [weighted_sse(x, y, w, beta) for beta in grid]
    i = int(np.argmin(errors))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    inv_phi = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(40):
        c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
        if weighted_sse(x, y, w, c) < weighted_sse(x, y, w, d):
            b = d
        else:
            a = c
    return (a + b) / 2


@dataclass(frozen=True)
class Forecast:
    """What the fitted curve says about the rest of the run, in loss and dollars."""

    fit: PowerLaw
    tokens_now: float
    loss_now: float
    """The curve's value at tokens_now (smoother than the last measured point)."""
    loss_at_plan_end: float | None
    loss_at_chinchilla: float | None
    usd_per_loss_point_next: float | None
    """Dollars the next small loss improvement costs per loss point, at the current $/token."""
    usd_per_token: float | None

    def loss_bought(self, usd: float) -> float | None:
        """Loss drop that `usd` more dollars buy at the current $/token ("another $X buys this much loss")."""
        if not self.usd_per_token:
            return None
        more = usd / self.usd_per_token
        return float(self.fit.loss(self.tokens_now) - self.fit.loss(self.tokens_now + more))


def forecast(
    fit: PowerLaw,
    tokens_now: float,
    *,
    plan_end_tokens: float | None = None,
    chinchilla_tokens: float | None = None,
    usd_per_token: float | None = None,
) -> Forecast:
    """Predictions from a fitted curve at the current point of a run."""
    marginal = None
    if usd_per_token:
        slope = fit.slope(tokens_now)
        marginal = usd_per_token / -slope if slope < 0 else math.inf
    return Forecast(
        fit=fit,
        tokens_now=tokens_now,
        loss_now=float(fit.loss(tokens_now)),
        loss_at_plan_end=float(fit.loss(plan_end_tokens)) if plan_end_tokens else None,
        loss_at_chinchilla=float(fit.loss(chinchilla_tokens)) if chinchilla_tokens else None,
        usd_per_loss_point_next=marginal,
        usd_per_token=usd_per_token,
    )
