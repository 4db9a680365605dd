"""The schedule-aware loss law: it recovers its own parameters from noisy curves made with it, and its
predictions move the way they must (a longer plan, a later cooldown, a decay all lower the final loss)."""

import json
from pathlib import Path

import numpy as np
import pytest

from lm.config import OptimConfig
from lm.numbers.loss_law import (
    ScheduleLaw,
    areas,
    block_means,
    fit_schedule_law,
    loss_for_length,
    schedule_forecast,
)
from lm.numbers.lr_schedule import lr_lambda, multipliers

TRUE = ScheduleLaw(L0=2.0, A=20.0, alpha=0.5, C=2e-3, lam=0.99)  # lam_for(2000), what the fit takes
CURVES = Path(__file__).parents[1] / "fixtures" / "curves"
WSD = OptimConfig(schedule="wsd", warmup_steps=50, decay_fraction=0.2)
COSINE = OptimConfig(schedule="cosine", warmup_steps=50)


def noisy_curve(optim: OptimConfig, total: int, noise: float, seed: int = 0):
    mult = multipliers(optim, total)
    steps = np.arange(20, total + 1, 20)
    rng = np.random.default_rng(seed)
    return mult, steps, TRUE.curve(mult)[steps - 1] + rng.normal(0.0, noise, len(steps))


def test_areas_follow_the_definition():
    mult = np.array([0.5, 1.0, 1.0, 0.5, 0.25])
    s1, s2 = areas(mult, lam=0.5)
    assert s1.tolist() == [0.5, 1.5, 2.5, 3.0, 3.25]
    # Warm-up's rise is no annealing; drops of 0.5 then 0.25 with momentum 0.5: m = 0, 0, 0, 0.5, 0.5.
    assert s2.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5, 1.0])
    assert multipliers(WSD, 100).tolist() == [lr_lambda(WSD, 100)(k) for k in range(100)]


@pytest.mark.parametrize("optim", [WSD, COSINE], ids=["wsd", "cosine"])
def test_fit_recovers_the_parameters_of_a_noisy_curve(optim):
    mult, steps, y = noisy_curve(optim, 2000, noise=0.01)
    law = fit_schedule_law(steps, y, mult)
    assert law.c_source == "fitted"
    assert abs(law.L0 - TRUE.L0) < 0.05
    assert abs(law.alpha / TRUE.alpha - 1) < 0.1
    assert abs(law.A / TRUE.A - 1) < 0.15
    assert abs(law.C / TRUE.C - 1) < 0.5
    final = law.predict(mult)
    assert final.loss == pytest.approx(float(TRUE.curve(mult)[-1]), abs=0.01)
    assert final.low <= final.loss <= final.high
    assert law.rms == pytest.approx(0.01, rel=0.3)


def test_a_fit_before_the_decay_uses_the_prior_and_says_so():
    mult, steps, y = noisy_curve(WSD, 2000, noise=0.01)
    early = steps <= 1000  # the decay starts at step 1600
    law = fit_schedule_law(steps[early], y[early], mult)
    assert law.c_source == "prior"
    assert law.C > 0
    without = fit_schedule_law(steps[early], y[early], mult, anneal_gain=None)
    assert without.C == 0
    # The prior's drop is what separates the two forecasts; its doubt widens the interval.
    with_prior, no_prior = law.predict(mult), without.predict(mult)
    assert with_prior.loss < no_prior.loss
    assert with_prior.high - with_prior.low > no_prior.high - no_prior.low


def test_predictions_are_monotone_where_they_must_be():
    mult, steps, y = noisy_curve(WSD, 2000, noise=0.01)
    law = fit_schedule_law(steps, y, mult)
    # A longer plan (decay included) ends lower.
    lengths = [loss_for_length(law, WSD, n).loss for n in (500, 1000, 2000, 4000)]
    assert lengths == sorted(lengths, reverse=True)
    # Cooling down later ends lower, and every cooldown ends below the loss of the stable phase at that step.
    stable = law.curve(multipliers(WSD, 2000))
    cooled = [schedule_forecast(law, WSD, 2000, step, 200).cooldown_now.loss for step in (400, 800, 1200)]
    assert cooled == sorted(cooled, reverse=True)
    assert all(c < stable[step - 1] for c, step in zip(cooled, (400, 800, 1200), strict=True))
    # Continuing to the plan's end beats cooling down at 40% of it.
    f = schedule_forecast(law, WSD, 2000, 800, 200)
    assert f.plan_end.loss < f.cooldown_now.loss
    assert f.cooldown_steps == 200


