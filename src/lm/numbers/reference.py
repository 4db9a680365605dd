"""The reference-curve forecast: a run's final loss read off a finished sibling's validation curve.

A sibling run (usually a smaller model) trained with the same LR schedule, tokens per step and data order
already carries what a law cannot fit from a few points: the drop its decay banked, and the data order's bumps,
which adjacent sizes share (residual correlation 0.79-0.96 on lm's recorded curves). The forecast moves the
reference's final loss by this run's offset from it at the newest validation seen:

    forecast = L_ref(end) + (L_run(f) - L_ref(f))

compared at the same fraction f of each run (the same step when their lengths match; across lengths at matched
tokens per parameter, the collapse form of Qiu et al. 2025, "Scaling collapse reveals universal dynamics in
compute-optimally trained neural networks"). The reference is interpolated linearly in f. With several
references the one nearest this run at f (the smallest offset) is used.

The 90% interval has one meaning whatever the references: a split-conformal bound on |error| over forecasts
that never saw this run. Its calibration errors are lm's recorded pairs at this fraction (`RECORDED_ERRORS`,
measured on tests/fixtures/curves: a forecast of each curve from every other one with the same key) pooled with
the references' forecasts of each other (leave-one-curve-out, with two or more). The half-width is the
ceil((n + 1) x 0.9)-th smallest of those n errors (Vovk et al. 2005; Angelopoulos & Bates 2021), never less than
`NOISE`. Its coverage is measured out of sample on the two ladders that chose nothing
(experiments/2026-11-26-forecast-reference, "2026-11-28"), and a test keeps it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import DataConfig, EarlyStoppingConfig, OptimConfig
from lm.numbers.loss_law import Prediction

NOISE = 0.01
"""The least half-width of an interval: one in-run validation point's noise on the recorded curves (0.009-0.019)."""

COVERAGE = 0.9
"""The interval's nominal coverage."""

RECORDED_ERRORS = {
    0.1: (0.007, 0.007, 0.011, 0.011, 0.038, 0.038, 0.054, 0.054, 0.12, 0.12, 0.158, 0.158, 0.242, 0.242, 0.249, 0.249),
    0.2: (0.0, 0.0, 0.005, 0.005, 0.026, 0.026, 0.026, 0.026, 0.051, 0.051, 0.083, 0.083, 0.088, 0.088, 0.107, 0.107),
    0.3: (0.002, 0.002, 0.024, 0.024, 0.026, 0.026, 0.049, 0.049, 0.051, 0.051, 0.073, 0.073, 0.1, 0.1, 0.119, 0.119),
    0.5: (0.024, 0.025, 0.029, 0.029, 0.048, 0.048, 0.054, 0.054, 0.064, 0.064, 0.067, 0.067, 0.095, 0.095, 0.114, 0.115),
    0.8: (0.0, 0.0, 0.009, 0.009, 0.023, 0.023, 0.024, 0.024, 0.033, 0.033, 0.036, 0.036, 0.036, 0.036, 0.085, 0.085),
}  # fmt: skip
"""|error| of every ordered pair of lm's recorded curves with the same schedule, length and batch (16 pairs of
tiny/small/medium shapes, 0.2-10 tokens per parameter, scored on the in-run validation loss), by fraction of the
run: the interval's calibration errors. experiments/2026-11-26-forecast-reference/bench.py writes them and
tests/numbers/test_reference.py keeps them equal to what it measures. A fraction between two uses the earlier
one's (errors shrink as a run goes on); from 100% the interval is `NOISE`."""
RECORDED_RATIO_ERRORS = {
    0.1: (0.01, 0.012, 0.035, 0.036, 0.045, 0.049, 0.051, 0.052, 0.054, 0.061, 0.065, 0.066, 0.082, 0.091, 0.105, 0.113),
    0.2: (0.004, 0.004, 0.016, 0.018, 0.02, 0.021, 0.048, 0.049, 0.067, 0.072, 0.1, 0.106, 0.113, 0.125, 0.151, 0.161),
    0.3: (0.026, 0.028, 0.04, 0.041, 0.064, 0.065, 0.065, 0.071, 0.09, 0.096, 0.107, 0.113, 0.15, 0.152, 0.159, 0.166),
    0.5: (0.038, 0.039, 0.051, 0.054, 0.056, 0.057, 0.087, 0.087, 0.088, 0.093, 0.093, 0.095, 0.113, 0.122, 0.141, 0.154),
    0.8: (0.006, 0.006, 0.012, 0.012, 0.028, 0.029, 0.031, 0.032, 0.039, 0.044, 0.045, 0.047, 0.05, 0.054, 0.094, 0.099),
}  # fmt: skip
"""The same for the `ratio` map."""


