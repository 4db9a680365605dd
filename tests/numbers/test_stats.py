"""lm.numbers.stats: the p values against scipy's own tests, what a non-finite seed does, bounds of the mean."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from lm.base.exits import Refused
from lm.numbers.stats import difference, holm, mean_bound, p_value, t_interval, welch_interval


def test_welch_p_uses_welch_satterthwaite_degrees_of_freedom():
    # Unequal spreads and sizes: the p once took n - 1 = 2 degrees of freedom instead of Welch's.
    a, b = [3.10, 3.30, 3.20], [2.80, 2.95, 2.90, 3.00, 2.70, 2.85]
    diff = welch_interval(a, b)
    want = stats.ttest_ind(a, b, equal_var=False)
    assert diff.df == pytest.approx(want.df)
    assert p_value(diff) == pytest.approx(want.pvalue, rel=1e-9)
    assert welch_interval({0: 1.0}.values(), b) is None


def test_paired_p_is_scipys_paired_t_test():
    variant, base = {0: 2.9, 1: 3.05, 2: 3.0, 3: 2.97}, {0: 3.0, 1: 3.1, 2: 3.02, 3: 3.01}
    diff, how = difference(variant, base)
    assert how == "paired" and diff.df == 3
    want = stats.ttest_rel(list(variant.values()), list(base.values()))
    assert p_value(diff) == pytest.approx(want.pvalue, rel=1e-9)


def test_a_non_finite_seed_of_either_arm_leaves_the_paired_difference():
    base = {0: 3.0, 1: 3.1, 2: 2.95, 3: math.inf}
    variant = {0: 2.9, 1: 3.0, 2: 2.86, 3: 2.9}
    diff, how = difference(variant, base)  # once -inf ± nan for every arm against this baseline
    assert how == "paired" and diff.n == 3 and math.isfinite(diff.half)
    assert diff.mean == pytest.approx(-0.0967, abs=1e-4) and diff.high < 0
    diff, _ = difference({**variant, 1: math.nan}, base)
    assert diff.n == 2 and math.isfinite(diff.mean)


def test_holm_refuses_nan_and_keeps_none():
    with pytest.raises(Refused, match="non-finite"):
        holm({"a": 0.01, "b": math.nan})
    assert holm({"a": 0.01, "b": None, "c": 0.04}) == {
        "a": pytest.approx(0.02),
        "b": None,
        "c": pytest.approx(0.04),
    }


def test_mean_bound_of_bounds_is_one_sided():
    values = [0.8, 0.9, 1.0]
    upper = mean_bound(values, "upper")
    assert upper == pytest.approx(0.9 + stats.t.ppf(0.95, 2) * 0.1 / math.sqrt(3))
    assert mean_bound(values, "lower") == pytest.approx(1.8 - upper)
    assert upper < t_interval(values).high  # one-sided 95% is inside the two-sided interval's end
    assert mean_bound([1.0], "upper") is None
