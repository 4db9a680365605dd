"""`lm plan --calibrate`: the fit recovers the law that made its points, a real calibration on the tiny corpus
writes a law file that `lm plan --law` predicts with, and too few runs get a clear error before any training."""

import json

import pytest

from lm.cli import main as lm
from lm.config import compose, to_objects
from lm.numbers import loss_law
from lm.tools import calibrate

from ..conftest import TINY

TRUE = loss_law.ChinchillaLaw(2.1, 60.0, 900.0, 0.42, 0.31, "synthetic")


def points_of(law: loss_law.ChinchillaLaw, sizes, tokens) -> list[calibrate.CalibrationPoint]:
    return [calibrate.CalibrationPoint(f"{n}-{d}", n, d, law.loss(n, d)) for n in sizes for d in tokens]


def test_the_fit_recovers_its_parameters_from_synthetic_points():
    points = points_of(TRUE, [1e5, 3e5, 1e6, 3e6], [1e6, 4e6, 1.6e7])
    fit = calibrate.fit_law(points, "synthetic")
    assert fit.fixed is None and fit.rmse < 1e-6
    assert (fit.law.alpha, fit.law.beta) == pytest.approx((TRUE.alpha, TRUE.beta), abs=1e-9)
    assert pytest.approx((TRUE.E, TRUE.A, TRUE.B), rel=1e-6) == (fit.law.E, fit.law.A, fit.law.B)


@pytest.mark.parametrize("diverged", [0, 5, 11])
def test_one_diverged_run_does_not_bend_the_prediction(diverged):
    points = points_of(TRUE, [1e5, 3e5, 1e6, 3e6], [1e6, 4e6, 1.6e7])
    bad = points[diverged]
    points[diverged] = calibrate.CalibrationPoint("diverged", bad.n, bad.d, bad.loss + 1.0)
    law = calibrate.fit_law(points, "synthetic").law
    # A model 10x larger than any it saw, trained on 4x the tokens: within 0.02 despite the 1.0 outlier.
    assert abs(law.loss(3e7, 6.4e7) - TRUE.loss(3e7, 6.4e7)) < 0.02


def test_few_points_fix_the_exponents_and_say_so():
    law = loss_law.ChinchillaLaw(
        2.5, 30.0, 400.0, loss_law.BESIROGLU.alpha, loss_law.BESIROGLU.beta, "synthetic"
    )
    fit = calibrate.fit_law(points_of(law, [1e5, 1e6], [1e6, 1e7]), "synthetic")
    assert "alpha and beta fixed at Besiroglu" in fit.fixed and "4 runs are too few" in fit.fixed
    assert pytest.approx((law.E, law.A, law.B), rel=1e-3) == (fit.law.E, fit.law.A, fit.law.B)
    assert fit.rmse < 1e-6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--calibrate-shapes", "2x64", "--calibrate-steps", "5,10"], "got 2 run(s), 1 size(s), 2 token"),
        (["--calibrate-shapes", "2x64,4x64", "--calibrate-steps", "5"], "got 2 run(s), 2 size(s), 1 token"),
        (["--calibrate-shapes", "2x60,2x64"], "d_model a multiple of 32"),
    ],
    ids=["one size", "one token count", "bad shape"],
)
def test_too_few_runs_get_a_clear_error_before_training(args, message, tmp_path):
    with pytest.raises(SystemExit) as e:
        lm(
            [
                "plan",
                "--hours",
                "1",
                "--corpus-tokens",
                "1000000",
                "--calibrate",
                *args,
                f"run.root={tmp_path}",
            ]
        )
    assert message in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


def test_a_law_file_that_is_not_one_gets_a_clear_error(tmp_path):
    bad = tmp_path / "calibration.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:
        lm(["plan", "--hours", "1", "--corpus-tokens", "1000000", "--law", str(bad)])
    assert "not a calibration file" in str(e.value)


@pytest.mark.slow
def test_a_tiny_calibration_runs_and_its_law_is_what_lm_plan_predicts_with(tmp_path, data_cache, capsys):
    data = [
        *TINY,
        f"data.cache_dir={data_cache}",
        f"run.root={tmp_path / 'runs'}",
        "trainer.limit_val_batches=4",
    ]
    law_file = tmp_path / "calibration.json"
    plan = ["plan", "--hours", "0.01", "--gpu", "cpu", "--tokens-per-sec", "20000", "--price-per-hour", "1"]
    plan += ["--corpus-tokens", "1000000", "--tokens-per-step", "512", "--out-dir", str(tmp_path), *data]
    calibration = ["--calibrate", "--calibrate-shapes", "1x32,2x64", "--calibrate-steps", "4,12"]
    lm([*plan, *calibration, "--law", str(law_file), "--name", "calibrated"])
    record = json.loads(law_file.read_text())
    assert [p["shape"] for p in record["points"]] == [
        "cal_1x32_s4",
        "cal_1x32_s12",
        "cal_2x64_s4",
        "cal_2x64_s12",
    ]
    assert record["cost"]["seconds"] > 0 and "4 runs are too few" in record["fixed"]
    # Runs of 4 and 12 steps log too few training losses for a loss-curve shape: no forecast prior.
    assert record["forecast_prior"] == {}
    assert (
        record["law"]["source"] == f"calibrated on {calibrate.corpus_label(to_objects(compose(data)).data)}"
    )
    out = capsys.readouterr().out
    assert "calibration cost:" in out and f"wrote {law_file}" in out
    lm([*plan, "--law", str(law_file), "--name", "later"])  # a later plan reads the law file
    lm([*plan, "--name", "uncalibrated"])
    law, _ = calibrate.load_law(law_file)
    out = capsys.readouterr().out
    assert f"loss: {law.source}; interval: the calibration fit's RMSE" in out
    later, calibrated = ((tmp_path / f"{n}.yaml").read_text() for n in ("later", "calibrated"))
    expected = later.split("expected final loss ")[1].split(")")[0]
    assert expected == calibrated.split("expected final loss ")[1].split(")")[0]  # the same law, read back
    assert expected.endswith(law.source) and "uncalibrated" in (tmp_path / "uncalibrated.yaml").read_text()
    assert 3.0 < float(expected.split(" ")[0]) < 7.0  # in this corpus's units: the tiny model's loss range