def conformal(errors, coverage: float = COVERAGE) -> float:
    """The split-conformal bound on |error|: the ceil((n + 1) x coverage)-th smallest of n errors (the largest
    when n is too small for the rank: then the bound covers less than `coverage`, and the forecast says from
    how many). An error that is not finite is refused: a NaN sorts anywhere and an inf makes the width inf, and
    either comes only from a curve that should have been refused when read."""
    a = np.sort(np.abs(np.asarray(errors, float)))
    if not np.isfinite(a).all():
        raise Refused(
            f"{int((~np.isfinite(a)).sum())} of {len(a)} calibration errors are not finite: a reference curve "
            "holds a diverged (NaN or inf) validation; replace it with a run that finished cleanly"
        )
    if not len(a):
        return NOISE
    return float(a[min(len(a), math.ceil((len(a) + 1) * coverage)) - 1])


def recorded_errors(fraction: float, how: str = "offset") -> tuple[float, ...]:
    """The recorded calibration errors at `fraction` of the run (`RECORDED_ERRORS`); none from 100%."""
    table = RECORDED_ERRORS if how == "offset" else RECORDED_RATIO_ERRORS
    if fraction >= 1.0:
        return ()
    return table[max([f for f in table if f <= fraction + 1e-9], default=min(table))]


KEY_FIELDS = (
    "optim.name",
    "optim.schedule",
    "optim.warmup_fraction",
    "optim.decay_fraction",
    "optim.min_lr_ratio",
    "tokens_per_step",
    "data.seq_len",
    "data.seed",
    "data.batch_ramp_fraction",
    "data.batch_ramp_start",
    "data.seq_len_warmup_fraction",
    "data.seq_len_warmup_start",
)
"""What a reference must share with the run: the optimizer, the LR schedule's shape (warm-up as a fraction of
the run, so a reference of another length at matched tokens per parameter qualifies), the configured tokens of
one full optimizer step (batch x seq_len x accumulation x devices, never an average over a batch ramp), the data
order, and the shape of the batch ramp and of the sequence-length warm-up (each as a fraction of the run, 0
when off, and its first share). A key that a recorded curve lacks is not compared, and the forecast lists it as
unchecked."""

FRACTIONS = ("optim.warmup_fraction", "data.batch_ramp_fraction", "data.seq_len_warmup_fraction")
"""Keys that are a number of steps as a fraction of the run: compared within `WARMUP_TOLERANCE`."""


def fraction(steps: int, schedule_steps: int) -> float:
    """`steps` as a fraction of the run, to 4 significant digits (a 2,000-step warm-up of 10M steps is 0.0002)."""
    return float(f"{steps / max(1, schedule_steps):.4g}")


def curve_key(
    optim: OptimConfig, schedule_steps: int, tokens_per_step: int, data: DataConfig | None
) -> dict[str, Any]:
    """The key of a run's curve (KEY_FIELDS) from its config; without `data`, no data keys. `tokens_per_step`
    is the configured full step (`RunPlan.tokens_per_step`)."""
    key = {
        "optim.name": optim.name,
        "optim.schedule": optim.schedule,
        "optim.warmup_fraction": fraction(optim.warmup_steps, schedule_steps),
        "optim.decay_fraction": optim.decay_fraction if optim.schedule == "wsd" else None,
        "optim.min_lr_ratio": optim.min_lr_ratio,
        "tokens_per_step": tokens_per_step,
    }
    if data is not None:
        ramp = data.batch_ramp_steps > 0 and data.batch_ramp_start < 1
        warm = data.seq_len_warmup_steps > 0 and data.seq_len_warmup_start < 1
        key |= {
            "data.seq_len": data.seq_len,
            "data.seed": data.seed,
            "data.batch_ramp_fraction": fraction(data.batch_ramp_steps, schedule_steps) if ramp else 0.0,
            "data.batch_ramp_start": data.batch_ramp_start if ramp else None,
            "data.seq_len_warmup_fraction": fraction(data.seq_len_warmup_steps, schedule_steps)
            if warm
            else 0.0,
            "data.seq_len_warmup_start": data.seq_len_warmup_start if warm else None,
        }
    return key


