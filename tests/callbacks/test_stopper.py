"""The early stopper: its criteria on recorded metrics, and real tiny runs that it stops."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from lm.base.exits import Refused
from lm.callbacks.stopper import EarlyStopper
from lm.checkpoint.run_state import RunState
from lm.config import EarlyStoppingConfig, OptimConfig, to_objects
from lm.engine.module import lr_lambda
from lm.numbers.loss_law import ANNEAL_GAIN, ScheduleLaw, lam_for, schedule_forecast
from lm.numbers.lr_schedule import multipliers
from lm.numbers.reference import fraction
from lm.run.references import read_reference
from lm.run.report import forecast_section
from lm.run.train import main

from ..run.test_train import scalars

# The seed's 1B run at its phase boundaries: (step, validation loss, dollars spent). Its cost-per-loss-point
# table reads $6 -> $285 -> $550 between these points; the author stopped by hand at the last one.
SEED = [(200, 6.41, 4.0), (10_000, 2.948, 26.0), (60_000, 2.573, 120.0), (90_000, 2.494, 164.0)]
TOKENS_PER_STEP = 131_072


def replay(cfg: EarlyStoppingConfig, points, tmp_path) -> int | None:
    """Feed (step, loss, usd) points to the stopper; the index of the point at which it says stop."""
    stopper = EarlyStopper(cfg, meter=None, run_dir=tmp_path, run_state=RunState(), flat_lr=True)
    for i, (step, loss, usd) in enumerate(points):
        if stopper.observe(step, step * TOKENS_PER_STEP, usd, loss):
            return i
    return None


@pytest.mark.parametrize(
    ("threshold", "stops_at"), [(5.0, 1), (200.0, 2), (300.0, 3), (556.0, 3), (558.0, None)]
)
def test_stops_exactly_at_the_validation_that_crosses_the_threshold(tmp_path, threshold, stops_at):
    # Marginal $/loss point between consecutive boundaries: 22/3.462 = 6.35, 94/0.375 = 250.7, 44/0.079 = 557.
    cfg = EarlyStoppingConfig(max_usd_per_loss_point=threshold, window=1)
    assert replay(cfg, SEED, tmp_path) == stops_at


def test_a_trailing_window_spans_several_validations(tmp_path):
    # Window 2 at 90K compares with 10K: (164 - 26) / (2.948 - 2.494) = $304 a point.
    assert replay(EarlyStoppingConfig(max_usd_per_loss_point=303.0, window=2), SEED, tmp_path) == 3
    assert replay(EarlyStoppingConfig(max_usd_per_loss_point=305.0, window=2), SEED, tmp_path) is None


def test_the_window_fit_lets_one_unlucky_validation_weigh_less(tmp_path):
    """$100 a loss point throughout, and the newest validation 0.03 high: the window's two ends read $108 a
    point, the slope through its five points $106 (lm.numbers.loss_law.usd_per_loss_point_fit)."""
    points = [(s, 3 - 0.01 * s, float(s)) for s in range(0, 110, 10)]
    points[-1] = (100, points[-1][1] + 0.03, 100.0)
    ends = EarlyStoppingConfig(max_usd_per_loss_point=107.0, window=4)
    assert replay(ends, points, tmp_path) == 10
    assert replay(dataclasses.replace(ends, window_fit=True), points, tmp_path) is None
    stopper = EarlyStopper(
        dataclasses.replace(ends, window_fit=True),
        meter=None,
        run_dir=tmp_path,
        run_state=RunState(),
        flat_lr=True,
    )
    for step, loss, usd in points:
        stopper.observe(step, step * TOKENS_PER_STEP, usd, loss)
    price, how = stopper.marginal()
    assert price == pytest.approx(106.383, abs=1e-3) and how == "off the slope of the last 4 validations"


def test_smoothing_ignores_one_lucky_evaluation_and_a_flat_curve_is_unaffordable(tmp_path):
    flat = [(s, 3.0, s / 100) for s in range(100, 1100, 100)]
    lucky = [*flat[:5], (600, 2.9, 6.0), *flat[6:]]
    assert replay(EarlyStoppingConfig(target_loss=2.94), lucky, tmp_path) == 5
    # EMA 0.5: 0.5 x 3.0 + 0.5 x 2.9 = 2.95 never reaches the target.
    assert replay(EarlyStoppingConfig(target_loss=2.94, smoothing=0.5), lucky, tmp_path) is None
    # No loss drop at all is an infinite price per point: any threshold stops at the first full window.
    assert replay(EarlyStoppingConfig(max_usd_per_loss_point=1e12, window=3), flat, tmp_path) == 3


def test_target_loss_and_patience(tmp_path):
    losses = [5.0, 4.0, 3.5, 3.4, 3.41, 3.42, 3.39, 3.43, 3.44, 3.45]
    points = [(100 * (i + 1), loss, float(i)) for i, loss in enumerate(losses)]
    assert replay(EarlyStoppingConfig(target_loss=3.5), points, tmp_path) == 2
    # Best 3.4 at index 3; 3.41, 3.42 do not beat it; 3.39 does (min_delta 0); then three misses.
    assert replay(EarlyStoppingConfig(patience=3), points, tmp_path) == 9
    # With min_delta 0.05, 3.39 is no real improvement over 3.4: patience runs out at index 6.
    assert replay(EarlyStoppingConfig(patience=3, min_delta=0.05), points, tmp_path) == 6


def test_the_forecast_can_replace_the_trailing_window(tmp_path):
    """`use_forecast` reads the price of a loss point now off the schedule-aware law: training on 1% of the
    plan before the cooldown, against cooling down now. On a curve made with the law itself (C at the prior's
    value, so the fit recovers it) it stops at the first validation whose price crosses the threshold."""
    plan, usd_per_step = 20_000, 1e-3
    optim = OptimConfig(schedule="constant", warmup_steps=0)
    A, alpha = 20.0, 0.5
    # Under a constant LR S1 is the step count; the prior's C = g x (-dL/dS1 at the plan's end).
    true = ScheduleLaw(
        L0=2.0, A=A, alpha=alpha, C=ANNEAL_GAIN * alpha * A * plan ** (-alpha - 1), lam=lam_for(plan)
    )
    curve = true.curve(multipliers(optim, plan))
    steps = np.arange(1, 41) * 500
    points = [(int(s), float(curve[s - 1]), s * usd_per_step) for s in steps]
    price = [
        schedule_forecast(true, optim, plan, int(s), math.ceil(0.1 * s)).choices(0.0, usd_per_step)[
            "usd_per_loss_point_now"
        ]
        for s in steps
    ]
    # At a flat LR the price is $/step over the curve's slope, somewhere between the step now and the end of
    # the cooldown after the next 1% of the plan.
    s, later = steps[20], steps[20] + math.ceil(0.1 * steps[20]) + plan // 100
    assert (
        usd_per_step / (alpha * A * s ** (-alpha - 1))
        < price[20]
        < usd_per_step / (alpha * A * later ** (-alpha - 1))
    )
    threshold = math.sqrt(price[20] * price[21])  # crossed between points 20 and 21 (7% apart)
    cfg = EarlyStoppingConfig(max_usd_per_loss_point=threshold, use_forecast=True)
    stopper = EarlyStopper(
        cfg,
        meter=None,
        run_dir=tmp_path,
        run_state=RunState(),
        flat_lr=True,
        optim=optim,
        schedule_steps=plan,
    )
    for i, (step, loss, usd) in enumerate(points):  # noqa: B007 (i is read after the loop)
        said = stopper.observe(step, step * TOKENS_PER_STEP, usd, loss)
        if said:
            break
    assert i == 21 and "off the loss forecast" in said[1]
    assert stopper.last_choices["usd_per_loss_point_now"] == pytest.approx(price[21], rel=0.01)


def test_the_cooldown_decays_the_lr_linearly_to_the_floor():
    optim = OptimConfig(lr=1.0, warmup_steps=0, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1)
    window = None
    multiplier = lr_lambda(optim, 1000, lambda: window)
    assert [multiplier(s) for s in (100, 104, 108)] == [1.0, 1.0, 1.0]
    window = (100, 4)
    assert [multiplier(s) for s in (100, 101, 102, 104, 200)] == pytest.approx([1.0, 0.775, 0.55, 0.1, 0.1])
    # A slow cooldown inside the schedule's own decay never raises the LR above the schedule.
    window = (850, 1000)
    assert multiplier(900) == pytest.approx(lr_lambda(optim, 1000)(900)) == pytest.approx(0.55)


def test_a_low_threshold_stops_a_real_run_early_and_the_report_says_why(tiny_cfg, tmp_path):
    overrides = [
        "trainer.max_steps=60",
        "trainer.val_every_steps=5",
        "trainer.log_every_n_steps=1",
        "optim.warmup_steps=2",
        "sampling.max_new_tokens=8",
        "cost.price_per_hour=3600",  # a dollar a second: any real loss point costs more than $0.001
        "early_stopping=diminishing_returns",
        "early_stopping.max_usd_per_loss_point=0.001",
        "early_stopping.window=2",
        "early_stopping.smoothing=0",
        "early_stopping.cooldown_fraction=0.1",
    ]
    main(tiny_cfg(*overrides))
    run = tmp_path / "runs" / "smoke"
    stop = json.loads((run / "stop.json").read_text())
    # Validations at 5, 10, 15: a window of 2 first exists at 15. Cooldown ceil(0.1 x 15) = 2 steps, then
    # one step at the floor LR: the run ends at step 18 instead of 60.
    assert stop["criterion"] == "max_usd_per_loss_point" and stop["decided_at_step"] == 15
    assert stop["cooldown"] == [15, 2] and stop["stopped"] and stop["step"] == 18
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 18 and ckpt["run_state"]["lr_cooldown"] == [15, 2]
    lrs = [v for _, v in scalars(run, "train/lr")]
    assert lrs[-1] == pytest.approx(1e-3 * 0.1) and lrs[15] == pytest.approx(1e-3)
    report = (run / "report.md").read_text()
    assert "stopped early" in report and "over max_usd_per_loss_point=$0.00" in report
    assert any(s == 17 for s, _ in scalars(run, "val/loss"))  # Lightning validates the stopped model

    # The same command again finds the run stopped and does not train on.
    main(tiny_cfg(*overrides))
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 18


@pytest.mark.slow  # 14-22 s on 2 cores: headroom under the README command's 10 min
def test_a_budget_cap_stops_within_one_step_of_the_budget(tiny_cfg, tmp_path):
    common = ["trainer.val_every_steps=50", "sampling=off", "cost.price_per_hour=3600"]  # dollars = seconds
    # Start-up alone costs seconds (more on a loaded machine): measure it, then cap a few seconds above it.
    main(tiny_cfg(*common, "trainer.max_steps=2"))
    run = tmp_path / "runs" / "smoke"
    budget = 2 * json.loads((run / "cost.json").read_text())["usd"] + 4.0
    main(
        tiny_cfg(
            *common,
            "trainer.max_steps=100000",
            "early_stopping=budget",
            f"early_stopping.budget_usd={budget}",
            "early_stopping.cooldown_fraction=0",
        )
    )
    stop = json.loads((run / "stop.json").read_text())
    ledger = json.loads((run / "cost.json").read_text())
    assert stop["criterion"] == "budget_usd" and stop["stopped"]
    # The step that crossed the budget is the last one trained: the step before was still under it.
    assert stop["usd_previous_step"] < budget <= stop["usd"]
    # No step trained after it: what the ledger adds later is the final validation, checkpoint and shutdown.
    assert 2 < ledger["step"] == stop["step"] < 100000
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == stop["step"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("early_stopping.window=0", "early_stopping.window"),
        ("early_stopping.patience=0", "early_stopping.patience"),
        ("early_stopping.forecast_min_points=2", "forecast_min_points"),
        ("sampling.top_k=0", "sampling.top_k"),
    ],
)
def test_bad_stopping_and_sampling_values_fail_before_anything_is_built(compose, override, message):
    with pytest.raises(Refused, match=message):
        to_objects(compose(override))


@pytest.mark.slow  # 14-22 s on 2 cores: headroom under the README command's 10 min
def test_the_forecast_knows_the_schedule_and_prices_both_endings(tiny_cfg, tmp_path):
    """forecast.json and the report give "cool down now: loss X, $Y; continue to the plan's end: X', $Y'"."""
    main(
        tiny_cfg(
            "trainer.max_steps=40",
            "trainer.val_every_steps=4",
            "optim.warmup_steps=2",
            "optim.total_steps=60",  # the schedule and the plan run to step 60; this invocation stops at 40
            "phases.phases=[]",
            "sampling=off",
            "cost.price_per_hour=3600",
        )
    )
    run = tmp_path / "runs" / "smoke"
    forecast = json.loads((run / "forecast.json").read_text())
    assert list(forecast) == ["schedule"]  # the schedule-aware law is the one forecast
    sched = forecast["schedule"]
    now, end = sched["cooldown_now"], sched["plan_end"]
    # At step 40 the wsd decay (steps 48-60) has not begun: the decay's drop comes from the prior.
    assert sched["step"] == 40 and end["steps"] == 60 and sched["law"]["c_source"] == "prior"
    assert now["steps"] == 4  # cooldown_fraction 0.1 x 40 steps
    for option in (now, end):
        assert option["low"] <= option["loss"] <= option["high"]
        assert 2.0 < option["loss"] < np.log(512)  # below a uniform guess over the vocabulary
    assert end["loss"] < now["loss"]  # 20 more steps, decayed, beat 4 steps of cooldown
    # Dollars: what was spent plus the steps each ending still trains, at the run's $/step. Compared with each
    # other (exact), not with the last logged cost/usd, which the final save's wall time moves on a busy box.
    twice = sched["twice_the_steps"]
    assert twice["steps"] == 80 and twice["loss"] < now["loss"]
    assert (twice["usd"] - now["usd"]) / (end["usd"] - now["usd"]) == pytest.approx((40 - 4) / (20 - 4))
    assert 0 < now["usd"] < end["usd"]  # 4 steps of cooldown cost less than 20 more
    assert sched["usd_per_loss_point_next"] > 0 and sched["usd_per_loss_point_now"] > 0
    # 20 tokens per parameter is ~7,700 steps of this tiny model: over 10x the plan, not extrapolated.
    assert sched["chinchilla"] is None
    report = (run / "report.md").read_text()
    assert "Schedule-aware forecast, at step 40" in report and "continue to the plan's end" in report
    assert "| twice the steps so far (step 80) |" in report and "Chinchilla" not in report


def test_the_report_renders_every_ending_and_reads_records_written_before_some_existed():
    ending = {"loss": 2.5, "low": 2.4, "high": 2.6, "usd": 12.0, "steps": 100}
    law = {"L0": 2.0, "A": 20.0, "alpha": 0.5, "C": 1e-3, "n_points": 8, "rms": 0.01, "c_source": "fitted"}
    sched = {"step": 50, "law": law, "cooldown_now": {**ending, "steps": 5}, "plan_end": ending}
    sched |= {"usd_per_loss_point_next": 30.0, "c_source": "fitted"}
    old = forecast_section(sched, 2.55, at_stop=False)  # stop.json / forecast.json of 2026-11-23
    assert "| cool down now (step 55) |" in old and "| continue to the plan's end (step 100) |" in old
    assert "twice the steps" not in old and "Chinchilla" not in old and "a loss point now" not in old
    sched |= {
        "twice_the_steps": ending,
        "chinchilla": {**ending, "steps": 4000},
        "usd_per_loss_point_now": 9.0,
    }
    new = forecast_section(sched, 2.55, at_stop=True)
    assert (
        "Schedule-aware forecast when the stop was decided, at step 50" in new and "Tissue et al. 2024" in new
    )
    assert (
        "| the Chinchilla token count (20 x parameters) (step 4,000) | 2.500 (2.400-2.600) | $12.00 |" in new
    )
    assert "| a loss point now costs (training on before the cooldown) | | $9.00 |" in new


def test_a_smaller_finished_run_is_the_forecasts_reference_and_a_mismatched_one_is_refused(
    tiny_cfg, tmp_path
):
    """forecast_model=reference: a finished smaller run's curve, read from its run directory, moved onto this
    run's points; forecast.json and the report name it. A reference with another data order is refused at
    start, naming the key."""
    common = ("trainer.val_every_steps=4", "optim.warmup_steps=2", "optim.total_steps=24", "phases.phases=[]")
    main(tiny_cfg("trainer.max_steps=24", "run.name=ref", "model.d_model=32", "sampling=off", *common))
    ref = tmp_path / "runs" / "ref"
    curve = read_reference(ref).key
    assert curve["tokens_per_step"] == 512 and curve["optim.warmup_fraction"] == fraction(2, 24)
    main(
        tiny_cfg(
            "trainer.max_steps=12",  # half of the plan: the forecast reads the reference's end
            "run.name=big",
            "sampling=off",
            "early_stopping.forecast_model=reference",
            f"early_stopping.forecast_reference=[{ref}]",
            *common,
        )
    )
    run = tmp_path / "runs" / "big"
    said = json.loads((run / "forecast.json").read_text())["reference"]
    assert said["reference"] == str(ref) and said["fraction"] == pytest.approx(0.5)
    assert "conformal over" in said["interval_from"] and said["low"] < said["final_loss"] < said["high"]
    ref_final = scalars(ref, "val/loss")[-1][1]
    assert said["final_loss"] == pytest.approx(ref_final + said["offset"])
    assert f"read off `{ref}`" in (run / "report.md").read_text()
    with pytest.raises(Refused, match=r"differs from this run in data.seed: 0 there, 1 here"):
        main(
            tiny_cfg(
                "trainer.max_steps=4",
                "run.name=other_order",
                "data.seed=1",
                "early_stopping.forecast_model=reference",
                f"early_stopping.forecast_reference=[{ref}]",
                *common,
            )
        )
    assert not (tmp_path / "runs" / "other_order" / "checkpoints").exists()


@pytest.mark.parametrize("smoothing", [0.0, 0.5])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_validation_is_skipped_logged_and_the_smoothed_loss_recovers(
    tmp_path, caplog, smoothing, bad
):
    """One NaN validation once made the smoothed loss NaN for good (even at smoothing 0: the EMA multiplied it
    by 0), so no target, patience or price could fire again."""
    cfg = EarlyStoppingConfig(target_loss=2.5, patience=3, smoothing=smoothing)
    stopper = EarlyStopper(cfg, meter=None, run_dir=tmp_path, run_state=RunState(), flat_lr=True)
    assert stopper.observe(100, 100 * TOKENS_PER_STEP, 1.0, 3.0) is None
    with caplog.at_level("WARNING", logger="lm.callbacks.stopper"):
        assert stopper.observe(200, 200 * TOKENS_PER_STEP, 2.0, bad) is None
    assert "not finite" in caplog.text and stopper.skipped == 1
    assert len(stopper.points) == 1 and stopper.since_best == 0
    stopper.observe(300, 300 * TOKENS_PER_STEP, 3.0, 2.6)
    assert all(math.isfinite(p.smoothed) for p in stopper.points)
    assert stopper.points[-1].smoothed == pytest.approx(smoothing * 3.0 + (1 - smoothing) * 2.6)
    # The target still fires once the (smoothed) loss reaches it.
    assert any(stopper.observe(s, s * TOKENS_PER_STEP, s / 100, 2.0) for s in range(400, 1000, 100))


def test_a_resumed_history_holding_a_nan_recovers_at_the_next_validation(tmp_path):
    """A checkpoint written before the skip existed may hold a NaN smoothed loss and a NaN best."""
    from lm.checkpoint.run_state import ValPoint

    stopper = EarlyStopper(
        EarlyStoppingConfig(smoothing=0.5, patience=2),
        meter=None,
        run_dir=tmp_path,
        run_state=RunState(),
        flat_lr=True,
    )
    stopper.points.append(ValPoint(100, 100 * TOKENS_PER_STEP, 1.0, math.nan, math.nan))
    stopper.run.stopper.best = math.nan
    stopper.observe(200, 200 * TOKENS_PER_STEP, 2.0, 3.0)
    assert stopper.points[-1].smoothed == 3.0 and stopper.best == 3.0 and stopper.since_best == 0
