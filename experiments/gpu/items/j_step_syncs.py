"""Ledger item j (issue 54 item 5): a training step the GPU never waits for.

Counts the host-device synchronisations of every training step (`torch.cuda.set_sync_debug_mode("warn")`,
through `sync_probe.SyncProbe`) over STEPS steps of `134m` and `1b` (bf16, fused AdamW, eager kernels, one
GPU: no collective), logging every 10 steps; goal: 0 outside the logging steps (the logger reads each metric
there, and the first step and the final save are set-up). In the same call, tokens/s with the pre-issue-54
per-step logging put back (`before=true`: three `self.log(<python float>)` a step, each a blocking
host-to-device copy) and without it, at `1b` and at a small shape where the host's waits dominate the step.
Lightning's per-micro-batch SIGTERM broadcast exists only under torch.distributed (lm turns it off there), so
one GPU has none to measure.

    python3 experiments/gpu/items/j_step_syncs.py [STEPS]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import common

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
EVERY = 10
SHAPES = {
    "small": ["model=tiny", "model.d_model=256", "model.n_layer=4", "model.n_head=4", "data.batch_size=8"],
    "1b": ["model=1b", "data.batch_size=4"],
    "134m": ["model=134m", "data.batch_size=8"],
}
# (shape, arm): the small shape and 1b with and without the old logging, then 134m's count
ARMS = [("small", "after"), ("small", "before"), ("1b", "after"), ("1b", "before"), ("134m", "after")]
BASE = [
    *common.QUIET,
    "precision=bf16",
    "kernels=eager",
    "optim.fused=true",
    f"trainer.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",
    "optim.warmup_steps=5",
    "trainer.val_every_steps=100000",
    "trainer.limit_val_batches=1",
    f"trainer.log_every_n_steps={EVERY}",
    "checkpoint.every_n_steps=100000",
]
if common.STANDIN:
    SHAPES = {k: [] for k in SHAPES}
    BASE = [o for o in BASE if not o.startswith(("precision=", "optim.fused"))] + common.TINY
else:
    BASE = [*common.DATA, *BASE]


def hot(counts: dict[str, int]) -> dict[int, int]:
    """Syncs at steps other than the first two, the last and the logging steps."""
    allowed = {0, 1, STEPS - 1} | {s for s in range(STEPS) if (s + 1) % EVERY == 0 or s % EVERY == 0}
    return {int(s): n for s, n in counts.items() if int(s) not in allowed and n}


def main() -> None:
    items = str(Path(__file__).resolve().parent)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [items, os.environ.get("PYTHONPATH")]))}
    arms: dict[str, dict] = {}
    for shape, arm in ARMS:
        key = f"{shape}_{arm}"
        if common.left() < 90:
            common.say(f"{key}: not started ({common.left():.0f} s left)")
            continue
        out = common.WORK / f"j_{key}"
        out.mkdir(parents=True, exist_ok=True)
        probe = ["+callbacks.sync._target_=sync_probe.SyncProbe", f"+callbacks.sync.out={out}"]
        probe += [f"+callbacks.sync.before={'true' if arm == 'before' else 'false'}"]
        code, seconds = common.train(
            common.WORK, f"j_{key}", [*BASE, *SHAPES[shape], *probe], common.left(), env
        )
        record = json.loads((out / "syncs-0.json").read_text()) if (out / "syncs-0.json").is_file() else {}
        counts = record.get("counts", {})
        rate = (
            common.steady(common.WORK / f"j_{key}", "perf/tokens_per_sec", skip=EVERY) if code == 0 else None
        )
        arms[key] = {
            "exit": code,
            "s": round(seconds, 1),
            "tokens_per_sec": rate,
            "syncs_per_step": statistics.median(counts.values()) if counts else None,
            "syncs_outside_logging": hot(counts),
            "sites": record.get("sites"),
        }
    parts = []
    for key, a in arms.items():
        parts.append(f"{key}: {len(a['syncs_outside_logging'])} non-logging steps with syncs")
    for shape in ("small", "1b"):
        a, b = arms.get(f"{shape}_after", {}), arms.get(f"{shape}_before", {})
        if a.get("tokens_per_sec") and b.get("tokens_per_sec"):
            parts.append(
                f"{shape} tokens/s {a['tokens_per_sec'] / b['tokens_per_sec']:.3f}x the old per-step logging's"
            )
    ok = arms and all(
        a["exit"] == 0 and not a["syncs_outside_logging"] for a in arms.values() if a["exit"] is not None
    )
    common.result(
        "; ".join(parts) or "no arm ran", status="done" if ok else "failed", **common.gpu(), arms=arms
    )


if __name__ == "__main__":
    common.main(main)
