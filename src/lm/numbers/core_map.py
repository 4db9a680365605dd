"""The loss-to-CORE map: what a validation loss is worth in DCLM CORE, with an interval it has earned.

Within one training set CORE follows the loss smoothly (Gadre et al. 2024's testbed, 104 models of 11M-6.9B):

    CORE(L) = k exp(-gamma (L - shift)) - c

The shape (k, gamma, c) is shared; the `shift` moves the curve along the loss axis, and it is what changes with
the data and the tokenizer: on the testbed's own-data validation losses the loss at CORE 0.2 is 2.25
(RedPajama), 2.72 (C4) and 3.05 nats (RefinedWeb). So the map has two states:

- **prior** (uncalibrated): the shape and shift fitted by `public_prior` on the public testbed
  (core_testbed.csv, its repository and commit in its header), and the spread of the training sets' shifts as
  the shift's uncertainty, Student-t widened for having three sets: the interval is wide, and honest about it;
- **calibrated**: the same shape, the shift fitted to the user's own runs (`calibrate`), points that do not
  `carries_signal` left out (CORE near chance carries no information about the shift).

Every prediction integrates over the loss's own uncertainty and the shift's (both on the loss axis, normal,
Gauss-Hermite quadrature) and adds CORE-axis noise (`noise_sd`: the map's error past the compute it was fitted
on, measured on the testbed). Out-of-sample coverage: experiments/2026-11-29-core-map.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import norm
from scipy.stats import t as student_t

from lm.base.exits import Refused
from lm.base.scores import core_name, version_value

TESTBED = Path(__file__).with_name("core_testbed.csv")
"""The public testbed's per-model losses and CORE accuracies (experiments/2026-11-29-core-map/testbed.py)."""
SIGNAL = 0.1
"""The least CORE a calibration point must reach: below it the testbed's CORE sits within ~0.05 of chance for
a 1-nat span of loss, so a point there cannot place the curve."""
SPLIT_FLOPS = 2e19
"""Where the testbed is split into "small" and "large" to measure the map's extrapolation error (66 and 38
models; Gadre et al. 2024 fit their laws below about this much compute too)."""
LEVEL = 0.9
"""The interval's coverage, and the probability a target plan must reach."""
CEILING = 1.0
"""The most CORE can be (every task answered right): the exponential form has no ceiling of its own."""
NODES, WEIGHTS = np.polynomial.hermite.hermgauss(40)
VERSIONS = ("v1", "v2")
FORM = "CORE(L) = k exp(-gamma (L - shift)) - c"
AXES = ("own", "c4")
"""The loss a testbed model is placed at: its own training set's validation split (what a user measures) or
C4's validation set (a common axis)."""


@dataclass(frozen=True)
class Point:
    """One model: its validation loss, its CORE and CORE's standard error (0 when unknown), its training set."""

    loss: float
    core: float
    stderr: float = 0.0
    group: str = ""
    compute: float = 0.0
    """6 N D: the order "fit small, test large" splits by."""