def test_the_forecast_prices_more_steps_and_stretches_to_the_chinchilla_count():
    mult, steps, y = noisy_curve(WSD, 2000, noise=0.01)
    law = fit_schedule_law(steps, y, mult)
    f = schedule_forecast(law, WSD, 2000, 800, 80, chinchilla_steps=6000)
    assert f.chinchilla == loss_for_length(law, WSD, 6000) and f.chinchilla_steps == 6000
    assert f.twice_the_steps == loss_for_length(law, WSD, 1600)
    assert f.chinchilla.loss < f.twice_the_steps.loss < f.cooldown_now.loss
    far = schedule_forecast(law, WSD, 2000, 800, 80, chinchilla_steps=20_001)  # over MAX_STRETCH x the plan
    assert far.chinchilla is None and far.chinchilla_steps is None
    # A loss point now gets dearer as the run goes on.
    now = [schedule_forecast(law, WSD, 2000, s, 80).steps_per_loss_point_now for s in (400, 800, 1200)]
    assert now == sorted(now) and now[0] > 0
    c = f.choices(10.0, 0.5)
    p = f.chinchilla
    usd = 10.0 + (6000 - 800) * 0.5
    assert c["chinchilla"] == {"loss": p.loss, "low": p.low, "high": p.high, "usd": usd, "steps": 6000}
    assert c["twice_the_steps"]["usd"] == 10.0 + 800 * 0.5 and c["twice_the_steps"]["steps"] == 1600
    assert c["usd_per_loss_point_now"] == f.steps_per_loss_point_now * 0.5
    unpriced = f.choices(None, None)  # a run without a price still gets its losses
    assert unpriced["plan_end"]["usd"] is None and unpriced["usd_per_loss_point_now"] is None
    assert unpriced["plan_end"]["loss"] == c["plan_end"]["loss"]


def test_block_means_average_without_lag():
    steps, values = block_means(np.arange(10, 110, 10), np.arange(10.0), 5)
    assert steps.tolist() == [30, 80]
    assert values.tolist() == [2.0, 7.0]


def test_too_few_points_give_no_fit():
    mult = multipliers(WSD, 100)
    assert fit_schedule_law([10, 20, 30], [5.0, 4.0, 3.5], mult) is None


def test_on_a_recorded_wsd_run_the_law_foresees_the_decay_that_a_blind_fit_misses():
    """The recorded tiny wsd run (tests/fixtures/curves, experiments/2026-11-23-forecast): fitted on the validation
    points up to the decay (80% of the run), the law predicts the final, decayed loss; without the prior on
    the decay's drop (C = 0, as blind to the decay as the token power law lm used until 2026-11-24) it
    extrapolates the stable phase and lands high."""
    curve = json.loads((CURVES / "tiny_wsd_2000.json").read_text())
    o = curve["optim"]
    optim = OptimConfig(schedule="wsd", warmup_steps=o["warmup_steps"], decay_fraction=o["decay_fraction"])
    mult = multipliers(optim, curve["total_steps"])
    steps, losses = np.array(curve["val"]["step"]), np.array(curve["val"]["loss"])
    before = steps <= 1600
    final = losses[-1]
    law = fit_schedule_law(steps[before], losses[before], mult)
    assert law.c_source == "prior"
    p = law.predict(mult)
    assert abs(p.loss - final) < 0.03 and p.low <= final <= p.high
    blind = fit_schedule_law(steps[before], losses[before], mult, anneal_gain=None)
    assert blind.predict(mult).loss - final > 0.05


