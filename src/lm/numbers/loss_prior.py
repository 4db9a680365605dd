"""Loss forecasts that start from a prior: shape parameters fitted once on calibration curves, reused early.

Before about half a run the schedule-aware law's exponent and annealing gain cannot be told from noise
(experiments/2026-11-23-forecast). Both are shape parameters that transfer: fitted on the full curves of small
runs (`lm plan --calibrate`, or recorded curves), their mean and spread become a Gaussian prior, and a run's own
points then only have to fix the level (L0, A, linear for fixed shape) and narrow the prior. The fit is a grid
over the shape parameters around the prior (penalised by it, in the run's noise units) with the exact
non-negative least squares of lm.numbers.fit for the level at each grid point; the 90% interval spans every
grid point whose penalised error is within the chi-square(1) threshold, plus the level's standard error there.

Two laws, both in scaled units (S over the plan's total forward area, so the shape transfers across lengths):

- `schedule`: Tissue et al. 2024, L = L0 + A * S1^-alpha - C * S2 (lm.numbers.loss_law), shape (alpha, g),
  C = g * alpha * A: g the anneal gain, one unit of annealing area worth g units of forward area at the end.
- `multi_power`: Luo et al. 2025, "A Multi-Power Law for Loss Curve Prediction Across Learning Rate
  Schedules": L(t) = L0 + A * S1(t)^-alpha - LD(t), LD(t) = B * sum_k (eta_(k-1) - eta_k) * G(eta_k^-gamma *
  S_k(t)), G(x) = 1 - (C x + 1)^-beta, S_k(t) = sum_(tau=k..t) eta_tau (S1 includes the warm-up, the paper's
  S_W). Shape (alpha, b, C, beta, gamma) with B = b * A; the run's fit moves alpha and b around the prior and
  keeps C, beta, gamma at the prior's values (a 5-D grid per validation would be too slow for the stopper).

`auto` fits both, scores each on the run's last points held out, forecasts with the better one and widens the
interval to cover both.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lm.base.exits import Refused
from lm.numbers.fit import huber_weights, nnls
from lm.numbers.loss_law import (
    ALPHA_RANGE,
    ANNEAL_GAIN,
    MIN_ANNEAL_FRACTION,
    Z90,
    Prediction,
    areas,
    fit_schedule_law,
    lam_for,
    usable_points,
)

MODELS = ("schedule", "multi_power")
GRID = 13
"""Grid points per fitted shape parameter, spanning the prior's mean +- SPAN sds."""
SPAN = 3.0
CHI2_90 = 2.71
"""Penalised-error margin of the 90% profile (chi-square, one degree of freedom)."""
NOISE_FLOOR = 0.02
"""Least noise (loss units) assumed for one validation point when weighing the points against the prior: with
three points the residuals alone would call a lucky fit exact. The laws' full-curve fits to the recorded curves
leave rms 0.011-0.019 (one evaluation's noise is 0.01; the rest is data-order bumps no law follows, shared by
every curve of a shape); 0.02 against 0.01 and 0.03 on experiments/2026-11-24-forecast-priors (in-sample)."""
MIN_SD = {"alpha": 0.02, "anneal_gain": 0.2, "b": 0.2}
"""Least spread of a prior (alpha absolute; the gains in log units): a prior from one or two curves that agree
by chance must not pin the shape."""
LOG_PARAMS = ("anneal_gain", "b")
"""Gains are positive and spread multiplicatively: their prior is Gaussian in log space."""
MPL_DEFAULT = {"alpha": 0.5, "b": 0.5, "C": 2.0, "beta": 0.5, "gamma": 0.5}
"""The multi-power law's shape without a calibration (labelled `default` wherever used)."""


@dataclass(frozen=True)
class ShapePrior:
    """The shape parameters of one law: mean and spread (log units for LOG_PARAMS), where they came from."""

    model: str
    mean: dict
    sd: dict
    source: str

    def record(self) -> dict:
        return {"model": self.model, "mean": self.mean, "sd": self.sd, "source": self.source}