@dataclass(frozen=True)
class CoreMap:
    """CORE(L) = k exp(-gamma (L - shift)) - c, with the shift's uncertainty and the residual's."""

    k: float
    gamma: float
    c: float
    shift: float
    shift_sd: float
    """Standard deviation of the shift (nats): the training sets' spread (prior) or the fit's error (calibrated)."""
    noise_sd: float
    """Noise on the CORE axis: the larger of the testbed's in-sample residual and its extrapolation error."""
    version: str
    calibrated: bool
    source: str
    points: int = 0
    """Calibration points used (0 for the prior)."""

    def mean(self, loss: float | np.ndarray) -> float | np.ndarray:
        """The curve's CORE at `loss` (no noise)."""
        return self.k * np.exp(-self.gamma * (np.asarray(loss) - self.shift)) - self.c

    def slope(self, loss: float) -> float:
        """dCORE/dL at `loss` (negative: CORE rises as the loss falls)."""
        return float(-self.gamma * self.k * math.exp(-self.gamma * (loss - self.shift)))

    def _spread(self, loss_sd: float) -> float:
        return math.sqrt(loss_sd**2 + self.shift_sd**2)

    def probability_at_least(self, target: float, loss: float, loss_sd: float = 0.0) -> float:
        """P(CORE >= target) for a model whose predicted loss is `loss` +- `loss_sd` (one standard deviation)."""
        if target > CEILING:
            return 0.0
        s = self._spread(loss_sd)
        curve = np.minimum(self.mean(loss + math.sqrt(2.0) * s * NODES), CEILING)
        return float(np.sum(WEIGHTS * norm.sf((target - curve) / self.noise_sd)) / math.sqrt(math.pi))

    def quantile(self, q: float, loss: float, loss_sd: float = 0.0) -> float:
        """The CORE below which a fraction `q` of outcomes falls (bisection on `probability_at_least`)."""
        lo, hi = -self.c - 10 * self.noise_sd, CEILING
        for _ in range(40):  # 2^-40 of CORE's range
            mid = 0.5 * (lo + hi)
            if self.probability_at_least(mid, loss, loss_sd) > 1.0 - q:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def predict(self, loss: float, loss_sd: float = 0.0, level: float = LEVEL) -> Forecast:
        """CORE at `loss` with its central `level` interval."""
        tail = (1.0 - level) / 2.0
        return Forecast(
            core=float(self.mean(loss)),
            low=self.quantile(tail, loss, loss_sd),
            high=self.quantile(1.0 - tail, loss, loss_sd),
            level=level,
            version=self.version,
            calibrated=self.calibrated,
        )

    def label(self) -> str:
        """`calibrated on N points` or `UNCALIBRATED: the public prior`, with the CORE version."""
        state = f"calibrated on {self.points} points" if self.calibrated else "UNCALIBRATED: the public prior"
        return f"CORE {self.version}, {state} ({self.source})"

    def record(self) -> dict:
        """The map as JSON (forecast.json's `core.map`, core_map.json): its form and every field."""
        return {"form": FORM} | dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> CoreMap:
        keys = [f.name for f in dataclasses.fields(cls)]
        missing = [k for k in keys if k not in record]
        if missing:
            raise Refused(
                f"the CORE map record lacks {', '.join(missing)}: write it again with `lm core-map`"
            )
        return cls(**{k: record[k] for k in keys})

    def __post_init__(self) -> None:
        if self.version not in VERSIONS or not (self.noise_sd > 0 and self.shift_sd >= 0 and self.gamma > 0):
            raise Refused(
                f"a CORE map needs version in {VERSIONS}, noise_sd > 0, shift_sd >= 0 and gamma > 0"
            )


@dataclass(frozen=True)
class Forecast:
    """A CORE prediction: the curve's value and its central interval."""

    core: float
    low: float
    high: float
    level: float
    version: str
    calibrated: bool

    def record(self) -> dict:
        return dataclasses.asdict(self)

    def text(self) -> str:
        tag = "" if self.calibrated else ", uncalibrated"
        return (
            f"CORE {self.version} {self.core:.3f} [{self.low:.3f}, {self.high:.3f}] ({self.level:.0%}{tag})"
        )


# --- the public testbed ----------------------------------------------------------------------------------


def public_source() -> str:
    """The testbed's provenance line (repository and commit), read from core_testbed.csv's header."""
    for line in TESTBED.read_text().splitlines():
        if "github.com/" in line:
            start = line.index("github.com/")
            commit = line.split("at commit ")[1].split()[0]
            return f"{line[start:].split()[0]} @ {commit[:12]}"
    raise AssertionError(f"{TESTBED} has no provenance header")


def public_points(version: str = "v1", axis: str = "own") -> list[Point]:
    """Every testbed model as a point on the `axis` loss with its CORE under baseline table `version`."""
    if version not in VERSIONS or axis not in AXES:
        raise Refused(f"CORE version {version!r} / axis {axis!r}: use one of {VERSIONS} / {AXES}")
    lines = [line for line in TESTBED.read_text().splitlines() if not line.startswith("#")]
    return [
        Point(
            loss=float(r[f"loss_{axis}"]),
            core=float(r[f"core_{version}"]),
            group=r["dataset"],
            compute=6.0 * float(r["params"]) * float(r["tokens"]),
        )
        for r in csv.DictReader(lines)
    ]


