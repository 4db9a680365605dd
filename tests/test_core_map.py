"""The loss-to-CORE map (lm.numbers.core_map): the public testbed's figures, the prior, calibration, and the
out-of-sample evidence in experiments/2026-11-29-core-map rerun."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm.base.exits import Refused
from lm.evals.core import BASELINES, CORE_TASKS, centred
from lm.numbers import core_map
from lm.numbers.core_map import SIGNAL, CoreMap, Point, calibrate, public_prior

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "experiments" / "2026-11-29-core-map"


def rows() -> list[dict]:
    lines = [x for x in core_map.TESTBED.read_text().splitlines() if not x.startswith("#")]
    return list(csv.DictReader(lines))


def test_the_testbed_names_its_repository_and_commit():
    assert core_map.public_source() == "github.com/mlfoundations/scaling @ a003c4913793"
    assert "MIT licence" in core_map.TESTBED.read_text().split("\n", 3)[1]


def test_every_core_figure_is_lm_s_own_computation_from_the_stored_accuracies():
    table = rows()
    assert len(table) == 104 and {r["dataset"] for r in table} == {"c4_original", "rpj", "rw_original"}
    for r in table:
        for version, baselines in BASELINES.items():
            mine = sum(centred(float(r[t.label]), baselines[t.label]) for t in CORE_TASKS) / len(CORE_TASKS)
            assert float(r[f"core_{version}"]) == pytest.approx(mine, abs=2e-6), (r["name"], version)


def test_the_prior_reproduces_the_testbed_s_shape_and_says_it_is_uncalibrated():
    prior = public_prior("v1")
    assert not prior.calibrated and prior.version == "v1" and "a003c4913793" in prior.source
    assert 1.0 < prior.gamma < 1.4  # Gadre et al.'s sets: 1.13-1.32 fitted one by one
    assert 0.008 < prior.noise_sd < 0.03
    # three training sets 0.8 nats apart on their own validation losses: the shift is barely known
    assert prior.shift_sd > 0.5
    assert "UNCALIBRATED" in prior.label()


def test_probability_and_quantiles_agree_and_fall_with_the_loss():
    m = CoreMap(6.0, 1.2, 0.02, 0.0, 0.05, 0.012, "v1", True, "test", 3)
    p = [m.probability_at_least(0.2, loss) for loss in (2.4, 2.6, 2.8, 3.0)]
    assert p == sorted(p, reverse=True) and p[0] > 0.99 and p[-1] < 0.01
    f = m.predict(2.7, loss_sd=0.03)
    assert f.low < f.core < f.high
    assert m.probability_at_least(f.low, 2.7, 0.03) == pytest.approx(0.95, abs=2e-3)
    assert m.probability_at_least(f.high, 2.7, 0.03) == pytest.approx(0.05, abs=2e-3)
    wider = m.predict(2.7, loss_sd=0.2)
    assert wider.high - wider.low > f.high - f.low


def test_core_is_capped_at_its_ceiling():
    m = CoreMap(6.0, 1.2, 0.02, 0.1, 0.05, 0.012, "v1", True, "test", 3)
    assert m.probability_at_least(1.01, -5.0) == 0.0  # no loss buys more than every task right
    assert m.predict(-5.0).high <= core_map.CEILING


def test_calibration_recovers_a_known_shift_from_points_above_the_signal():
    truth = CoreMap(6.0, 1.2, 0.02, 0.3, 0.0, 0.01, "v1", True, "truth")
    prior = CoreMap(6.0, 1.2, 0.02, 0.0, 0.8, 0.01, "v1", False, "prior")
    noise = [0.004, -0.006, 0.002, -0.001, 0.005]
    losses = [3.6, 3.4, 3.2, 3.0, 2.9]
    points = [Point(x, float(truth.mean(x)) + e, 0.005) for x, e in zip(losses, noise)]
    fitted = calibrate(prior, points, "five runs")
    used = [p for p in points if p.core >= SIGNAL]
    assert fitted.calibrated and fitted.points == len(used) < len(points)  # the near-chance runs are left out
    assert abs(fitted.shift - 0.3) < 2 * fitted.shift_sd and fitted.shift_sd < 0.05


def test_calibration_below_the_signal_is_a_refusal_that_names_the_fix():
    prior = public_prior("v1")
    with pytest.raises(Refused, match="no run reached CORE 0.1 clear of chance.*larger or longer runs"):
        calibrate(prior, [Point(5.0, 0.01), Point(4.5, 0.04)], "tiny runs")


def test_a_map_record_round_trips_and_a_short_one_is_refused():
    prior = public_prior("v2")
    assert CoreMap.from_record(prior.record()) == prior
    with pytest.raises(Refused, match="lacks shift_sd"):
        CoreMap.from_record({k: v for k, v in prior.record().items() if k != "shift_sd"})


def test_the_committed_coverage_study_reruns_to_the_same_figures():
    out = subprocess.run(
        [sys.executable, str(EXPERIMENT / "coverage.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out == (EXPERIMENT / "coverage.txt").read_text()


def test_a_missing_or_malformed_map_file_is_refused_with_the_fix(tmp_path):
    with pytest.raises(Refused, match="cannot read the CORE map.*lm core-map"):
        core_map.read_map(tmp_path / "absent.json")
    (tmp_path / "plan.json").write_text('{"law": {}}')
    with pytest.raises(Refused, match="is not a CORE map"):
        core_map.read_map(tmp_path / "plan.json")
    (tmp_path / "ok.json").write_text(json.dumps({"map": public_prior("v1").record()}))
    assert core_map.read_map(tmp_path / "ok.json") == public_prior("v1")
