"""The levers' CPU step times at one rung, measured again with the sequence-length warm-up timed as it trains
(issue 48 item 9): each stage's window as its own row, weighted by the steps the stage runs. The study's
original ratios timed every arm at the full 64-token window.

    python experiments/2026-11-27-levers/step_times.py [SHAPE] [STEPS]    # default s128, 20 steps a row

Prints each row (arm, window length, steps it runs, median seconds) and each arm's weighted step time as a
ratio to the baseline's, and writes them to step_times-<SHAPE>.json here.
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import date
from pathlib import Path

import torch

from lm.tools.ablate.runner import row_times
from lm.tools.ablate.spec import ladder_overrides, load_spec

HERE = Path(__file__).resolve().parent


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "s128"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    torch.set_num_threads(1)  # as the study's runs (--threads 1)
    spec = load_spec(HERE / "levers.yaml")
    ladder = ladder_overrides(spec, shape)
    arms = {arm: [*spec.base, *ladder, *spec.arm_overrides(arm, shape)] for arm in spec.arms}
    rows = row_times(arms, steps=steps)
    weighted = {}
    for arm in arms:
        own = [(s, n) for (name, _), (s, n) in rows.items() if name == arm]
        weighted[arm] = sum(s * n for s, n in own) / sum(n for _, n in own)
    for (arm, length), (seconds, n) in rows.items():
        print(f"{arm:12s} window {length:3d}  {n:5d} steps  {seconds * 1e3:7.2f} ms")
    ratios = {arm: t / weighted["baseline"] for arm, t in weighted.items()}
    for arm, r in ratios.items():
        print(f"{arm:12s} {weighted[arm] * 1e3:7.2f} ms a step, {r:.3f}x the baseline")
    record = {
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
        "command": f"python experiments/2026-11-27-levers/step_times.py {shape} {steps}",
        "rows": [{"arm": a, "window": w, "steps": n, "seconds": s} for (a, w), (s, n) in rows.items()],
        "seconds": weighted,
        "ratio_to_baseline": ratios,
    }
    (HERE / f"step_times-{shape}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