def default_prior(model: str) -> ShapePrior:
    """What a run without a calibration starts from (the schedule law: ANNEAL_GAIN, alpha free)."""
    if model == "schedule":
        return ShapePrior(model, {"anneal_gain": ANNEAL_GAIN}, {}, "default")
    sd = {"alpha": 0.3, "b": 1.0}
    return ShapePrior(model, dict(MPL_DEFAULT), sd, "default")


# -- the multi-power law's loss drop -------------------------------------------------------------------------


def loss_drop(mult: np.ndarray, steps: np.ndarray, scale: float, C: float, beta: float, gamma: float):
    """sum_k (eta_(k-1) - eta_k) * G(eta_k^-gamma * S_k(t)) after each of `steps` (S in units of `scale`)."""
    mult = np.asarray(mult, dtype=np.float64)
    drops = np.maximum(0.0, -np.diff(mult, prepend=mult[:1]))
    k = np.nonzero(drops)[0]
    out = np.zeros(len(steps))
    if len(k) == 0:
        return out
    csum = np.concatenate([[0.0], np.cumsum(mult)])
    for i, t in enumerate(steps):  # t steps done: steps 0..t-1
        kk = k[k < t]
        if len(kk):
            s_k = (csum[t] - csum[kk]) / scale
            x = mult[kk] ** (-gamma) * s_k
            out[i] = float(drops[kk] @ (1.0 - (C * x + 1.0) ** (-beta)))
    return out


# -- features: the row of the level's design at given steps of a schedule -----------------------------------


@dataclass(frozen=True)
class Basis:
    """What a law needs at the steps it is read: scaled S1, and S2 (schedule) or the unit loss drop (MPL)."""

    s1: np.ndarray
    extra: np.ndarray


def basis(model: str, mult: np.ndarray, steps: np.ndarray, scale: float, lam: float, fixed: dict) -> Basis:
    s1_all, s2_all = areas(mult, lam)
    s1 = s1_all[steps - 1] / scale
    if model == "schedule":
        return Basis(s1, s2_all[steps - 1] / scale)
    return Basis(s1, loss_drop(mult, steps, scale, fixed["C"], fixed["beta"], fixed["gamma"]))


def columns(model: str, b: Basis, theta: dict) -> np.ndarray:
    """[1, S1^-alpha - gain * term]: the level (L0, A) is linear for a fixed shape."""
    alpha = theta["alpha"]
    gain = theta["anneal_gain"] * alpha if model == "schedule" else theta["b"]
    drop = gain * b.extra
    return np.stack([np.ones_like(b.s1), b.s1 ** (-alpha) - drop], axis=1)


# -- the fitted law -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PriorLaw:
    """A law fitted around a shape prior; predicts like lm.numbers.loss_law.ScheduleLaw."""

    model: str
    L0: float
    A: float
    """In scaled units: the power term's value at the end of the plan."""
    theta: dict
    fixed: dict
    scale: float
    lam: float
    rms: float
    n_points: int
    prior: ShapePrior
    profile: tuple = ()
    """(theta, coef, covariance) of every grid point within the 90% profile."""
    c_source: str = "prior"
    alternatives: tuple = ()
    """Other laws `auto` fitted: the interval covers theirs too."""
    choice: str = ""
    """Why this model (auto: the held-out errors)."""

    @property
    def alpha(self) -> float:
        return self.theta["alpha"]

    def predict(self, mult: np.ndarray) -> Prediction:
        b = basis(self.model, mult, np.array([len(mult)]), self.scale, self.lam, self.fixed)
        point = float(columns(self.model, b, self.theta)[0] @ [self.L0, self.A])
        low = high = point
        for theta, coef, cov in self.profile:
            x = columns(self.model, b, theta)[0]
            value, se = float(x @ coef), float(np.sqrt(max(x @ cov @ x, 0.0)))
            low, high = min(low, value - Z90 * se), max(high, value + Z90 * se)
        for other in self.alternatives:
            p = other.predict(mult)
            low, high = min(low, p.low), max(high, p.high)
        return Prediction(point, low, high)

    def curve(self, mult: np.ndarray) -> np.ndarray:
        b = basis(self.model, mult, np.arange(1, len(mult) + 1), self.scale, self.lam, self.fixed)
        return columns(self.model, b, self.theta) @ [self.L0, self.A]

    def record(self) -> dict:
        """forecast.json's `law`: the model, its constants and the prior it started from."""
        return {
            "model": self.model,
            "L0": self.L0,
            "A": self.A,
            **{k: float(v) for k, v in {**self.fixed, **self.theta}.items()},
            "lam": self.lam,
            "rms": self.rms,
            "n_points": self.n_points,
            "c_source": self.c_source,
            "prior": self.prior.record(),
            "choice": self.choice,
        }


