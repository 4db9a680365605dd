"""The reference-curve forecast (lm.numbers.reference): the offset map, its empirical intervals, the key a
reference must share, and the benchmark on held-out recorded curves that keeps score."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lm.base.exits import Refused
from lm.config import DataConfig, OptimConfig
from lm.numbers import reference
from lm.numbers.reference import Curve, curve_key, forecast, mismatch
from lm.run.references import load_references, read_reference

from ..helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "experiments" / "2026-11-26-forecast-reference"


def synthetic(name: str, level: float, total: int = 1000, every: int = 50, bump: float = 0.0) -> Curve:
    steps = np.arange(every, total + 1, every, dtype=float)
    losses = level + 3.0 * (steps / 10) ** -0.3 + bump * np.sin(steps / 37)
    return Curve(name, steps, losses, total, {"optim.schedule": "wsd", "tokens_per_step": 512})


def test_a_run_parallel_to_its_reference_is_forecast_exactly_with_the_recorded_interval():
    ref = synthetic("small", 2.0, bump=0.05)  # the bumps are shared: the data order is the same
    run = synthetic("large", 1.7, bump=0.05)
    seen = run.steps <= 300
    f = forecast([ref], run.steps[seen], run.losses[seen], run.total_steps)
    assert f.prediction.loss == pytest.approx(run.final, abs=1e-12)
    assert f.reference == "small" and f.offset == pytest.approx(-0.3) and f.fraction == pytest.approx(0.3)
    half = (f.prediction.high - f.prediction.low) / 2
    assert half == pytest.approx(reference.conformal(reference.recorded_errors(0.3)))
    assert f.interval_from == "conformal over 16 recorded forecasts and 0 among the references"


def test_the_ratio_map_forecasts_a_run_proportional_to_its_reference_exactly():
    """`forecast_reference_map=ratio`: a run whose loss is a fixed share of the reference's (the collapse form,
    irreducible loss 0) is forecast exactly, where the offset map keeps the early gap and misses."""
    ref = synthetic("small", 2.0, bump=0.05)
    run = Curve("large", ref.steps, 0.9 * ref.losses, ref.total_steps, ref.key)
    seen = run.steps <= 300
    ratio = forecast([ref], run.steps[seen], run.losses[seen], run.total_steps, "ratio")
    offset = forecast([ref], run.steps[seen], run.losses[seen], run.total_steps)
    assert ratio.prediction.loss == pytest.approx(run.final, abs=1e-12)
    assert offset.prediction.loss < run.final - 0.02  # the gap at 30% is larger than at the end
    assert ratio.record()["map"] == "ratio" and offset.record()["map"] == "offset"
    half = (ratio.prediction.high - ratio.prediction.low) / 2
    assert half == pytest.approx(reference.conformal(reference.recorded_errors(0.3, "ratio")))
    from lm.config import EarlyStoppingConfig

    with pytest.raises(Refused, match="forecast_reference_map='scaled': use offset or ratio"):
        EarlyStoppingConfig(forecast_reference_map="scaled")


def test_several_references_give_a_leave_one_curve_out_interval_and_the_nearest_is_used():
    refs = [synthetic("a", 2.3), synthetic("b", 2.0), synthetic("c", 1.9)]
    run = synthetic("d", 1.8)
    f = forecast(refs, run.steps[:6], run.losses[:6], 1000)
    assert f.reference == "c"  # the smallest offset at the newest point
    assert f.interval_from == "conformal over 16 recorded forecasts and 6 among the references"
    # Parallel curves: every leave-one-out error is 0; the recorded errors set the bound (one meaning).
    recorded = reference.recorded_errors(0.3)
    assert f.prediction.high - f.prediction.loss == pytest.approx(
        reference.conformal([*recorded, *[0.0] * 6])
    )
    # A reference whose gap to the others widens (by 0.14 from 30% on) widens the interval past the recorded.
    widening = Curve("w", refs[0].steps, refs[0].losses + 0.2 * refs[0].fractions, 1000, refs[0].key)
    g = forecast([*refs, widening], run.steps[:6], run.losses[:6], 1000)
    half = g.prediction.high - g.prediction.loss
    assert half == pytest.approx(0.14, abs=1e-9) and half > max(recorded)


def test_the_interval_is_the_split_conformal_rank():
    """The ceil((n + 1) x 0.9)-th smallest of n errors: the 18th of 19, the largest of 9 or fewer."""
    errors = [0.01 * i for i in range(1, 20)]
    assert reference.conformal(errors) == pytest.approx(0.18)
    assert (
        reference.conformal(errors[:9]) == pytest.approx(0.09) and reference.conformal([]) == reference.NOISE
    )
    assert reference.recorded_errors(0.45) == reference.RECORDED_ERRORS[0.3]  # the earlier fraction's
    assert (
        reference.recorded_errors(0.05) == reference.RECORDED_ERRORS[0.1]
        and reference.recorded_errors(1.0) == ()
    )


def test_curves_compare_at_the_same_fraction_when_their_lengths_differ():
    short = synthetic("short", 2.0, total=500, every=25)
    long = Curve("long", short.steps * 2, short.losses - 0.1, 1000, short.key)
    f = forecast([short], long.steps[:4], long.losses[:4], 1000)
    assert f.prediction.loss == pytest.approx(short.final - 0.1, abs=1e-12)


def test_a_reference_that_differs_in_schedule_batch_or_data_order_is_refused_naming_the_key():
    optim, data = OptimConfig(schedule="wsd", warmup_steps=50), DataConfig(seq_len=64, batch_size=8)
    key = curve_key(optim, 1000, 512, data)
    for field, value in [
        ("optim.schedule", "cosine"),
        ("optim.warmup_fraction", 0.1),
        ("tokens_per_step", 1024),
        ("data.seed", 1),
    ]:
        other = Curve("ref", np.array([500.0, 1000.0]), np.array([3.0, 2.5]), 1000, key | {field: value})
        said = mismatch(other, key)
        assert said and field in said and repr(value) in said
    assert mismatch(Curve("ref", np.array([500.0, 1000.0]), np.array([3.0, 2.5]), 1000, key), key) is None
    # Twice the steps with twice the warm-up: the same schedule shape (the collapse form).
    assert curve_key(OptimConfig(schedule="wsd", warmup_steps=100), 2000, 512, data) == key


def test_bad_reference_files_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(Refused, match="no such run directory or curve file"):
        read_reference(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(Refused, match="not a JSON curve"):
        read_reference(tmp_path / "bad.json")
    unfinished = {"name": "u", "steps": [100, 200], "losses": [4.0, 3.5], "total_steps": 1000}
    (tmp_path / "u.json").write_text(json.dumps(unfinished))
    with pytest.raises(Refused, match="must have finished its schedule"):
        read_reference(tmp_path / "u.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Refused, match="no config.yaml"):
        read_reference(tmp_path / "empty")


def test_recorded_curves_load_with_their_key_and_refuse_another_schedule():
    curves = ROOT / "tests" / "fixtures" / "curves"
    wsd = read_reference(curves / "small_wsd_1000.json")
    assert wsd.total_steps == 1000 and wsd.steps[-1] == 1000 and len(wsd.steps) == 10
    assert wsd.key["optim.schedule"] == "wsd" and wsd.key["tokens_per_step"] == 512
    assert "data.seed" in reference.unchecked([wsd])
    cosine = read_reference(curves / "small_cosine_1000.json")
    with pytest.raises(Refused, match="optim.schedule: 'wsd' there, 'cosine' here"):
        load_references([str(curves / "small_wsd_1000.json")], cosine.key)


def bench():
    return load_script(BENCH / "bench.py", "reference_bench")


def test_the_recorded_calibration_errors_are_what_the_benchmark_measures():
    rows = bench().run(laws=False)["rows"]
    assert bench().recorded_errors(rows) == reference.RECORDED_ERRORS
    assert bench().recorded_errors(rows, "pair_ratio") == reference.RECORDED_RATIO_ERRORS


def test_the_benchmark_error_from_30_percent_does_not_grow():
    """Fails when a change makes the committed benchmark's worst error from 30% of the run on larger."""
    committed = json.loads((BENCH / "results.json").read_text())["summary"]
    now = bench().summary(bench().run(laws=False)["rows"])
    for key in ("set|30%", "set|50%", "set|80%", "pair|30%", "pair|50%", "pair|80%"):
        assert now[key]["worst"] <= committed[key]["worst"] + 0.002, key
        assert math.isfinite(now[key]["rms"])


