"""Ledger item f: document masking under `torch.compile` on CUDA, after the fix of 2026-11-26 (flex_attention's
block mask built outside the compiled graph).

1. The GPU test that failed then: `pytest -m gpu tests/model/test_doc_mask.py -k flex` (eager and compiled
   flex against the dense mask).
2. A real run: `134m`, compile, bf16, STEPS steps with `model.doc_mask=true` and the same without, tokens/s of
   each (the block mask skips the blocks outside every document: what it costs or saves on the stdlib corpus).

    python3 experiments/gpu/items/f_doc_mask_compile.py [STEPS]
"""

from __future__ import annotations

import sys

import common

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
BASE = [
    *common.DATA,
    *common.QUIET,
    "model=134m",
    "precision=bf16",
    "kernels=compile",
    "data.batch_size=8",
    f"trainer.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",
    "optim.warmup_steps=10",
    "trainer.val_every_steps=100000",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=5",
    "checkpoint.every_n_steps=100000",
]


def main() -> None:
    test = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    test_code, test_s = common.run(
        [*test, "tests/model/test_doc_mask.py", "-k", "flex"], min(150, common.left())
    )
    runs = {}
    for name, mask in (("doc_mask", "true"), ("no_mask", "false")):
        if common.left() < 60:
            common.say(f"{name}: not started ({common.left():.0f} s left)")
            continue
        code, seconds = common.train(common.WORK, name, [*BASE, f"model.doc_mask={mask}"], common.left())
        rate = common.steady(common.WORK / name, "perf/tokens_per_sec", skip=20) if code == 0 else None
        runs[name] = {"exit": code, "s": round(seconds, 1), "tokens_per_sec": rate}
    fields = {**common.gpu(), "pytest_exit": test_code, "pytest_s": round(test_s, 1), "runs": runs}
    tested = {0: "GPU test passed", 5: "GPU test not collected", None: "GPU test cut"}.get(
        test_code, f"GPU test FAILED (exit {test_code})"
    )
    trained = ", ".join(f"{k} exit {r['exit']}" for k, r in runs.items()) or "no run"
    rates = {k: r["tokens_per_sec"] for k, r in runs.items() if r["tokens_per_sec"]}
    if len(rates) == 2:
        trained += f", doc_mask at {rates['doc_mask'] / rates['no_mask']:.2f}x the tokens/s of no mask"
    ok = test_code == 0 and runs.get("doc_mask", {}).get("exit") == 0
    common.result(
        f"{tested}; {STEPS}-step 134m compiled run: {trained}", status="done" if ok else "failed", **fields
    )


if __name__ == "__main__":
    common.main(main)
