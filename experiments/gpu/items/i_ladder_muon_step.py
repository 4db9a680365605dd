"""Ledger item i: QK-norm + Muon's step time against the baseline's at the GPU ladder's shapes (issue 55).

The CPU ladder (experiments/2026-11-25-ladder) measured that QK-norm + Muon needs 0.61x the baseline's tokens at
1.1M parameters; its measured dollars are 1.007x on the Intel Xeon that timed the steps interleaved (Muon's step
1.65x there; that Xeon has native bf16, so emulation does not explain it) and 0.72x on the AMD EPYC that ran the
shorter runs (1.19x; issue 63). Two CPUs disagree; whether the saving appears on a GPU depends on this ratio at the sizes the GPU ladder
(experiments/2026-11-25-ladder/ladder_gpu.yaml) trains: its base (32K vocabulary, 2,048-token windows, 16 x 4
micro-batches a step, bf16, compile) at n23m, n50m, n110m, n340m, smallest first while the box has room; per
shape one `lm bench` row for the baseline and one for QK-norm + Muon, in the same call of the item. Result: each
shape's tokens/s and the step-time ratio (baseline tokens/s over the arm's), the number that turns a GPU
tokens ratio into measured dollars.

    python3 experiments/gpu/items/i_ladder_muon_step.py [n23m n50m ...]
"""

from __future__ import annotations

import json
import sys
import time

import common

BASE = [
    *common.DATA,
    "data.batch_size=16",
    "trainer.accumulate_grad_batches=4",
    "precision=bf16",
    "kernels=compile",
]
SHAPES = {
    "n23m": ["model.n_layer=6", "model.d_model=384", "model.n_head=6"],
    "n50m": ["model.n_layer=8", "model.d_model=576", "model.n_head=9"],
    "n110m": ["model.n_layer=12", "model.d_model=768", "model.n_head=12"],
    "n340m": ["model.n_layer=24", "model.d_model=1024", "model.n_head=16"],
}
"""ladder_gpu.yaml's shapes."""
ARMS = {"baseline": [], "qk_norm_muon": ["model.qk_norm=true", "optim=muon"]}
BENCH = ["bench.warmup_steps=3", "bench.steps=8", "evals=off", "sampling=off"]
FIRST_ROW_S = 120.0
"""What a row is assumed to take before one has been timed (compile included)."""


def row(shape: str, arm: str, timeout: float) -> dict:
    out_dir = common.WORK / "ladder_muon" / shape / arm
    base = common.TINY if common.STANDIN else [*BASE, *SHAPES[shape]]
    args = [*base, *BENCH, *ARMS[arm], f"bench.out_dir={out_dir}", f"bench.timeout_s={timeout:.0f}"]
    code, seconds = common.lm("bench", args, timeout + 15)
    out = {"shape": shape, "arm": arm, "exit": code, "s": round(seconds, 1)}
    try:
        bench = json.loads((out_dir / "bench.json").read_text())["results"][0]
    except (OSError, ValueError, LookupError) as e:
        return {**out, "status": "error", "error": f"no bench.json: {e}"}
    return {**out, **{k: bench.get(k) for k in ("status", "error", "tokens_per_sec", "mfu", "peak_mem_gb")}}


def main() -> None:
    shapes = sys.argv[1:] or list(SHAPES)
    fields: dict = {**common.gpu(), "rows": []}
    timed, summaries = [], []
    for shape in shapes:
        rows = {}
        for arm in ARMS:
            slowest = max(timed) if timed else FIRST_ROW_S
            if common.left() < 1.2 * slowest:
                common.say(
                    f"{shape} {arm}: not started ({common.left():.0f} s left, a row takes ~{slowest:.0f})"
                )
                break
            started = time.monotonic()
            rows[arm] = row(shape, arm, min(common.left() - 15, 3 * slowest))
            timed.append(time.monotonic() - started)
            fields["rows"].append(rows[arm])
            common.say(f"{shape} {arm}: {rows[arm]}")
        ok = [rows.get(a) for a in ARMS if rows.get(a) and rows[a].get("status") == "ok"]
        if len(ok) == 2:
            ratio = ok[0]["tokens_per_sec"] / ok[1]["tokens_per_sec"]
            summaries.append(
                f"{shape} s/step x {ratio:.3f} ({ok[0]['tokens_per_sec']:,.0f} vs {ok[1]['tokens_per_sec']:,.0f} tok/s)"
            )
        elif rows:
            summaries.append(f"{shape}: " + ", ".join(f"{a} {r.get('status')}" for a, r in rows.items()))
        if len(rows) < len(ARMS):
            break
    common.result("QK-norm + Muon vs baseline: " + ("; ".join(summaries) or "no row ran"), **fields)


if __name__ == "__main__":
    common.main(main)