def test_on_a_recorded_cosine_run_the_prior_keeps_an_early_fit_steady():
    """Under cosine S1 and S2 grow together, so C is poorly determined early; tied to the prior it cannot
    swing the forecast (without the tie it was off by 0.3 at 30% of this run)."""
    curve = json.loads((CURVES / "tiny_cosine_2000.json").read_text())
    optim = OptimConfig(schedule="cosine", warmup_steps=curve["optim"]["warmup_steps"])
    mult = multipliers(optim, curve["total_steps"])
    steps, losses = np.array(curve["val"]["step"]), np.array(curve["val"]["loss"])
    for upto in (600, 800, 1000):  # 30%, 40%, 50% of the run
        seen = steps <= upto
        law = fit_schedule_law(steps[seen], losses[seen], mult)
        assert law.c_source == "fitted"
        assert abs(law.predict(mult).loss - losses[-1]) < 0.06


def test_repeated_tokens_and_excess_parameters_are_worth_less():
    """Muennighoff et al. 2023's data-constrained law: within an epoch nothing changes; 4 epochs are worth ~93%
    of fresh tokens; endless repetition is worth at most (1 + R*) epochs; the inverse undoes it."""
    from lm.numbers.loss_law import (
        BESIROGLU,
        CHINCHILLA_TOKENS_PER_PARAM,
        PARAM_REPEAT_SCALE,
        REPEAT_SCALE,
        effective_params,
        effective_tokens,
        tokens_for_effective,
    )

    u = 1e7
    assert effective_tokens(0.5 * u, u) == 0.5 * u and effective_tokens(5 * u, None) == 5 * u
    assert 0.92 < effective_tokens(4 * u, u) / (4 * u) < 0.94
    assert effective_tokens(1e6 * u, u) == pytest.approx(u * (1 + REPEAT_SCALE))
    for tokens in (0.3 * u, 2 * u, 40 * u):
        assert tokens_for_effective(effective_tokens(tokens, u), u) == pytest.approx(tokens)
    assert tokens_for_effective(u * (1 + REPEAT_SCALE) * 1.01, u) == float("inf")
    optimal = u / CHINCHILLA_TOKENS_PER_PARAM
    assert effective_params(optimal, u) == optimal and effective_params(1e12, None) == 1e12
    assert effective_params(1e12, u) == pytest.approx(optimal * (1 + PARAM_REPEAT_SCALE))
    # The law: a repeated corpus costs loss; a target past what it can reach needs infinite tokens.
    n = 1e8
    assert BESIROGLU.loss(n, 40 * u, u) > BESIROGLU.loss(n, 40 * u)
    assert BESIROGLU.loss(n, 0.5 * u, 1e12) == pytest.approx(BESIROGLU.loss(n, 0.5 * u))
    target = BESIROGLU.loss(n, 3 * u, u)
    assert BESIROGLU.tokens_for(n, target, u) == pytest.approx(3 * u)
    assert BESIROGLU.tokens_for(n, BESIROGLU.loss(n, 1e6 * u), u) == float("inf")


def test_the_window_price_off_a_least_squares_slope_is_quieter_than_its_end_points():
    """The quieter stopper target (issue 48 item 5): $ per loss point off the slope over the window's points.
    Exact on a straight line; over 2,000 noisy windows its spread is below that of the end points' difference
    (what lm.callbacks.stopper.marginal_usd_per_loss_point reads)."""
    import math

    from lm.numbers.loss_law import usd_per_loss_point_fit

    usd = [10.0, 15.0, 20.0, 25.0, 30.0]
    assert usd_per_loss_point_fit(usd, [3.0, 2.9, 2.8, 2.7, 2.6]) == pytest.approx(50.0)
    assert usd_per_loss_point_fit(usd, [3.0, 3.0, 3.1, 3.0, 3.1]) == math.inf
    assert (
        usd_per_loss_point_fit(usd[:2], [3.0, 2.9]) is None
        and usd_per_loss_point_fit([1, None, 2], [3, 2, 1]) is None
    )
    rng = np.random.default_rng(0)
    fit, ends = [], []
    for _ in range(2000):
        loss = 3.0 - 0.02 * np.arange(5) + rng.normal(0, 0.01, 5)
        fit.append(1 / usd_per_loss_point_fit(usd, loss))
        ends.append((loss[0] - loss[-1]) / (usd[-1] - usd[0]))  # the stopper's window reads its end points
    assert np.std(fit) < 0.95 * np.std(ends)
