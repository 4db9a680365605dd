"""Summarise the GPU session's training runs from their TensorBoard events: steady tokens/s (median of the
logged windows after `--skip` steps, so compile and the first steps stay out), MFU, peak memory, the validation
losses and the mean of the last train losses. Usage: python summarize.py RUNS_ROOT OUT.json [--skip 20]"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def summary(run: Path, skip: int) -> dict:
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    rate = [v for s, v in scalars(acc, "perf/tokens_per_sec") if s >= skip]
    mfu = [v for s, v in scalars(acc, "perf/mfu") if s >= skip]
    train = scalars(acc, "train/loss")
    return {
        "run": run.name,
        "tokens_per_sec": statistics.median(rate) if rate else None,
        "tokens_per_sec_windows": len(rate),
        "tokens_per_sec_spread": [min(rate), max(rate)] if rate else None,
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_mem_gb": max((v for _, v in scalars(acc, "perf/peak_mem_gb")), default=None),
        "val_loss": scalars(acc, "val/loss"),
        "last_train_loss_mean10": statistics.fmean(v for _, v in train[-10:]) if train else None,
        "steps_logged": train[-1][0] if train else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--skip", type=int, default=20)
    a = ap.parse_args()
    rows = [summary(r, a.skip) for r in sorted(a.root.iterdir()) if (r / "tb").is_dir()]
    a.out.write_text(json.dumps(rows, indent=1))
    for r in rows:
        val = " ".join(f"{s}:{v:.4f}" for s, v in r["val_loss"])
        tps = r["tokens_per_sec"]
        print(
            f"{r['run']:>10}  tok/s {tps or 0:>9,.0f}  mfu {r['mfu'] or 0:.3f}  peak {r['peak_mem_gb'] or 0:.1f} GB"
            f"  last10 {r['last_train_loss_mean10'] or float('nan'):.4f}  val {val}",
            file=sys.stdout,
        )


if __name__ == "__main__":
    main()
