"""The loss laws of lm, in one place.

The schedule-aware law, the run's loss forecast (Tissue et al. 2024, "Scaling Law with Learning Rate
Annealing"):

    L(s) = L0 + A * S1(s)^(-alpha) - C * S2(s)

S1 is the forward area, the summed LR multiplier of the steps before s (the "distance travelled"); S2 the
annealing area, sum_i m_i with the momentum m_i = lam * m_(i-1) + (eta_(i-1) - eta_i): every drop of the LR
keeps paying off for ~1/(1-lam) steps. A power law in tokens alone cannot see the drop a warmup-stable-decay
schedule banks in its decay (the one lm used until 2026-11-24 never came within 0.02 of a decayed final loss:
experiments/2026-11-23-forecast); this law predicts it, and so answers "what will the loss be after the
plan's decay", "what if the run cools down now", "what would another schedule length give".

For a fixed alpha the law is linear in (L0, A, C), all non-negative, so a search over alpha with the exact
non-negative least squares of lm.numbers.fit inside finds the global optimum. Huber re-weighting keeps one
noisy point from swinging it. The prediction interval profiles alpha (every alpha whose fit is not
significantly worse, 90%) and adds the linear parameters' standard error at each.

Before the LR has dropped, C is not identifiable from the run itself: the fit then takes C from a prior
`anneal_gain` g: one unit of annealing area is worth g units of forward area at the plan's end,
C = g * (-dL/dS1 at the end of the plan). Its default was measured on recorded tiny curves
(experiments/2026-11-23-forecast) and is labelled as a prior wherever it is used. Once the LR has dropped, C is
fitted, but the prior stays in the fit as one pseudo-observation (PRIOR_SPREAD): the first points of a decay,
or a cosine whose S1 and S2 grow together, cannot swing C alone.

The Chinchilla-form law L(N, D) = E + A / N^alpha + B / D^beta (`ChinchillaLaw`, at the end): the loss of a
model of N parameters trained on D tokens, which `lm plan` ranks plans by (lm.tools.budget) and
`lm plan --calibrate` fits to the user's own short runs (lm.tools.calibrate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lm.config import OptimConfig
from lm.numbers.fit import huber_weights, nnls
from lm.numbers.lr_schedule import multipliers

LAMBDA = 0.999
"""Momentum of the annealing area for long runs (the paper's value, for runs of tens of thousands of steps)."""
MEMORY_FRACTION = 0.05
"""The annealing momentum's memory 1/(1-lam) as a fraction of the plan (`lam_for`): on the recorded 2,000-step
tiny curves lam = 0.99 fits wsd and cosine better than 0.999 and gives both the same anneal gain
(experiments/2026-11-23-forecast); 0.999 is what the paper used on runs ~100x longer."""
ALPHA_RANGE = (0.05, 3.0)
"""Exponents searched for the forward-area power law."""
ANNEAL_GAIN = 8.5
"""Prior g for a run whose LR has not dropped yet (see the module docstring): the mean of the gains fitted to
the recorded tiny wsd (9.1) and cosine (8.0) curves at lam_for(2000) = 0.99 (experiments/2026-11-23-forecast)."""
MIN_ANNEAL_FRACTION = 0.02
"""C is fitted once the annealing area reaches this fraction of the forward area; below it the prior is used."""
PRIOR_SPREAD = 0.5
"""Once C is fitted, the prior still counts as one observation that C = g * (-dL/dS1 at the end) to within
this fraction: the first points of a decay cannot swing C on their own."""
Z90 = 1.645


@dataclass(frozen=True)
class Prediction:
    """A predicted loss with its 90% interval (of the curve's value, not of one noisy evaluation)."""

    loss: float
    low: float
    high: float


@dataclass(frozen=True)
class ScheduleLaw:
    """L(s) = L0 + A * S1^(-alpha) - C * S2, with S1 and S2 in steps at peak LR (multiplier units)."""

    L0: float
    A: float
    alpha: float
    C: float
    lam: float = LAMBDA
    rms: float = 0.0
    """Root mean square residual of the fit (loss units)."""
    n_points: int = 0
    c_source: str = "fitted"
    """`fitted` (the run's LR has dropped enough to measure C) or `prior` (C from anneal_gain)."""
    profile: tuple = ()
    """(alpha, coefficients, covariance, k) for every alpha in the 90% profile: what the interval spans."""

    def record(self) -> dict:
        """forecast.json's `law`: the constants, and that no calibrated prior was used."""
        fields = ("L0", "A", "alpha", "C", "lam", "rms", "n_points", "c_source")
        return {"model": "schedule", **{k: getattr(self, k) for k in fields}, "prior": None}

    def curve(self, mult: np.ndarray) -> np.ndarray:
        """The loss after each step of a schedule given as LR multipliers (index s: after s+1 steps)."""
        s1, s2 = areas(mult, self.lam)
        return self.L0 + self.A * s1 ** (-self.alpha) - self.C * s2

    def predict(self, mult: np.ndarray) -> Prediction:
        """The loss at the end of the schedule `mult`, with its interval."""
        s1, s2 = areas(mult, self.lam)
        point = float(self.L0 + self.A * s1[-1] ** (-self.alpha) - self.C * s2[-1])
        low, high = point, point
        for alpha, coef, cov, k in self.profile:
            x = design(np.array([s1[-1]]), np.array([s2[-1]]), alpha, k)[0]
            value = float(x @ coef)
            se = float(np.sqrt(max(x @ cov @ x, 0.0)))
            low, high = min(low, value - Z90 * se), max(high, value + Z90 * se)
        return Prediction(point, low, high)


def lam_for(plan_steps: int) -> float:
    """The annealing momentum for a plan of this many steps: memory MEMORY_FRACTION of it, at most LAMBDA."""
    return min(LAMBDA, max(0.9, 1.0 - 1.0 / (MEMORY_FRACTION * plan_steps)))


def areas(mult: np.ndarray, lam: float = LAMBDA) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) after each step of the schedule `mult`.

    Only drops of the LR count as annealing: the rise of warm-up is the optimiser getting started, which the
    forward area already carries (the paper does the same).
    """
    mult = np.asarray(mult, dtype=np.float64)
    s1 = np.cumsum(mult)
    drops = np.maximum(0.0, -np.diff(mult, prepend=mult[:1]))
    momentum = np.empty_like(drops)
    m = 0.0
    for i, d in enumerate(drops):
        m = lam * m + d
        momentum[i] = m
    return s1, np.cumsum(momentum)


def design(s1: np.ndarray, s2: np.ndarray, alpha: float, k: float | None) -> np.ndarray:
    """Columns for the linear coefficients: [1, S1^-alpha, -S2] with C free, or [1, S1^-alpha - k*S2] when
    C = k * A is fixed by the prior."""
    power = s1 ** (-alpha)
    if k is None:
        return np.stack([np.ones_like(power), power, -s2], axis=1)
    return np.stack([np.ones_like(power), power - k * s2], axis=1)


def usable_points(steps, losses, plan_steps: int, min_points: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, losses) a law can be fitted to: finite losses at steps inside the plan; None with fewer than
    `min_points` (and never fewer than 3) of them."""
    steps = np.asarray(steps, dtype=np.int64)
    y = np.asarray(losses, dtype=np.float64)
    keep = np.isfinite(y) & (steps >= 1) & (steps <= plan_steps)
    steps, y = steps[keep], y[keep]
    return (steps, y) if len(y) >= max(3, min_points) else None