def fit_shape(points: list[Point]) -> tuple[tuple[float, float, float], dict[str, float], float]:
    """Shared (k, gamma, c) and one shift per group, the shifts centred on 0, by least squares; and the
    residual standard deviation (degrees of freedom counted)."""
    groups = sorted({p.group for p in points})
    index = np.array([groups.index(p.group) for p in points])
    L = np.array([p.loss for p in points])
    C = np.array([p.core for p in points])

    def residuals(theta: np.ndarray) -> np.ndarray:
        log_k, gamma, c, *free = theta
        shifts = np.array([*free, -sum(free)])
        return np.exp(log_k) * np.exp(-gamma * (L - shifts[index])) - c - C

    start = np.array([math.log(5.0), 1.2, 0.02] + [0.0] * (len(groups) - 1))
    fit = least_squares(residuals, start)
    log_k, gamma, c, *free = fit.x
    shifts = [*free, -sum(free)]
    dof = max(1, len(points) - len(fit.x))
    sd = float(np.sqrt(np.sum(fit.fun**2) / dof))
    return (float(math.exp(log_k)), float(gamma), float(c)), dict(zip(groups, map(float, shifts))), sd


def extrapolation_sd(points: list[Point], cutoff: float = SPLIT_FLOPS) -> float:
    """The map's error past the compute it was fitted on: shape and shifts fitted on `points` below `cutoff`,
    the root-mean-square error on those at or above it with CORE >= SIGNAL (0 when either side is empty).
    It is larger than the in-sample residual (0.017 against 0.010 on the testbed), and an interval for a
    model larger than its ladder needs it."""
    small = [p for p in points if p.compute < cutoff]
    large = [p for p in points if p.compute >= cutoff and p.core >= SIGNAL]
    if len(small) < 8 or not large:
        return 0.0
    (k, gamma, c), shifts, _ = fit_shape(small)
    errors = [
        k * math.exp(-gamma * (p.loss - shifts[p.group])) - c - p.core for p in large if p.group in shifts
    ]
    return float(math.sqrt(np.mean(np.square(errors)))) if errors else 0.0


def prior_from(points: list[Point], version: str, source: str, level: float = LEVEL) -> CoreMap:
    """The uncalibrated map from points of several training sets: the shape, a shift of 0 (their centre) and
    the shift's predictive spread for a new set, sd x sqrt(1 + 1/n) widened from normal to Student-t with n - 1
    degrees of freedom at `level` (few sets make the spread itself uncertain). The CORE-axis noise is the
    larger of the in-sample residual and the measured extrapolation error (`extrapolation_sd`)."""
    (k, gamma, c), shifts, residual = fit_shape(points)
    noise = max(residual, extrapolation_sd(points))
    n = len(shifts)
    if n < 2:
        raise Refused("a prior needs points from at least two training sets")
    values = np.array(list(shifts.values()))
    spread = float(np.std(values, ddof=1)) * math.sqrt(1.0 + 1.0 / n)
    widen = student_t.ppf(0.5 + level / 2, n - 1) / norm.ppf(0.5 + level / 2)
    return CoreMap(k, gamma, c, 0.0, float(spread * widen), noise, version, False, source)


@functools.cache
def public_prior(version: str = "v1") -> CoreMap:
    """The public prior: `prior_from` on the testbed's own-data losses."""
    points = public_points(version, "own")
    return prior_from(points, version, f"fitted on {len(points)} public models, {public_source()}")


# --- calibration on the user's runs --------------------------------------------------------------------


def carries_signal(p: Point) -> bool:
    """A point that can place the map: CORE at least `SIGNAL` and at least twice its standard error (8 items
    a task put a chance-level model at 0.25 +- 0.35)."""
    return p.core >= SIGNAL and p.core >= 2.0 * p.stderr