@dataclass(frozen=True)
class Curve:
    """One finished run's validation losses, by optimizer step, with its key and length."""

    name: str
    steps: np.ndarray
    losses: np.ndarray
    total_steps: int
    key: dict[str, Any] = field(default_factory=dict)

    @property
    def fractions(self) -> np.ndarray:
        return self.steps / self.total_steps

    @property
    def final(self) -> float:
        return float(self.losses[-1])

    def at(self, fraction: float) -> float:
        """The loss at a fraction of the run, interpolated linearly between validations."""
        return float(np.interp(fraction, self.fractions, self.losses))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Curve:
        """From a curve record (name, steps, losses, total_steps, key), as `lm.run.references.read_reference` reads one."""
        steps, losses = np.asarray(record["steps"], float), np.asarray(record["losses"], float)
        if not np.isfinite(losses).all():
            raise Refused(
                f"reference curve {record['name']!r} has {int((~np.isfinite(losses)).sum())} validation loss(es) "
                "that are not finite (a NaN or inf: the run diverged there); a reference must be a run that "
                "finished cleanly"
            )
        if len(steps) < 2 or len(steps) != len(losses) or not np.all(np.diff(steps) > 0):
            raise Refused(
                f"reference curve {record['name']!r} needs at least 2 validation points at increasing steps; "
                "validate the reference run more often (trainer.val_every_steps) or pick a finished run"
            )
        if steps[-1] < 0.95 * record["total_steps"]:
            raise Refused(
                f"reference curve {record['name']!r} ends at step {int(steps[-1])} of {record['total_steps']}: "
                "a reference must have finished its schedule (its final loss is what the forecast moves)"
            )
        return cls(record["name"], steps, losses, int(record["total_steps"]), dict(record.get("key") or {}))


WARMUP_TOLERANCE = 0.1
"""How far (relative) a reference's warm-up, batch ramp or sequence-length warm-up may be from the run's, as
fractions of each run: a warm-up rounded to whole steps at another length (45 of 905 steps against 169 of
3,385) is the same schedule shape. `lm plan --sibling` picks its steps so that its own land within half this."""


def same(k: str, a: Any, b: Any) -> bool:
    if k in FRACTIONS and isinstance(a, float | int) and isinstance(b, float | int):
        return abs(a - b) <= WARMUP_TOLERANCE * max(a, b)
    return a == b


def mismatch(reference: Curve, run_key: dict[str, Any]) -> str | None:
    """The first key on which the reference differs from the run, as a sentence; None when they match."""
    for k in KEY_FIELDS:
        if k in reference.key and k in run_key and not same(k, reference.key[k], run_key[k]):
            return (
                f"early_stopping.forecast_reference {reference.name!r} differs from this run in {k}: "
                f"{reference.key[k]!r} there, {run_key[k]!r} here; a reference must share the LR schedule's "
                "shape, the optimizer, the tokens per step, the data order, the batch ramp and the sequence-length "
                "warm-up"
            )
    return None


def unchecked(references: list[Curve]) -> list[str]:
    """The keys some reference does not record (not compared)."""
    return [k for k in KEY_FIELDS if any(k not in r.key for r in references)]


MAPS = ("offset", "ratio")
"""How a reference's curve is moved onto the run (`early_stopping.forecast_reference_map`): `offset` keeps the
run's gap to the reference (L_run(1) = L_ref(1) + L_run(f) - L_ref(f)); `ratio` keeps the run's loss as a share of
the reference's (L_run(1) = L_run(f) x L_ref(1) / L_ref(f)), so the gap shrinks as both curves fall: the collapse
form (Qiu et al. 2025) with the irreducible loss at 0. Measured (experiments/2026-11-26-forecast-reference): at
~20 tokens per parameter the ratio halves the offset's error from 30% of the run (worst 0.082 against 0.208); at
~4 tokens per parameter and on the unmatched recorded curves it is worse (0.272 against 0.165, 0.166 against
0.119). `offset` stays the default."""


