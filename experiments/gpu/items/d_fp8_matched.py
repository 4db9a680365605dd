"""Ledger item d: FP8 against bf16 at matched tokens through a complete short schedule on `134m`, two seeds.

Each run: 134m, compile, 8 x 2048 tokens a step, STEPS steps of the WSD schedule (warm-up, stable, the last 20%
decaying), validation every STEPS/5 steps on 16 batches. Same seed, same data order, same learning rate in both
arms (the FP8 recipe changes numerics, not the optimum LR: the same LR is the claim). Runs go bf16 s0, fp8 s0,
bf16 s1, fp8 s1, so a box cut short still leaves paired seeds. Reported: final validation loss per run, the
paired FP8 - bf16 difference per seed against the bf16 seed-to-seed spread, and steady tokens/s.

    python3 experiments/gpu/items/d_fp8_matched.py [STEPS]
"""

from __future__ import annotations

import statistics
import sys
import time

import common

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 500
SEEDS = (0, 1)
BASE = [
    *common.DATA,
    *common.QUIET,
    "model=134m",
    "kernels=compile",
    "data.batch_size=8",
    f"trainer.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",
    f"optim.warmup_steps={STEPS // 10}",
    "optim.schedule=wsd",
    "optim.decay_fraction=0.2",
    f"trainer.val_every_steps={STEPS // 5}",
    "trainer.limit_val_batches=16",
    "trainer.log_every_n_steps=10",
    "checkpoint.every_n_steps=100000",
]
FIRST_RUN_S = 100.0


def main() -> None:
    runs: dict[str, dict] = {}
    timed: list[float] = []
    for seed in SEEDS:
        for precision in ("bf16", "fp8"):
            name = f"{precision}-s{seed}"
            need = 1.3 * (max(timed) if timed else FIRST_RUN_S)
            if common.left() < need:
                common.say(f"{name}: not started ({common.left():.0f} s left, a run takes ~{need:.0f})")
                continue
            started = time.monotonic()
            code, _ = common.train(
                common.WORK, name, [*BASE, f"precision={precision}", f"run.seed={seed}"], common.left()
            )
            timed.append(time.monotonic() - started)
            run_dir = common.WORK / name
            val = common.scalars(run_dir, "val/loss") if code == 0 else []
            runs[name] = {
                "exit": code,
                "s": round(timed[-1], 1),
                "val_loss": val,
                "final_val_loss": val[-1][1] if val else None,
                "tokens_per_sec": common.steady(run_dir, "perf/tokens_per_sec", skip=50)
                if code == 0
                else None,
                "peak_mem_gb": max((v for _, v in common.scalars(run_dir, "perf/peak_mem_gb")), default=None)
                if code == 0
                else None,
            }
            common.say(f"{name}: {runs[name]}")
    final = {k: r["final_val_loss"] for k, r in runs.items()}
    paired = {
        s: final[f"fp8-s{s}"] - final[f"bf16-s{s}"]
        for s in SEEDS
        if final.get(f"fp8-s{s}") is not None and final.get(f"bf16-s{s}") is not None
    }
    bf16 = [final[f"bf16-s{s}"] for s in SEEDS if final.get(f"bf16-s{s}") is not None]
    spread = max(bf16) - min(bf16) if len(bf16) > 1 else None
    rates = {
        p: statistics.fmean(
            r["tokens_per_sec"] for k, r in runs.items() if k.startswith(p) and r["tokens_per_sec"]
        )
        for p in ("bf16", "fp8")
        if any(k.startswith(p) and r["tokens_per_sec"] for k, r in runs.items())
    }
    fields = {
        **common.gpu(),
        "steps": STEPS,
        "runs": runs,
        "paired_fp8_minus_bf16": paired,
        "bf16_seed_spread": spread,
    }
    failed = [k for k, r in runs.items() if r["exit"] != 0]
    if not paired:
        common.result(
            f"no paired seed finished ({len(runs)} runs, failed: {failed})", status="failed", **fields
        )
        return
    diffs = ", ".join(f"s{s} {d:+.4f}" for s, d in paired.items())
    speed = f"{rates['fp8'] / rates['bf16']:.2f}x tokens/s" if len(rates) == 2 else "no speed pair"
    noise = f"bf16 seed spread {spread:.4f}" if spread is not None else "one bf16 seed: no spread"
    verdict = ""
    if spread is not None:
        verdict = (
            "within noise" if all(abs(d) <= spread for d in paired.values()) else "outside the seed spread"
        )
    summary = (
        f"final val loss fp8 - bf16: {diffs} ({noise}; {verdict or 'no verdict'}); FP8 {speed}; {STEPS} steps"
    )
    common.result(summary, status="failed" if failed else "done", **fields)


if __name__ == "__main__":
    common.main(main)