def calibrate(prior: CoreMap, points: list[Point], source: str) -> CoreMap:
    """The prior's shape with the shift fitted to `points` (the user's runs, own data and tokenizer), by
    weighted least squares (weights 1 / (noise^2 + stderr^2)); the shift's sd is the fit's (Fisher information
    at the fit). Points that do not `carries_signal` are left out; none left is a refusal."""
    usable = [p for p in points if carries_signal(p)]
    if not usable:
        best = max(points, key=lambda p: p.core, default=None)
        said = f"the best: {best.core:.3f} +- {best.stderr:.3f}" if best else "no points"
        raise Refused(
            f"no run reached CORE {SIGNAL:g} clear of chance ({said}): below it CORE cannot place the map. "
            "Calibrate on larger or longer runs (more items per task: evals.limit), or plan with the public "
            "prior (uncalibrated)"
        )
    L = np.array([p.loss for p in usable])
    C = np.array([p.core for p in usable])
    w = 1.0 / (prior.noise_sd**2 + np.array([p.stderr for p in usable]) ** 2)
    k, gamma, c = prior.k, prior.gamma, prior.c

    def residuals(shift: np.ndarray) -> np.ndarray:
        return np.sqrt(w) * (k * np.exp(-gamma * (L - shift[0])) - c - C)

    shift = float(least_squares(residuals, [0.0]).x[0])
    slope = gamma * k * np.exp(-gamma * (L - shift))
    shift_sd = float(1.0 / math.sqrt(np.sum(w * slope**2)))
    return CoreMap(k, gamma, c, shift, shift_sd, prior.noise_sd, prior.version, True, source, len(usable))


# --- a run's own points --------------------------------------------------------------------------------

PAIR_TOLERANCE = 0.02
"""How far (a fraction of the step) the validation a CORE milestone is paired with may be from it."""


def run_points(
    evals: list[dict], validations: list[tuple[int, float]], version: str, group: str = ""
) -> tuple[list[Point], str | None]:
    """A run's (loss, CORE) points: each evals.jsonl record with a CORE figure under `version`, at the
    validation loss of its step (the nearest validation within `PAIR_TOLERANCE` of it). Also the records'
    CORE name (`CORE v1 nanochat`, `CORE-18 v1 dclm`), so that points of different coverage never mix."""
    points, names = [], set()
    for record in evals:
        core = record.get("core")
        figure = version_value(core, version) if core else None
        if figure is None or not validations:
            continue
        step = record["step"]
        at, loss = min(validations, key=lambda v: abs(v[0] - step))
        if abs(at - step) > PAIR_TOLERANCE * max(step, 1) or not math.isfinite(loss):
            continue
        names.add(core_name(core | {"version": version}))
        points.append(Point(loss, figure[0], figure[1] or 0.0, group))
    if len(names) > 1:
        raise Refused(
            f"the runs' CORE figures differ in coverage or convention ({', '.join(sorted(names))}): "
            "score them all the same way (evals=core, one convention) before calibrating"
        )
    return points, names.pop() if names else None


def read_map(path: str | Path) -> CoreMap:
    """A `core_map.json` written by `lm core-map` (its `map`), refused with the fix when absent or malformed."""
    file = Path(path)
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise Refused(
            f"cannot read the CORE map {file}: {e}; write it with `lm core-map RUN_DIR ...`"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("map"), dict):
        raise Refused(f"{file} is not a CORE map (no `map` record); write it with `lm core-map RUN_DIR ...`")
    return CoreMap.from_record(record["map"])


def loss_sd(low: float, high: float, level: float = LEVEL) -> float:
    """A loss prediction's standard deviation from its central `level` interval (normal)."""
    return max(0.0, (high - low) / (2.0 * norm.ppf(0.5 + level / 2)))


def run_forecast(base: CoreMap, points: list[Point], name: str | None, endings: dict) -> dict:
    """forecast.json's `core`: the map (`base` with its shift recalibrated on the run's own `points` when one
    reaches SIGNAL) and the CORE at each loss ending {name: (loss, low, high)}, with 90% intervals."""
    usable = [p for p in points if carries_signal(p)]
    cmap = calibrate(base, usable, f"this run's {len(usable)} CORE milestones") if usable else base
    why = (
        None
        if usable
        else f"no CORE milestone reached {SIGNAL:g} clear of chance, so the shift is not the run's"
    )
    out = {"name": name, "map": cmap.record(), "label": cmap.label(), "milestones": len(points), "why": why}
    for key, (loss, low, high) in endings.items():
        out[key] = cmap.predict(loss, loss_sd(low, high)).record() | {"loss": loss}
    return out