def fit_schedule_law(
    steps: np.ndarray | list[int],
    losses: np.ndarray | list[float],
    plan_mult: np.ndarray,
    *,
    lam: float | None = None,
    anneal_gain: float | None = ANNEAL_GAIN,
    min_points: int = 6,
    huber: float | None = None,
    iterations: int = 5,
) -> ScheduleLaw | None:
    """Fit the law to (step, loss) points of a run whose LR multipliers over the whole plan are `plan_mult`.

    `steps` count optimizer steps done (a loss logged at step s saw s updates); `lam` None takes
    lam_for(len(plan_mult)). None with fewer than `min_points` usable points. `anneal_gain` is the prior for
    C while the LR has not dropped (None: C = 0, the decay's drop is then left out). `huber` is the residual
    (loss units) beyond which a point's weight falls as 1/|r|; None: lm.numbers.fit.huber_delta (1.5 x the
    median absolute residual, so the scale adapts to how noisy the curve is).
    """
    points = usable_points(steps, losses, len(plan_mult), min_points)
    if points is None:
        return None
    steps, y = points
    lam = lam_for(len(plan_mult)) if lam is None else lam
    s1_all, s2_all = areas(plan_mult, lam)
    # Scaled by the plan's total forward area, S1^(-alpha) stays near 1 for any alpha: a well-conditioned solve.
    scale = s1_all[-1]
    s1, s2 = s1_all[steps - 1] / scale, s2_all[steps - 1] / scale
    seen = s2.max() >= MIN_ANNEAL_FRACTION * s1.max()
    gain = None if seen else (anneal_gain or 0.0)

    def k_for(alpha: float) -> float | None:
        # C = g * (-dL/dS1 at the plan's end) = g * alpha * A * 1^(-alpha-1) in scaled units.
        return None if gain is None else gain * alpha

    weights = np.ones_like(y)
    prior = None
    for _ in range(iterations):
        alpha, coef, sse = search_alpha(s1, s2, y, weights, k_for, prior)
        residuals = y - design(s1, s2, alpha, k_for(alpha)) @ coef
        new = huber_weights(residuals, huber)
        if seen and anneal_gain and coef[1] > 0:
            # A residual of sigma per point against a prior drop known to PRIOR_SPREAD of its size.
            sigma = max(1.4826 * float(np.median(np.abs(residuals))), 1e-4)
            spread = PRIOR_SPREAD * anneal_gain * alpha * coef[1]
            prior = (anneal_gain, (sigma / spread) ** 2)
        elif np.allclose(new, weights, atol=1e-4):
            break
        weights = new
    profile = alpha_profile(s1, s2, y, weights, k_for, alpha, sse, prior)
    if gain:  # the prior's own uncertainty: a factor of two either way (the points cannot tell them apart)
        for factor in (0.5, 2.0):
            profile += alpha_profile(s1, s2, y, weights, lambda a, f=factor: k_for(a) * f, alpha, sse)
    L0, a = coef[0], coef[1]
    c = coef[2] if gain is None else k_for(alpha) * a
    # Undo the scaling: S1^-alpha = (S1'/scale)^-alpha, S2 = S2' * scale.
    return ScheduleLaw(
        L0=float(L0),
        A=float(a * scale**alpha),
        alpha=float(alpha),
        C=float(c / scale),
        lam=lam,
        rms=float(np.sqrt(np.mean(residuals**2))),
        n_points=len(y),
        c_source="fitted" if gain is None else "prior",
        profile=tuple(unscale(entry, scale) for entry in profile),
    )


