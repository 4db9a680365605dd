"""The loss forecast: a robust fit of L(D) = E + B * D^(-beta) and what it predicts."""

import math

import numpy as np
import pytest

from lm.numbers.forecast import PowerLaw, fit_power_law, forecast


@pytest.mark.parametrize(
    ("e", "b", "beta"),
    [(1.7, 400.0, 0.30), (2.2, 60.0, 0.20), (1.0, 2000.0, 0.45), (2.4, 25.0, 0.15)],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_the_parameters_of_noisy_curves_within_10_percent(e, b, beta, seed):
    rng = np.random.default_rng(seed)
    tokens = np.geomspace(1e6, 1e10, 40)  # validation points evenly spaced in log-tokens
    losses = e + b * tokens**-beta + rng.normal(0.0, 0.01, tokens.size)
    losses[rng.integers(0, tokens.size, 2)] += 0.4  # two bad evaluations: the robust weights shrug them off
    fit = fit_power_law(tokens, losses)
    assert (fit.E, fit.B, fit.beta) == pytest.approx((e, b, beta), rel=0.10)
    assert fit.n_points == tokens.size


def test_an_unweighted_fit_would_be_pulled_off_by_the_outliers():
    # Guards the Huber weighting itself: with one iteration (plain least squares) the outliers bias E.
    rng = np.random.default_rng(0)
    tokens = np.geomspace(1e6, 1e10, 40)
    losses = 2.2 + 60.0 * tokens**-0.2 + rng.normal(0.0, 0.01, tokens.size)
    losses[-6:-3] += 0.4  # late bad points weigh on E, the asymptote
    robust, plain = fit_power_law(tokens, losses), fit_power_law(tokens, losses, iterations=1)
    assert abs(robust.E - 2.2) < 0.5 * abs(plain.E - 2.2)


def test_too_few_points_give_no_fit():
    assert fit_power_law([1e6, 2e6, 4e6, 8e6], [5.0, 4.5, 4.2, 4.0], min_points=5) is None
    assert fit_power_law([1e6, 2e6, 4e6, 8e6, 1.6e7], [5.0, 4.5, 4.2, 4.0, 3.9], min_points=5) is not None


def test_a_flat_curve_fits_a_constant_and_promises_nothing():
    fit = fit_power_law(np.geomspace(1e6, 1e8, 8), np.full(8, 3.0))
    assert fit.loss(1e12) == pytest.approx(3.0, abs=1e-6)
    f = forecast(fit, 1e8, usd_per_token=1e-6)
    assert f.usd_per_loss_point_next > 1e9  # another loss point is (practically) unbuyable


def test_forecast_predictions_agree_with_the_curve():
    law = PowerLaw(E=2.0, B=100.0, beta=0.25)
    usd_per_token = 2e-8
    f = forecast(law, 1e9, plan_end_tokens=3e9, chinchilla_tokens=2e10, usd_per_token=usd_per_token)
    assert f.loss_at_plan_end == pytest.approx(2.0 + 100.0 * 3e9**-0.25)
    assert f.loss_at_chinchilla == pytest.approx(2.0 + 100.0 * 2e10**-0.25)
    # The marginal $/loss point is the cost of a small step over the loss that step buys.
    extra = 1e6
    by_difference = extra * usd_per_token / (law.loss(1e9) - law.loss(1e9 + extra))
    assert f.usd_per_loss_point_next == pytest.approx(by_difference, rel=1e-3)
    # "Another $X buys this much loss": X dollars are X / ($/token) more tokens.
    assert f.loss_bought(20.0) == pytest.approx(law.loss(1e9) - law.loss(1e9 + 1e9))
    assert law.tokens_for(float(law.loss(5e9))) == pytest.approx(5e9, rel=1e-9)
    assert math.isinf(law.tokens_for(1.9))