def offset_forecast(
    reference: Curve, fractions: np.ndarray, losses: np.ndarray, how: str = "offset"
) -> float:
    """The run's final loss from one reference, moved by the run's newest point (`MAPS`)."""
    at = reference.at(float(fractions[-1]))
    if how == "ratio":
        return float(losses[-1]) * reference.final / at
    return reference.final + float(losses[-1]) - at


def loo_errors(references: list[Curve], fraction: float, how: str = "offset") -> list[float]:
    """Each reference forecast from every other one with its points up to `fraction`: the errors."""
    errors = []
    for target in references:
        seen = target.fractions <= fraction + 1e-9
        if not seen.any():
            continue
        for donor in references:
            if donor is not target:
                forecast = offset_forecast(donor, target.fractions[seen], target.losses[seen], how)
                errors.append(forecast - target.final)
    return errors


@dataclass(frozen=True)
class ReferenceForecast:
    """The final loss from a reference, with the reference's name and where the interval comes from."""

    prediction: Prediction
    reference: str
    offset: float
    """This run's loss minus the reference's at the newest fraction."""
    fraction: float
    interval_from: str
    """Where the interval's calibration errors come from, and how many."""
    unchecked: list[str]
    how: str = "offset"
    """The map (`MAPS`)."""
    dropped: int = 0
    """The run's validations left out because their loss was not finite."""

    def record(self) -> dict[str, Any]:
        p = self.prediction
        return {
            "reference": self.reference,
            "final_loss": p.loss,
            "low": p.low,
            "high": p.high,
            "offset": self.offset,
            "fraction": self.fraction,
            "interval_from": self.interval_from,
            "unchecked_keys": self.unchecked,
            "map": self.how,
            "dropped": self.dropped,
        }


def forecast(
    references: list[Curve],
    steps,
    losses,
    total_steps: int,
    how: str = "offset",
    calibration: tuple[float, ...] | None = None,
) -> ReferenceForecast | None:
    """The run's final loss after `total_steps` from its validation points so far (None before the first),
    each reference moved onto the run by `how` (`MAPS`). `calibration`: the recorded errors to pool (default
    `recorded_errors` at this fraction; a benchmark that scores a recorded curve passes those without it).
    A validation whose loss is not finite is left out and counted (`dropped`); None when none is left."""
    losses = np.asarray(losses, float)
    keep = np.isfinite(losses)
    fractions, losses = np.asarray(steps, float)[keep] / total_steps, losses[keep]
    if not references or len(losses) == 0:
        return None
    f = float(fractions[-1])
    nearest = min(references, key=lambda r: abs(float(losses[-1]) - r.at(f)))
    loss = offset_forecast(nearest, fractions, losses, how)
    recorded = recorded_errors(f, how) if calibration is None else calibration
    loo = loo_errors(references, f, how) if len(references) > 1 else []
    half = max(conformal([*recorded, *loo]), NOISE)
    source = f"conformal over {len(recorded)} recorded forecasts and {len(loo)} among the references"
    return ReferenceForecast(
        Prediction(loss, loss - half, loss + half),
        nearest.name,
        float(losses[-1]) - nearest.at(f),
        f,
        source,
        unchecked(references),
        how,
        int((~keep).sum()),
    )


CADENCE = 0.05
"""The validation interval, as a fraction of the plan, that the forecast benchmarks use: at 30% of the run a
forecast sees 6 points (the recorded curves' one point per 10% gave it 3)."""


def cadence_findings(stopping: EarlyStoppingConfig, plan_steps: int, val_every_steps: int) -> list[Finding]:
    """The doctor's line on the validation cadence when the stopper forecasts (a reference forecast, or
    `use_forecast`): one point per ~5% of the plan, else its early forecasts stand on one or two points."""
    if stopping.forecast_model != "reference" and not stopping.use_forecast:
        return []
    share = val_every_steps / max(1, plan_steps)
    seen = int(0.3 * plan_steps // max(1, val_every_steps))
    what = f"validation every {val_every_steps:,} steps, {share:.1%} of the plan's {plan_steps:,}; a forecast at 30% sees {seen}"
    if share <= CADENCE * 1.5:
        return [Finding("forecast", "ok", what)]
    return [
        Finding(
            "forecast",
            "warn",
            what,
            gain="the forecast benchmarks validate every 5% of the run (experiments/2026-11-26-forecast-reference)",
            fix=f"trainer.val_every_steps={max(1, round(CADENCE * plan_steps))}",
        )
    ]