def with_prior(X: np.ndarray, y: np.ndarray, w: np.ndarray, alpha: float, prior: tuple | None):
    """The rows plus, when C is fitted under a prior (gain, weight), one pseudo-observation c - g*alpha*a = 0."""
    if prior is None:
        return X, y, w
    gain, weight = prior
    return np.vstack([X, [0.0, -gain * alpha, 1.0]]), np.append(y, 0.0), np.append(w, weight)


def search_alpha(s1, s2, y, w, k_for, prior=None) -> tuple[float, np.ndarray, float]:
    """The exponent with the least weighted error: a log-spaced grid, then golden-section refinement."""

    def sse(alpha: float) -> float:
        return nnls(*with_prior(design(s1, s2, alpha, k_for(alpha)), y, w, alpha, prior))[1]

    grid = np.geomspace(*ALPHA_RANGE, 40)
    errors = [sse(a) for a in grid]
    i = int(np.argmin(errors))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    inv_phi = (math.sqrt(5) - 1) / 2
    for _ in range(14):
        c, d = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
        if sse(c) < sse(d):
            hi = d
        else:
            lo = c
    alpha = (lo + hi) / 2
    coef, err = nnls(*with_prior(design(s1, s2, alpha, k_for(alpha)), y, w, alpha, prior))
    return alpha, coef, err