def test_the_held_out_ladder_error_from_30_percent_does_not_grow():
    """The ladder of record_ladder.sh (4 shapes <= 3x apart at ~4 tokens per parameter, 3 seeds of the largest),
    replayed from its recorded curves: each run forecast only from runs that are not itself."""
    committed = json.loads((BENCH / "ladder.json").read_text())["summary"]
    result = bench().run_ladder(ROOT / "tests" / "fixtures" / "ladder37", laws=False)
    assert result["seed_spread"] == pytest.approx(0.0131, abs=1e-3)  # the largest shape's 3 init seeds
    for key in ("smaller|30%", "smaller|50%", "smaller|80%", "others|30%", "others|50%", "others|80%"):
        assert result["summary"][key]["worst"] <= committed[key]["worst"] + 0.002, key


def test_the_20_tokens_per_parameter_ladder_error_from_30_percent_does_not_grow():
    """`record_ladder.sh DIR 20`'s ladder (4 shapes <= 2.5x apart at ~20 tokens per parameter, 3 seeds of the
    largest), both maps."""
    committed = json.loads((BENCH / "ladder20.json").read_text())["summary"]
    result = bench().run_ladder(ROOT / "tests" / "fixtures" / "ladder20", laws=False)
    assert result["seed_spread"] == pytest.approx(0.0162, abs=1e-3)
    for method in ("smaller", "smaller_ratio", "others", "others_ratio"):
        for f in ("30%", "50%", "80%"):
            key = f"{method}|{f}"
            assert result["summary"][key]["worst"] <= committed[key]["worst"] + 0.002, key