def grid_for(prior: ShapePrior) -> list[dict]:
    """Shape values to try: mean +- SPAN sd for every parameter with a spread."""
    axes = {}
    for name, mean in prior.mean.items():
        if name not in prior.sd or name not in ("alpha", "anneal_gain", "b"):
            continue
        sd = max(prior.sd[name], MIN_SD.get(name, 0.0))
        if name in LOG_PARAMS:
            axes[name] = np.exp(math.log(mean) + np.linspace(-SPAN, SPAN, GRID) * sd)
        else:
            axes[name] = np.clip(mean + np.linspace(-SPAN, SPAN, GRID) * sd, *ALPHA_RANGE)
    names = list(axes)
    fixed = {k: v for k, v in prior.mean.items() if k not in axes and k in ("alpha", "anneal_gain", "b")}
    if "alpha" not in axes and "alpha" not in fixed:  # the schedule law's default prior: alpha free
        axes["alpha"] = np.geomspace(*ALPHA_RANGE, 40)
        names.append("alpha")
    return [{**fixed, **dict(zip(names, values))} for values in itertools.product(*(axes[n] for n in names))]


def penalty(prior: ShapePrior, theta: dict) -> float:
    """-2 log prior density (up to a constant) of a shape."""
    total = 0.0
    for name, sd in prior.sd.items():
        if name not in theta:
            continue
        sd = max(sd, MIN_SD.get(name, 0.0))
        value, mean = theta[name], prior.mean[name]
        if name in LOG_PARAMS:
            value, mean = math.log(value), math.log(mean)
        total += ((value - mean) / sd) ** 2
    return total


def fit_prior_law(
    steps, losses, plan_mult: np.ndarray, prior: ShapePrior, *, lam: float | None = None, min_points: int = 3
) -> PriorLaw | None:
    """Fit `prior.model` to (step, loss) points around `prior` (see the module docstring); None with fewer
    than `min_points` usable points (the level has two constants and one residual to judge them by)."""
    points = usable_points(steps, losses, len(plan_mult), min_points)
    if points is None:
        return None
    steps, y = points
    lam = lam_for(len(plan_mult)) if lam is None else lam
    scale = float(np.sum(plan_mult))
    fixed = {k: prior.mean[k] for k in ("C", "beta", "gamma") if k in prior.mean}
    b = basis(prior.model, plan_mult, steps, scale, lam, fixed)
    grid = grid_for(prior)
    designs = np.stack([columns(prior.model, b, theta) for theta in grid])
    weights = np.ones_like(y)
    for _ in range(3):  # Huber reweighting around the best shape
        coef, score, _ = score_grid(designs, y, weights, prior, grid)
        best = int(np.argmin(score))
        weights = huber_weights(y - designs[best] @ coef[best], None)
    coef, score, sigma2 = score_grid(designs, y, weights, prior, grid)
    best = int(np.argmin(score))
    profile = profile_of(designs, weights, grid, coef, score, sigma2)
    residuals = y - designs[best] @ coef[best]
    seen = (
        b.extra.max() > 0
        if prior.model == "multi_power"
        else b.extra.max() >= MIN_ANNEAL_FRACTION * b.s1.max()
    )
    return PriorLaw(
        model=prior.model,
        L0=float(coef[best][0]),
        A=float(coef[best][1]),
        theta={k: float(v) for k, v in grid[best].items()},
        fixed=fixed,
        scale=scale,
        lam=lam,
        rms=float(np.sqrt(np.mean(residuals**2))),
        n_points=len(y),
        prior=prior,
        profile=tuple(profile),
        c_source="fitted" if seen else "prior",
    )