def alpha_profile(s1, s2, y, w, k_for, best_alpha: float, best_sse: float, prior=None) -> list[tuple]:
    """(alpha, coef, covariance, k) for the best alpha and each grid alpha whose error is within the 90%
    profile threshold."""
    n_free = 2 if k_for(1.0) is not None else 3
    dof = max(1, len(y) - n_free - 1)
    threshold = best_sse * (1.0 + 2.71 / dof)
    sigma2 = best_sse / dof / max(float(np.mean(w)), 1e-12)
    entries = []
    for alpha in [best_alpha, *np.geomspace(*ALPHA_RANGE, 30)]:
        X, yp, wp = with_prior(design(s1, s2, alpha, k_for(alpha)), y, w, alpha, prior)
        coef, err = nnls(X, yp, wp)
        if err > threshold:
            continue
        free = coef > 0
        cov = np.zeros((X.shape[1], X.shape[1]))
        Xf = X[:, free] * np.sqrt(wp)[:, None]
        if free.any():
            cov[np.ix_(free, free)] = sigma2 * np.linalg.pinv(Xf.T @ Xf)
        entries.append((float(alpha), coef, cov, k_for(alpha)))
    return entries


def unscale(entry: tuple, scale: float) -> tuple:
    """A profile entry in step units: the design's columns rescale, so do the coefficients."""
    alpha, coef, cov, k = entry
    factors = np.array([1.0, scale**alpha, 1.0 / scale][: len(coef)])
    k_steps = None if k is None else k * scale ** (-alpha - 1)
    return alpha, coef * factors, cov * np.outer(factors, factors), k_steps


