"""Forecasts from a calibrated shape prior, and the multi-power law (lm.numbers.loss_prior)."""

import json

import numpy as np
import pytest

from lm.base.exits import Refused
from lm.callbacks.stopper import EarlyStopper
from lm.checkpoint.run_state import RunState
from lm.config import EarlyStoppingConfig, OptimConfig
from lm.numbers.loss_law import ScheduleLaw, fit_schedule_law, lam_for
from lm.numbers.loss_prior import (
    PriorLaw,
    ShapePrior,
    fit_forecast,
    fit_prior_law,
    fit_shape,
    priors_from_curves,
    priors_record,
    read_priors,
)
from lm.numbers.lr_schedule import multipliers
from lm.run.report import law_sentence

WSD = OptimConfig(schedule="wsd", warmup_steps=50, decay_fraction=0.2, min_lr_ratio=0.1)
PLAN = 2000
STEPS = np.arange(100, PLAN + 1, 100)


def schedule_curve(alpha: float, gain: float, noise: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A wsd curve made with the schedule law of shape (alpha, gain) (gain in the plan's scaled units), plus
    evaluation noise."""
    mult = multipliers(WSD, PLAN)
    scale = float(mult.sum())
    A = 1.0 * scale**alpha  # the power term is 1.0 at the plan's end
    law = ScheduleLaw(L0=2.0, A=A, alpha=alpha, C=gain * alpha * 1.0 / scale, lam=lam_for(PLAN))
    rng = np.random.default_rng(seed)
    return mult, law.curve(mult)[STEPS - 1] + rng.normal(0.0, noise, len(STEPS))


def test_a_prior_from_calibration_curves_pins_the_forecast_at_a_third_of_the_run():
    # Calibration: two full curves of the same shape (their own noise); the run: a third curve, seen to 30%.
    curves = [(STEPS, schedule_curve(0.5, 6.0, 0.005, seed)[1], multipliers(WSD, PLAN)) for seed in (1, 2)]
    prior = priors_from_curves(curves, "two synthetic calibration curves")["schedule"]
    assert prior.mean["alpha"] == pytest.approx(0.5, abs=0.05) and prior.source.endswith("(2 curve(s))")
    mult, y = schedule_curve(0.5, 6.0, 0.005, seed=3)
    final = float(schedule_curve(0.5, 6.0, 0.0)[1][-1])
    early = STEPS <= 0.3 * PLAN
    law = fit_prior_law(STEPS[early], y[early], mult, prior)
    p = law.predict(mult)
    assert abs(p.loss - final) < 0.02 and p.low <= final <= p.high
    assert law.record()["prior"]["source"] == prior.source and law.c_source == "prior"
    # Without the prior (the law as before: alpha free, the default anneal gain 8.5) it is off by more.
    blind = fit_schedule_law(STEPS[early], y[early], mult, min_points=3)
    assert abs(blind.predict(mult).loss - final) > max(0.025, 2 * abs(p.loss - final))


def mpl_curve(noise: float = 0.0, seed: int = 0) -> tuple[np.ndarray, PriorLaw]:
    mult = multipliers(WSD, PLAN)
    theta = {"alpha": 0.4, "b": 0.3}
    fixed = {"C": 30.0, "beta": 0.5, "gamma": 0.5}
    prior = ShapePrior("multi_power", {**theta, **fixed}, {}, "truth")
    law = PriorLaw("multi_power", 2.0, 1.0, theta, fixed, float(mult.sum()), lam_for(PLAN), 0.0, 0, prior)
    rng = np.random.default_rng(seed)
    return law.curve(mult)[STEPS - 1] + rng.normal(0.0, noise, len(STEPS)), law


def test_the_multi_power_law_drops_with_the_decay_and_its_fit_recovers_the_shape():
    y, law = mpl_curve()
    mult = multipliers(WSD, PLAN)
    curve = law.curve(mult)
    stable = law.curve(multipliers(OptimConfig(schedule="constant", warmup_steps=50), PLAN))  # no drop
    assert curve[1599] == pytest.approx(stable[1599]) and curve[-1] < stable[-1] - 0.04
    shape = fit_shape(STEPS, y, mult, "multi_power")
    assert shape["alpha"] == pytest.approx(0.4, rel=0.1) and shape["b"] == pytest.approx(0.3, rel=0.15)
    # A run seen to 30% with the law's shape as its prior: the final loss within 0.02, inside the interval.
    y_noisy, _ = mpl_curve(noise=0.005, seed=4)
    prior = ShapePrior("multi_power", shape, {"alpha": 0.02, "b": 0.2}, "calibration")
    early = STEPS <= 0.3 * PLAN
    fit = fit_prior_law(STEPS[early], y_noisy[early], mult, prior)
    p = fit.predict(mult)
    assert p.loss == pytest.approx(float(curve[-1]), abs=0.02) and p.low <= curve[-1] <= p.high


def test_auto_forecasts_with_the_better_law_and_its_interval_covers_both():
    y, _ = mpl_curve(noise=0.003, seed=5)
    mult = multipliers(WSD, PLAN)
    priors = priors_from_curves([(STEPS, mpl_curve(0.003, s)[0], mult) for s in (6, 7)], "synthetic")
    law = fit_forecast(STEPS, y, mult, "auto", priors)
    assert law.choice.startswith("auto: rms error on the last 5 point(s) held out")
    p = law.predict(mult)
    for model in ("schedule", "multi_power"):
        q = fit_forecast(STEPS, y, mult, model, priors).predict(mult)
        assert p.low <= q.low + 1e-9 and p.high >= q.high - 1e-9


def test_the_stopper_forecasts_from_a_calibration_file_and_says_which_prior(tmp_path):
    mult = multipliers(WSD, PLAN)
    curves = [(STEPS, schedule_curve(0.5, 6.0, 0.005, seed)[1], mult) for seed in (1, 2)]
    path = tmp_path / "calibration.json"
    path.write_text(
        json.dumps({"law": {}, "forecast_prior": priors_record(priors_from_curves(curves, "cal"))})
    )
    cfg = EarlyStoppingConfig(forecast_prior=str(path), forecast_min_points=3)
    stopper = EarlyStopper(
        cfg, meter=None, run_dir=tmp_path, run_state=RunState(), flat_lr=True, optim=WSD, schedule_steps=PLAN
    )
    _, y = schedule_curve(0.5, 6.0, 0.005, seed=3)
    for step, loss in zip(STEPS[:6], y[:6], strict=True):
        stopper.observe(int(step), int(step) * 512, None, float(loss))
    law = stopper.last_choices["law"]
    assert law["model"] == "schedule" and law["prior"]["source"] == "cal (2 curve(s))"
    assert "shape prior: cal (2 curve(s))" in law_sentence(law)
    # Without a prior the record says so, and the law is the one of before.
    plain = EarlyStopper(
        EarlyStoppingConfig(forecast_min_points=3),
        None,
        tmp_path,
        flat_lr=True,
        optim=WSD,
        schedule_steps=PLAN,
        run_state=RunState(),
    )
    for step, loss in zip(STEPS[:6], y[:6], strict=True):
        plain.observe(int(step), int(step) * 512, None, float(loss))
    assert plain.last_choices["law"]["prior"] is None and "no calibrated prior" in law_sentence(
        plain.last_choices["law"]
    )


def test_a_file_without_a_prior_and_an_unknown_model_are_refused(tmp_path):
    path = tmp_path / "law.json"
    path.write_text(json.dumps({"law": {"E": 1.0}, "rmse": 0.01}))
    with pytest.raises(Refused, match="no forecast prior in it.*lm plan --calibrate"):
        read_priors(path)
    with pytest.raises(Refused, match="unreadable"):
        read_priors(tmp_path / "missing.json")
    with pytest.raises(Refused, match="forecast_model='power'"):
        EarlyStoppingConfig(forecast_model="power")


def test_a_calibration_run_s_logged_training_loss_gives_the_prior(tmp_path):
    """`lm plan --calibrate` fits the prior to each run's logged training loss (its runs validate once)."""
    from torch.utils.tensorboard import SummaryWriter

    from lm.store import rundir
    from lm.tools.calibrate import run_curve

    mult = multipliers(WSD, PLAN)
    scale = float(mult.sum())
    law = ScheduleLaw(L0=2.0, A=scale**0.5, alpha=0.5, C=6.0 * 0.5 / scale, lam=lam_for(PLAN))
    curve, rng = law.curve(mult), np.random.default_rng(8)
    curves = []
    for name in ("a", "b"):
        writer = SummaryWriter(str(tmp_path / name / rundir.TB))
        for step in range(9, PLAN, 10):  # Lightning logs the loss of step s (s + 1 updates) at step s
            writer.add_scalar("train/loss", curve[step] + rng.normal(0.0, 0.02), step)
        writer.close()
        curves.append(run_curve(tmp_path / name, WSD, PLAN))
    prior = priors_from_curves(curves, "calibration")["schedule"]
    assert prior.mean["alpha"] == pytest.approx(0.5, abs=0.05)
    assert prior.mean["anneal_gain"] == pytest.approx(6.0, rel=0.2)