def test_the_default_map_is_the_one_the_selection_benchmark_chose():
    """The map is chosen on the recorded curves (lower RMS from 30% of the run) and only reported on the two
    ladders, which chose nothing: there the ratio map does better (experiments/2026-11-26-forecast-reference)."""
    from lm.config import EarlyStoppingConfig

    summary = bench().summary(bench().run(laws=False)["rows"])
    chosen = min(
        ("offset", "ratio"),
        key=lambda m: summary["set" + ("" if m == "offset" else "_ratio") + "|30%"]["rms"],
    )
    assert EarlyStoppingConfig().forecast_reference_map == chosen


COVERAGE_FLOOR = {
    "recorded": {"set": (26, 30), "set_ratio": (28, 30)},
    "ladder37": {
        "smaller": (13, 15),
        "others": (17, 18),
        "smaller_ratio": (13, 15),
        "others_ratio": (17, 18),
    },
    "ladder20": {
        "smaller": (14, 15),
        "others": (17, 18),
        "smaller_ratio": (15, 15),
        "others_ratio": (18, 18),
    },
}
"""Out-of-sample coverage of the 90% interval from 30% of the run (30, 50 and 80%), as committed: on the
recorded curves each target's calibration leaves out every pair that involves it; the ladders calibrate on the
recorded curves alone."""


@pytest.mark.parametrize("benchmark", COVERAGE_FLOOR)
def test_the_90_percent_interval_covers_out_of_sample_what_it_did(benchmark):
    """Guards coverage as the tests above guard error: a narrower interval (the 70th percentile, or the errors'
    median) covers fewer targets and fails here. Each benchmark's goal (>= 85%) is met at the committed
    numbers: 87% and 93% on the recorded curves, 87-100% on the ladders."""
    if benchmark == "recorded":
        goals = bench().run(laws=False)["goals"]
    else:
        goals = bench().run_ladder(ROOT / "tests" / "fixtures" / benchmark, laws=False)["goals"]
    got = {g["method"]: (g["covered"], g["n"]) for g in goals}
    for method, (covered, n) in COVERAGE_FLOOR[benchmark].items():
        assert got[method][1] == n and got[method][0] >= covered, (method, got[method])
        assert covered / n >= 0.85


def test_the_ladders_report_each_forecaster_beside_the_same_shape_other_seed_floor():
    """The floor: each of the largest shape's seeds forecast from another seed alone (the best reference there
    is). From 30% of the run its RMS is 0.043 (~4 tokens per parameter) and 0.067 (~20): a forecaster's error
    is read against it (goal: within 1.25x), and a change that makes the user's case (strictly smaller
    references) worse against it fails here."""
    for ladder, floor, ratios in (
        ("ladder37", 0.043, {"smaller": 1.69, "smaller_ratio": 1.14}),
        ("ladder20", 0.067, {"smaller": 2.43, "smaller_ratio": 0.80}),
    ):
        result = bench().run_ladder(ROOT / "tests" / "fixtures" / ladder, laws=False)
        goals = {g["method"]: g for g in result["goals"]}
        assert result["largest"]["seed_pairs|30%"]["rms"] == pytest.approx(floor, abs=1e-3)
        for method, ratio in ratios.items():
            assert goals[method]["rms_over_floor"] <= ratio + 0.01, (ladder, method)


def test_the_cadence_line_appears_only_where_a_forecast_decides():
    from lm.config import EarlyStoppingConfig

    ref = EarlyStoppingConfig(forecast_model="reference", forecast_reference=["runs/small"])
    (f,) = reference.cadence_findings(ref, plan_steps=1000, val_every_steps=100)
    assert (
        f.level == "warn" and f.fix == "trainer.val_every_steps=50" and "10.0% of the plan's 1,000" in f.what
    )
    assert reference.cadence_findings(ref, 1000, 50)[0].level == "ok"
    assert reference.cadence_findings(EarlyStoppingConfig(), 1000, 100) == []