def block_means(steps, losses, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Training losses averaged over consecutive blocks of `size` points: the noise of one micro-batch falls
    by sqrt(size) and, unlike an EMA, the smoothed curve does not lag the schedule (each block is centred)."""
    steps, losses = np.asarray(steps, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    n = len(losses) // size * size
    return (
        np.round(steps[:n].reshape(-1, size).mean(axis=1)).astype(np.int64),
        losses[:n].reshape(-1, size).mean(axis=1),
    )


MAX_STRETCH = 10
"""An ending at most this many times the plan's steps is predicted (the Chinchilla token count); one further
out is not: the law would be extrapolated far past its points, and its arrays grow with the steps."""


@dataclass(frozen=True)
class ScheduleForecast:
    """What the law says about the rest of a run: the ways to end it, and what more steps buy."""

    law: ScheduleLaw
    step: int
    plan_steps: int
    plan_end: Prediction
    """The loss at the plan's end, after its decay."""
    cooldown_now: Prediction
    """The loss if the run cools down now (a cooldown of `cooldown_steps` starting at `step`)."""
    cooldown_steps: int
    twice_the_steps: Prediction
    """The loss of a run of 2 x `step` steps under the same schedule stretched to it (decay included): what
    spending as much again buys."""
    chinchilla: Prediction | None
    """The loss of a run of `chinchilla_steps` steps (the same schedule stretched to the Chinchilla token
    count); None when not asked for or more than MAX_STRETCH x the plan."""
    chinchilla_steps: int | None
    steps_per_loss_point: float
    """Steps that one more point of final loss costs: a plan 10% longer (decay included) against this one."""
    steps_per_loss_point_now: float
    """Steps that one more point of final loss costs now: training on 1% of the plan before the same cooldown,
    against cooling down now (what `early_stopping.use_forecast` compares with its threshold)."""

    def choices(self, usd_now: float | None, usd_per_step: float | None) -> dict:
        """The decision in dollars: each ending's final loss (with its interval), its steps and total spend,
        and the price of a loss point now and after the plan's end. Dollars are None without a price."""
        priced = usd_now is not None and usd_per_step is not None

        def option(p: Prediction | None, steps: int | None, steps_left: int) -> dict | None:
            if p is None:
                return None
            usd = usd_now + steps_left * usd_per_step if priced else None
            return {"loss": p.loss, "low": p.low, "high": p.high, "usd": usd, "steps": steps}

        chin = self.chinchilla_steps
        return {
            "cooldown_now": option(self.cooldown_now, self.cooldown_steps, self.cooldown_steps),
            "plan_end": option(self.plan_end, self.plan_steps, self.plan_steps - self.step),
            "twice_the_steps": option(self.twice_the_steps, 2 * self.step, self.step),
            "chinchilla": option(self.chinchilla, chin, (chin or 0) - self.step),
            "usd_per_loss_point_next": self.steps_per_loss_point * usd_per_step if priced else None,
            "usd_per_loss_point_now": self.steps_per_loss_point_now * usd_per_step if priced else None,
            "c_source": self.law.c_source,
        }


def schedule_forecast(
    law: ScheduleLaw,
    optim: OptimConfig,
    schedule_steps: int,
    step: int,
    cooldown_steps: int,
    plan_steps: int | None = None,
    chinchilla_steps: int | None = None,
) -> ScheduleForecast:
    """The law's predictions at `step` of a run whose LR schedule spans `schedule_steps` under `optim` and
    whose plan ends at `plan_steps` (default: with the schedule); `chinchilla_steps` the steps of the
    Chinchilla token count, when known."""
    plan_steps = plan_steps or schedule_steps
    length = max(0, min(cooldown_steps, plan_steps - step))  # 0 at the plan's end: nothing left to cool

    def cooled(start: int) -> Prediction:
        return law.predict(multipliers(optim, schedule_steps, start + length, cooldown=(start, length)))

    plan_end = law.predict(multipliers(optim, schedule_steps, plan_steps))
    longer = round(plan_steps * 1.1)
    drop = plan_end.loss - law.predict(multipliers(optim, longer)).loss
    cooldown_now = cooled(step)
    delta = max(1, round(0.01 * plan_steps))
    drop_now = cooldown_now.loss - cooled(step + delta).loss
    stretch_ok = chinchilla_steps is not None and 0 < chinchilla_steps <= MAX_STRETCH * plan_steps
    return ScheduleForecast(
        law=law,
        step=step,
        plan_steps=plan_steps,
        plan_end=plan_end,
        cooldown_now=cooldown_now,
        cooldown_steps=length,
        twice_the_steps=loss_for_length(law, optim, 2 * step),
        chinchilla=loss_for_length(law, optim, chinchilla_steps) if stretch_ok else None,
        chinchilla_steps=chinchilla_steps if stretch_ok else None,
        steps_per_loss_point=(longer - plan_steps) / drop if drop > 0 else math.inf,
        steps_per_loss_point_now=delta / drop_now if drop_now > 0 else math.inf,
    )


def loss_for_length(law: ScheduleLaw, optim: OptimConfig, total_steps: int) -> Prediction:
    """The final loss of the same schedule stretched or shrunk to `total_steps` (decay included)."""
    return law.predict(multipliers(optim, total_steps))


# -- L(N, D): the Chinchilla-form law of `lm plan` ----------------------------------------------------------


CHINCHILLA_TOKENS_PER_PARAM = 20
"""Hoffmann et al. 2022's compute-optimal tokens per parameter (roughly)."""
PARAM_REPEAT_SCALE = 5.309
"""R*_N of Muennighoff et al. 2023 (eq. 5): parameters past the compute-optimal count for the corpus's unique
tokens are worth less, decaying by 1/e over this many multiples of it."""
REPEAT_SCALE = 15.4
"""R*_D of Muennighoff et al. 2023 ("Scaling data-constrained language models", NeurIPS; eq. 5, fitted on
their 100M-9B runs): the repetitions over which a repeated token's worth decays by 1/e. Up to ~4 epochs a token
is worth nearly a fresh one; a corpus repeated without end is worth at most (1 + R*) x its unique tokens."""
USEFUL_EPOCHS = 4.0
"""Epochs up to which Muennighoff et al. found repeated data nearly as good as fresh: past it a plan says what
the repetition costs."""


WORTHWHILE_EPOCHS = 1.0 + REPEAT_SCALE * math.log(20.0)
"""Past ~47 epochs a further epoch is worth under 5% of a fresh one (e^(-R/R*) < 0.05): a budget plan trains no
longer, and spends less than the budget, rather than buying tokens that no longer lower the loss."""


def effective_tokens(tokens: float, unique: float | None, scale: float = REPEAT_SCALE) -> float:
    """The fresh tokens `tokens` trained on a corpus of `unique` tokens are worth: D' = U + U R* (1 - e^(-R/R*)),
    R = D/U - 1 repetitions (Muennighoff et al. 2023, eq. 5); `tokens` itself within one epoch or when the
    corpus size is unknown (None)."""
    if not unique or tokens <= unique:
        return tokens
    repeats = tokens / unique - 1.0
    return unique + unique * scale * (1.0 - math.exp(-repeats / scale))


def effective_params(n: float, unique: float | None, scale: float = PARAM_REPEAT_SCALE) -> float:
    """What `n` parameters are worth on a corpus of `unique` tokens: past U_N, the compute-optimal count for
    those tokens (`unique` / CHINCHILLA_TOKENS_PER_PARAM), N' = U_N + U_N R*_N (1 - e^(-R_N/R*_N)),
    R_N = N/U_N - 1 (Muennighoff et al. 2023, eq. 5); `n` itself when the corpus size is unknown (None)."""
    optimal = unique / CHINCHILLA_TOKENS_PER_PARAM if unique else None
    if optimal is None or n <= optimal:
        return n
    return optimal + optimal * scale * (1.0 - math.exp(-(n / optimal - 1.0) / scale))


def tokens_for_effective(effective: float, unique: float | None, scale: float = REPEAT_SCALE) -> float:
    """The tokens to train on a corpus of `unique` tokens to be worth `effective` fresh ones (the inverse of
    `effective_tokens`); inf past what endless repetition is worth, (1 + R*) x `unique`."""
    if not unique or effective <= unique:
        return effective
    worn = (effective - unique) / (unique * scale)
    return unique * (1.0 - scale * math.log1p(-worn)) if worn < 1.0 else math.inf


@dataclass(frozen=True)
class ChinchillaLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta, N parameters, D training tokens; with `unique` (the corpus's
    tokens), N and D are what they are worth on that corpus (`effective_params`, `effective_tokens`: the
    data-constrained law of Muennighoff et al. 2023)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str

    def loss(self, n: float, d: float, unique: float | None = None) -> float:
        n, d = effective_params(n, unique), effective_tokens(d, unique)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def tokens_for(self, n: float, loss: float, unique: float | None = None) -> float:
        """Tokens at which a model of n parameters reaches `loss` (on a corpus of `unique` tokens, repeated as
        needed); inf when it never does."""
        gap = loss - self.E - self.A / effective_params(n, unique) ** self.alpha
        return tokens_for_effective((self.B / gap) ** (1.0 / self.beta), unique) if gap > 0 else math.inf


BESIROGLU = ChinchillaLaw(1.8172, 482.01, 2085.43, 0.3478, 0.3658, "Besiroglu et al. 2024 (uncalibrated)")
HOFFMANN = ChinchillaLaw(1.69, 406.4, 410.7, 0.34, 0.28, "Hoffmann et al. 2022 (uncalibrated)")


def usd_per_loss_point_fit(usd, losses) -> float | None:
    """Dollars per point of validation loss off the least-squares slope of loss against dollars over the
    points given (the stopper's trailing window: its window + 1 newest points), inf when the loss does not
    fall, None with fewer than 3 points or no dollars. A quieter reading of the same price than the two end
    points' difference: one validation's noise enters the slope with 0.8x the variance over 5 equally spaced
    points, and no single point decides it (experiments/2026-11-28-stopper-regret). A point whose dollars or
    loss is not finite is left out (once a NaN made the slope NaN, read as inf: "stop now")."""
    if len(usd) < 3 or any(u is None for u in usd):
        return None
    x, y = np.asarray(usd, float), np.asarray(losses, float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(x) < 3:
        return None
    spread = float(((x - x.mean()) ** 2).sum())
    if spread <= 0:
        return None
    slope = float(((x - x.mean()) * (y - y.mean())).sum()) / spread  # loss per dollar, negative when falling
    return -1.0 / slope if slope < 0 else math.inf
