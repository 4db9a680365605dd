"""The forecast benchmark keeps score: replaying the recorded curves (no training), no forecast of the final
loss from 30% of the run may get worse than experiments/2026-11-24-forecast-priors/results.json records."""

import json
from pathlib import Path

from ..helpers import load_script

FOLDER = Path(__file__).resolve().parents[2] / "experiments" / "2026-11-24-forecast-priors"
SLACK = 0.002
"""Floating-point and platform drift allowed on a recorded error (loss units)."""


def bench():
    return load_script(FOLDER / "forecast_bench.py", "forecast_bench")


def test_no_forecast_at_30_percent_is_worse_than_recorded():
    recorded = json.loads((FOLDER / "results.json").read_text())
    module = bench()
    module.PRIOR_FROM = recorded["prior_from"]
    assert set(module.CURVE_SET) >= {key.split("|")[0] for key in recorded["rows"]}, (
        "a recorded curve is gone"
    )
    rows = module.run(fractions=(0.3,))
    worse = []
    for key, cells in recorded["rows"].items():
        was, now = cells["30%"], rows[key]["30%"]
        if was is None:
            continue
        assert now is not None, f"{key}: no forecast at 30% any more"
        if abs(now["error"]) > abs(was["error"]) + SLACK:
            worse.append(f"{key}: {now['error']:+.4f} (recorded {was['error']:+.4f})")
    assert not worse, "forecast error at 30% of the run got worse:\n" + "\n".join(worse)
