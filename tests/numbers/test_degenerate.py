"""Degenerate input is refused or flagged, never passed on as a number (issue 55 item 5): a zero seed spread is
"no seed spread", never p = 0; a NaN or inf is dropped and counted, or refused, in every interval, fit and
forecast path."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lm.base.exits import Refused
from lm.numbers.loss_law import usd_per_loss_point_fit
from lm.numbers.reference import Curve, conformal, forecast
from lm.numbers.stats import (
    NO_SPREAD,
    difference,
    holm_verdict,
    mean_bound,
    p_value,
    percentile_interval,
    t_interval,
    verdict,
    welch_interval,
)


def test_identical_differences_are_no_seed_spread_not_p_zero():
    """Five seeds with the same difference (a seed that is never applied): once p = 0 and "wins"."""
    diff, how = difference({s: 2.9 for s in range(5)}, {s: 3.0 for s in range(5)})
    assert how == "paired" and diff.n == 5 and diff.no_spread
    assert p_value(diff) is None
    assert verdict(diff) == NO_SPREAD and holm_verdict(diff, p_value(diff)) == NO_SPREAD
    assert "no seed spread" in str(diff)
    welch = welch_interval([2.9] * 3, [3.0] * 3)
    assert welch.no_spread and p_value(welch) is None and verdict(welch) == NO_SPREAD
    # A spread, however small, is a test.
    diff, _ = difference({0: 2.9, 1: 2.9, 2: 2.9001}, {0: 3.0, 1: 3.0, 2: 3.0})
    assert not diff.no_spread and p_value(diff) is not None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_every_interval_drops_and_counts_a_non_finite_value(bad):
    iv = t_interval([3.0, 3.1, bad, 2.9])
    assert iv.n == 3 and iv.dropped == 1 and iv.mean == pytest.approx(3.0) and math.isfinite(iv.half)
    assert t_interval([bad]) is None  # nothing finite: no interval
    iv = welch_interval([3.0, 3.1, bad], [2.8, 2.9, 2.85])
    assert iv.dropped == 1 and math.isfinite(iv.half)
    iv = percentile_interval([0.5, 0.6, bad, 0.7, 0.55], 0.6)
    assert iv.dropped == 1 and math.isfinite(iv.low) and math.isfinite(iv.high)
    with pytest.raises(Refused, match="not finite"):
        mean_bound([0.8, bad, 0.9], "upper")


def test_conformal_refuses_a_nan_error():
    assert conformal([0.01, 0.02, 0.03]) == pytest.approx(0.03)
    with pytest.raises(Refused, match="not finite"):
        conformal([0.01, math.nan, 0.03])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_reference_curve_with_a_non_finite_loss_is_refused(bad):
    record = {"name": "r", "steps": [10, 20, 30], "losses": [4.0, bad, 3.0], "total_steps": 30}
    with pytest.raises(Refused, match="not finite"):
        Curve.from_record(record)


def test_the_reference_forecast_leaves_a_non_finite_validation_out():
    ref = Curve("r", np.array([10.0, 20, 30, 40]), np.array([4.0, 3.5, 3.2, 3.0]), 40)
    clean = forecast([ref], [10, 20], [4.1, 3.6], 40)
    noisy = forecast([ref], [10, 20, 25], [4.1, 3.6, math.nan], 40)
    assert noisy is not None and math.isfinite(noisy.prediction.loss)
    assert noisy.prediction.loss == pytest.approx(clean.prediction.loss)
    assert forecast([ref], [10], [math.nan], 40) is None


def test_the_window_fit_leaves_a_non_finite_point_out_instead_of_saying_stop_now():
    usd, losses = [1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 2.99, 2.98, 2.97, 2.96]
    assert usd_per_loss_point_fit(usd, losses) == pytest.approx(100.0)
    assert usd_per_loss_point_fit(usd, [3.0, 2.99, math.nan, 2.97, 2.96]) == pytest.approx(100.0)
    assert usd_per_loss_point_fit(usd, [3.0, math.nan, math.nan, math.inf, 2.96]) is None  # < 3 left
