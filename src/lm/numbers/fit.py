"""The one robust fitter of lm: non-negative weighted least squares, exact, with Huber reweighting.

Every law lm fits is linear in non-negative coefficients once its exponents are fixed: the schedule-aware
law (lm.numbers.loss_law) in (L0, A, C) for each alpha, the Chinchilla-form law (lm.tools.calibrate) in
(E, A, B) for each (alpha, beta). So each fit is a search over exponents with `nnls` inside, and one noisy
point is kept from swinging it by iteratively reweighted least squares with Huber weights (`huber_weights`,
`robust_nnls`).

No scipy (it is no dependency of lm): with the few columns these laws have, the exact solution is cheap.
It is the unconstrained least-squares solution on its set of positive coefficients, so solving every subset
of columns (2^K - 1 of them) and keeping the best feasible one finds it; the full set, when feasible, is
optimal at once. Columns are scaled to unit norm before the normal equations are solved: a law's columns span
1 to 1e-7 (N^-alpha for N ~ 1e6), and a scaled 3 x 3 system is well conditioned.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np

HUBER_SCALE = 1.5
"""An adaptive Huber threshold is this many times the median absolute residual."""
MIN_DELTA = 1e-6
"""The adaptive threshold's floor (loss units): a curve fitted exactly still gets finite weights."""


def nnls(X: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | float]:
    """min_c sum_i w_i (X_i . c - y_i)^2 subject to every c_j >= 0, solved exactly.

    X is one design (P points, K columns) or a batch of G designs (G, P, K), each then solved on its own; y
    and w (default: all ones) are (P,) or, for a batch, (G, P). Returns the coefficients ((K,) or (G, K))
    and the weighted sum of squared residuals (a float, or (G,)).
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim == 2:
        return nnls_one(X, np.asarray(y, dtype=np.float64), None if w is None else np.asarray(w, np.float64))
    g, p, k = X.shape
    y = np.broadcast_to(np.asarray(y, dtype=np.float64), (g, p))
    sw = np.ones((g, p)) if w is None else np.sqrt(np.broadcast_to(np.asarray(w, dtype=np.float64), (g, p)))
    a, b = X * sw[:, :, None], y * sw
    norms = np.linalg.norm(a, axis=1)  # (g, k)
    norms = np.where(norms > 0, norms, 1.0)
    a = a / norms[:, None, :]
    gram = np.swapaxes(a, 1, 2) @ a
    rhs = (np.swapaxes(a, 1, 2) @ b[:, :, None])[:, :, 0]
    best, best_sse = np.zeros((g, k)), np.sum(b * b, axis=1)  # the empty set: every coefficient 0
    done = np.zeros(g, dtype=bool)
    for cols in subsets(k):
        sol = solve(gram[:, cols][:, :, cols], rhs[:, cols])
        coef = np.zeros((g, k))
        coef[:, cols] = sol
        sse = np.sum(((a @ coef[:, :, None])[:, :, 0] - b) ** 2, axis=1)
        better = ~done & np.all(sol >= 0, axis=1) & (sse < best_sse)  # NaN (a singular subset) is never >= 0
        best[better], best_sse[better] = coef[better], sse[better]
        if len(cols) == k:
            done = better  # the unconstrained solution is feasible, hence optimal
            if done.all():
                break
    return best / norms, best_sse


def nnls_one(X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> tuple[np.ndarray, float]:
    """`nnls` of one design, the same steps without the batch's bookkeeping: the schedule-aware law solves
    thousands of these per fit."""
    if w is None:
        a, b = X, y
    else:
        sw = np.sqrt(w)
        a, b = X * sw[:, None], y * sw
    norms = np.sqrt(np.einsum("pk,pk->k", a, a))
    norms[norms == 0] = 1.0
    a = a / norms
    gram, rhs = a.T @ a, a.T @ b
    best, best_sse = np.zeros(X.shape[1]), float(b @ b)
    for cols in subsets(X.shape[1]):
        try:
            sol = np.linalg.solve(gram[np.ix_(cols, cols)], rhs[cols])
        except np.linalg.LinAlgError:
            continue
        if np.all(sol >= 0):
            coef = np.zeros(X.shape[1])
            coef[cols] = sol
            r = a @ coef - b
            sse = float(r @ r)
            if sse < best_sse:
                best, best_sse = coef, sse
        if len(cols) == X.shape[1] and best_sse < b @ b:
            break  # the unconstrained solution is feasible, hence optimal
    return best / norms, best_sse


def subsets(k: int) -> list[list[int]]:
    """Every non-empty subset of k columns, the full set first, then by falling size."""
    return [list(c) for r in range(k, 0, -1) for c in itertools.combinations(range(k), r)]


def solve(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """A batch of normal equations; NaN for a singular one (a column that is zero or repeats another)."""
    try:
        return np.linalg.solve(gram, rhs[:, :, None])[:, :, 0]
    except np.linalg.LinAlgError:
        out = np.full(rhs.shape, np.nan)
        for i in range(len(rhs)):
            with contextlib.suppress(np.linalg.LinAlgError):
                out[i] = np.linalg.solve(gram[i], rhs[i])
        return out


def huber_delta(residuals: np.ndarray) -> float | np.ndarray:
    """The adaptive Huber threshold: HUBER_SCALE x the median absolute residual (per design of a batch),
    so the scale follows how noisy the curve is."""
    return np.maximum(HUBER_SCALE * np.median(np.abs(residuals), axis=-1), MIN_DELTA)


def huber_weights(residuals: np.ndarray, delta: float | np.ndarray | None = None) -> np.ndarray:
    """IRLS weights of the Huber loss: 1 within `delta` of the curve, delta / |r| beyond (a point counts
    linearly, not quadratically). `delta` None: `huber_delta` of these residuals."""
    r = np.abs(residuals)
    delta = huber_delta(r) if delta is None else delta
    return np.minimum(1.0, np.expand_dims(delta, -1) / np.maximum(r, 1e-12))


def huber_loss(residuals: np.ndarray, delta: float) -> np.ndarray:
    """Summed Huber loss over the last axis: r^2 / 2 within `delta`, delta (|r| - delta / 2) beyond."""
    r = np.abs(residuals)
    return np.sum(np.where(r <= delta, 0.5 * r**2, delta * (r - 0.5 * delta)), axis=-1)


def robust_nnls(
    X: np.ndarray, y: np.ndarray, delta: float, iterations: int = 8
) -> tuple[np.ndarray, np.ndarray | float]:
    """Non-negative Huber regression of y on X (one design or a batch, as in `nnls`) by iteratively
    reweighted least squares: `iterations` solves, each weighted by the residuals of the one before.
    Returns the coefficients and each design's Huber loss at them (the score to pick the best design by)."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = None
    for _ in range(iterations):
        coef, _ = nnls(X, y, w)
        residuals = X @ coef - y if X.ndim == 2 else (X @ coef[:, :, None])[:, :, 0] - y
        w = huber_weights(residuals, delta)
    return coef, huber_loss(residuals, delta)
