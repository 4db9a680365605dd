"""Benchmark of `lm plan --calibrate`: calibrate on small shapes, predict the final validation loss of a larger
one trained with the same recipe, and report the error (issue 16's goal: within 0.05).

Step 1 is the documented command itself (`lm plan --calibrate`, in a subprocess with a timeout); step 2 trains
the larger shape through the same function the calibration uses (lm.tools.calibrate.calibration_run), so the only
difference between the points and the target is N and D.

    OMP_NUM_THREADS=1 nice -n 19 python experiments/2026-11-23-plan/calibration/calibration_bench.py \
        /tmp/calib23 150,450 900       # ROOT, calibration step counts, the 4x192 target's steps
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from lm.tools import calibrate

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/calib23")
SHAPES = "2x64,2x96,3x96,3x128"
STEPS = sys.argv[2] if len(sys.argv) > 2 else "150,450"
TARGET = (4, 192, int(sys.argv[3]) if len(sys.argv) > 3 else 900)  # n_layer, d_model, steps: 2x the largest
# calibration size (1.97 M vs 0.92 M parameters), 2x the longest calibration run
DATA = [
    "trainer=cpu",
    "trainer.enable_progress_bar=false",
    "data.max_bytes=6000000",
    "data.val_fraction=0.1",
    "data.tokenizer_sample_bytes=500000",
    "data.vocab_size=512",
    "data.seq_len=64",
    "data.batch_size=8",
    "data.num_workers=0",
    "data.persistent_workers=false",
    "trainer.limit_val_batches=128",  # 1,024 windows: one evaluation's noise well below 0.01
    "cost.price_per_hour=1.0",
    "callbacks={}",
    f"run.root={ROOT / 'runs'}",
]


def main() -> None:
    law_file = ROOT / "calibration.json"
    plan = ["plan", "--hours", "0.01", "--gpu", "cpu", "--tokens-per-sec", "3000", "--price-per-hour", "1.0"]
    plan += ["--corpus-tokens", "5000000", "--tokens-per-step", "512", "--out-dir", str(ROOT), "--top", "3"]
    command = [sys.executable, "-m", "lm.cli", *plan, "--calibrate", "--calibrate-shapes", SHAPES]
    command += ["--calibrate-steps", STEPS, "--law", str(law_file), *DATA]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, timeout=1800)
    law, rmse = calibrate.load_law(law_file)
    started = time.monotonic()
    point, _ = calibrate.calibration_run(DATA, ROOT / "runs", *TARGET)
    seconds = time.monotonic() - started
    predicted = law.loss(point.n, point.d)
    record = json.loads(law_file.read_text())
    print(f"target {point.shape}: N={point.n:,} D={point.d:,} ({seconds:.0f} s)")
    print(f"  measured val loss  {point.loss:.4f}")
    print(f"  predicted          {predicted:.4f} (calibrated law, fit RMSE {rmse:.4f})")
    print(f"  error              {predicted - point.loss:+.4f} (goal: within 0.05)")
    print(
        f"  calibration cost   {record['cost']['seconds']:.0f} s wall, ${record['cost']['usd']:.4f} at $1/h"
    )
    largest = max(record["points"], key=lambda p: (p["n"], p["d"]))
    print(f"  naive (largest calibration run's loss) error {largest['loss'] - point.loss:+.4f}")
    for name, fallback in (("Besiroglu", calibrate.BESIROGLU),):
        print(f"  uncalibrated ({name}) error {fallback.loss(point.n, point.d) - point.loss:+.4f}")


if __name__ == "__main__":
    main()
