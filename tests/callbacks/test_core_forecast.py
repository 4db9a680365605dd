"""The run's CORE forecast: forecast.json's `core`, its TensorBoard scalars and the report's table, from the
loss forecast and the loss-to-CORE map (lm.numbers.core_map)."""

import json
from pathlib import Path

import pytest

from lm.numbers import core_map
from lm.numbers.core_map import CoreMap, Point
from lm.run.train import main
from lm.store import rundir

CORE_DIR = Path(__file__).resolve().parents[3] / "shared" / "evals" / "core"
RUN = (
    "trainer.max_steps=24",
    "trainer.val_every_steps=4",
    "optim.warmup_steps=2",
    "optim.total_steps=40",
    "phases.phases=[]",
    "sampling=off",
    "evals.tasks=[core:copa,core:piqa]",
    f"evals.data_dir={CORE_DIR}",
    "evals.limit=8",
    "evals.steps=[8,16,24]",
)
"""A tiny run with three CORE milestones and a validation every 4 steps (the forecast's points)."""


def test_a_run_whose_milestones_reach_the_signal_recalibrates_the_shift():
    base = CoreMap(6.0, 1.2, 0.02, 0.0, 0.8, 0.012, "v1", False, "prior")
    truth = CoreMap(6.0, 1.2, 0.02, 0.4, 0.0, 0.012, "v1", True, "truth")
    points = [Point(x, float(truth.mean(x)), 0.008) for x in (3.4, 3.2, 3.1)]
    out = core_map.run_forecast(base, points, "CORE v1 nanochat", {"plan_end": (2.9, 2.85, 2.95)})
    assert out["map"]["calibrated"] and out["why"] is None and out["milestones"] == 3
    end = out["plan_end"]
    assert end["low"] < float(truth.mean(2.9)) < end["high"] and end["loss"] == 2.9
    assert end["high"] - end["low"] < 0.1  # the prior's would span most of CORE's range
    uncalibrated = core_map.run_forecast(base, points[:0], None, {"plan_end": (2.9, 2.85, 2.95)})
    assert not uncalibrated["map"]["calibrated"] and "reached 0.1 clear of chance" in uncalibrated["why"]


def test_milestones_pair_with_the_validation_at_their_step_and_never_mix_coverage():
    core = {"label": "CORE", "version": "v1", "convention": "nanochat", "value": 0.2, "stderr": 0.01}
    core |= {"versions": {"v2": {"value": 0.15, "stderr": 0.01}}}
    evals = [{"step": 100, "core": core}, {"step": 200, "core": core | {"value": 0.25}}, {"step": 300}]
    validations = [(100, 3.1), (199, 2.9), (300, 2.8)]
    points, name = core_map.run_points(evals, validations, "v1")
    assert [(p.loss, p.core) for p in points] == [(3.1, 0.2), (2.9, 0.25)] and name == "CORE v1 nanochat"
    v2, _ = core_map.run_points(evals, validations, "v2")
    assert [p.core for p in v2] == [0.15, 0.15]
    far, _ = core_map.run_points(evals, [(150, 3.0)], "v1")
    assert far == []  # no validation within 2% of the milestone's step: no point
    mixed = [*evals, {"step": 400, "core": core | {"label": "CORE-18"}}]
    with pytest.raises(core_map.Refused, match="differ in coverage"):
        core_map.run_points(mixed, [*validations, (400, 2.7)], "v1")


@pytest.mark.skipif(not CORE_DIR.is_dir(), reason=f"no CORE task files at {CORE_DIR}")
def test_a_run_with_core_milestones_forecasts_its_final_core(tiny_cfg, tmp_path):
    main(tiny_cfg(*RUN))
    run = tmp_path / "runs" / "smoke"
    core = json.loads((run / "forecast.json").read_text())["core"]
    assert core["name"] == "CORE-2 v1 nanochat" and core["milestones"] >= 2
    assert not core["map"]["calibrated"] and "UNCALIBRATED" in core["label"]  # a tiny model: near chance
    assert "mlfoundations/scaling" in core["map"]["source"]
    for key in ("plan_end", "cooldown_now"):
        assert core[key]["low"] <= core[key]["core"] <= core[key]["high"] and core[key]["version"] == "v1"
    scalars = rundir.read_scalars(run)
    assert "forecast/core_at_plan_end" in scalars and "forecast/core_at_plan_end_high" in scalars
    report = (run / "report.md").read_text()
    assert "CORE forecast (CORE v1, UNCALIBRATED" in report and "reached 0.1 clear of chance" in report


@pytest.mark.skipif(not CORE_DIR.is_dir(), reason=f"no CORE task files at {CORE_DIR}")
def test_a_core_forecast_that_raises_is_recorded_and_the_run_goes_on(tiny_cfg, tmp_path, monkeypatch):
    """The CORE forecast runs on rank 0 alone: a failure in it (here injected) must not end rank 0's run while
    the others train on; it is optional work, recorded in failures.jsonl."""

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the CORE forecast broke")

    monkeypatch.setattr(core_map, "run_forecast", broken)
    main(tiny_cfg(*RUN))
    run = tmp_path / "runs" / "smoke"
    failures = [json.loads(line) for line in (run / rundir.FAILURES).read_text().splitlines()]
    assert {f["what"] for f in failures} == {"the CORE forecast"} and "injected" in failures[0]["error"]
    assert "core" not in json.loads((run / "forecast.json").read_text())