def score_grid(designs, y, weights, prior: ShapePrior, grid: list[dict]):
    """The level at every shape of the grid, and each shape's penalised error: weighted squared residuals over
    the noise (at least NOISE_FLOOR) plus the prior's penalty. Returns (coefficients, scores, noise^2)."""
    coef, sse = nnls(designs, y, weights)
    dof = max(1, len(y) - 2)
    sigma2 = max(float(np.min(sse)) / dof / max(float(np.mean(weights)), 1e-12), NOISE_FLOOR**2)
    return coef, sse / sigma2 + np.array([penalty(prior, t) for t in grid]), sigma2


def profile_of(designs, weights, grid, coef, score, sigma2) -> list[tuple]:
    """(shape, level, level covariance) of every grid shape within the 90% profile of the best."""
    profile = []
    for i in np.nonzero(score <= score.min() + CHI2_90)[0]:
        Xw = designs[i] * np.sqrt(weights)[:, None]
        free = coef[i] > 0
        cov = np.zeros((2, 2))
        if free.any():
            cov[np.ix_(free, free)] = sigma2 * np.linalg.pinv(Xw[:, free].T @ Xw[:, free])
        profile.append((grid[i], coef[i], cov))
    return profile


def fit_forecast(steps, losses, plan_mult, model: str, priors: dict, min_points: int = 3) -> PriorLaw | None:
    """The forecast law: `model` (schedule, multi_power) or `auto`, each from its prior in `priors` (else
    default_prior). `auto` holds the last quarter of the points out, keeps the model that predicts them better,
    refits it on all points and widens its interval to cover the other's."""
    if model != "auto":
        return fit_prior_law(
            steps, losses, plan_mult, priors.get(model) or default_prior(model), min_points=min_points
        )
    steps, losses = np.asarray(steps), np.asarray(losses, dtype=np.float64)
    fits = {m: fit_forecast(steps, losses, plan_mult, m, priors, min_points) for m in MODELS}
    if any(f is None for f in fits.values()):
        return fits["schedule"]
    held = max(1, len(steps) // 4)
    errors = {}
    for m in MODELS:
        early = fit_forecast(steps[:-held], losses[:-held], plan_mult, m, priors, min_points)
        errors[m] = (
            math.inf if early is None else held_out_error(early, plan_mult, steps[-held:], losses[-held:])
        )
    pick = min(MODELS, key=lambda m: (errors[m], m != "schedule"))
    other = fits["multi_power" if pick == "schedule" else "schedule"]
    why = ", ".join(f"{m} {e:.4f}" for m, e in errors.items())
    return replace(
        fits[pick],
        alternatives=(other,),
        choice=f"auto: rms error on the last {held} point(s) held out: {why}",
    )


def held_out_error(law: PriorLaw, plan_mult, steps, losses) -> float:
    curve = law.curve(plan_mult)
    return float(np.sqrt(np.mean((curve[np.asarray(steps) - 1] - losses) ** 2)))


# -- priors from full curves (calibration) ----------------------------------------------------------------


def fit_shape(steps, losses, plan_mult: np.ndarray, model: str, fixed: dict | None = None) -> dict | None:
    """A law's shape fitted freely to one full curve (its decay included): the calibration's measurement.
    `fixed`: the multi-power law's C, beta, gamma held at these (only alpha and b fitted)."""
    steps = np.asarray(steps, dtype=np.int64)
    y = np.asarray(losses, dtype=np.float64)
    if len(y) < 6:
        return None
    scale = float(np.sum(plan_mult))
    if model == "schedule":
        law = fit_schedule_law(steps, y, plan_mult, anneal_gain=None)
        if law is None or law.c_source != "fitted" or law.C <= 0:
            return None
        a_scaled = law.A * scale ** (-law.alpha)
        return {"alpha": law.alpha, "anneal_gain": law.C * scale / (law.alpha * a_scaled)}
    lam = lam_for(len(plan_mult))
    best = (math.inf, None)
    triples = itertools.product(np.geomspace(0.3, 300, 10), (0.25, 0.5, 1.0, 2.0), (0.25, 0.5, 1.0))
    for C, beta, gamma in [tuple(fixed[k] for k in ("C", "beta", "gamma"))] if fixed else triples:
        b = basis(model, plan_mult, steps, scale, lam, {"C": C, "beta": beta, "gamma": gamma})
        if b.extra.max() <= 0:
            return None  # no decay in this curve: its drop cannot be measured
        alphas = np.geomspace(*ALPHA_RANGE, 30)
        X = np.stack([np.stack([np.ones_like(b.s1), b.s1 ** (-a), -b.extra], axis=1) for a in alphas])
        coef, sse = nnls(X, y)
        i = int(np.argmin(sse))
        if sse[i] < best[0] and coef[i][1] > 0 and coef[i][2] > 0:
            theta = {"alpha": alphas[i], "b": coef[i][2] / coef[i][1], "C": C, "beta": beta, "gamma": gamma}
            best = (float(sse[i]), theta)
    return None if best[1] is None else {k: float(v) for k, v in best[1].items()}


def middle(shapes: list[dict]) -> dict:
    """The multi-power law's C, beta, gamma of the curve whose alpha is nearest the curves' mean: held fixed for
    every curve's (alpha, b), so that b means the same on all of them (it trades off against C and beta)."""
    mean = float(np.mean([s["alpha"] for s in shapes]))
    nearest = min(shapes, key=lambda s: abs(s["alpha"] - mean))
    return {k: nearest[k] for k in ("C", "beta", "gamma")}


def prior_from_shapes(model: str, shapes: list[dict], source: str) -> ShapePrior:
    """Mean and spread of the shapes fitted to several curves (log space for the gains); the multi-power law's
    C, beta, gamma from `middle` (fit the curves with them fixed first: priors_from_curves)."""
    if not shapes:
        raise Refused(f"no curve with a decay to fit the {model} law's shape to ({source})")
    mean, sd = {}, {}
    for name in ("alpha", "anneal_gain", "b"):
        values = [s[name] for s in shapes if name in s]
        if not values:
            continue
        v = np.log(values) if name in LOG_PARAMS else np.asarray(values)
        centre = float(np.mean(v))
        mean[name] = float(np.exp(centre)) if name in LOG_PARAMS else centre
        sd[name] = max(float(np.std(v, ddof=1)) if len(v) > 1 else 0.0, MIN_SD[name])
    if model == "multi_power":
        mean |= middle(shapes)
    return ShapePrior(model, mean, sd, f"{source} ({len(shapes)} curve(s))")


def priors_from_curves(curves: list[tuple], source: str) -> dict:
    """{model: ShapePrior} from full curves given as (steps, losses, plan multipliers); a model none of the
    curves can measure (no decay in any) is left out."""
    priors = {}
    for model in MODELS:
        shapes = [s for s in (fit_shape(st, lo, mult, model) for st, lo, mult in curves) if s is not None]
        if shapes and model == "multi_power":  # every curve's (alpha, b) under one C, beta, gamma
            fixed = middle(shapes)
            shapes = [s for s in (fit_shape(st, lo, mult, model, fixed) for st, lo, mult in curves) if s]
        if shapes:
            priors[model] = prior_from_shapes(model, shapes, source)
    return priors


def priors_record(priors: dict) -> dict:
    """How a calibration file stores priors (its `forecast_prior`)."""
    return {model: p.record() for model, p in priors.items()}


def read_priors(path: str | Path) -> dict:
    """{model: ShapePrior} from a calibration.json (`forecast_prior`) or a law file holding the same mapping;
    a clear error naming the file when it has none."""
    try:
        record = json.loads(Path(path).read_text())
        entries = record.get("forecast_prior", record)
        priors = {
            m: ShapePrior(m, dict(e["mean"]), dict(e["sd"]), str(e.get("source", path)))
            for m, e in entries.items()
            if m in MODELS
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise Refused(f"early_stopping.forecast_prior={path}: unreadable ({e})") from e
    if not priors:
        raise Refused(
            f"early_stopping.forecast_prior={path}: no forecast prior in it (a `forecast_prior` mapping of "
            f"{' / '.join(MODELS)} to mean and sd); write one with `lm plan --calibrate`"
        )
    return priors
