"""Measure `lm eval` on the bundled local task and the milestone callback's share of a tiny run's time.

    PYTHONPATH=src python experiments/2026-11-23-eval/measure.py OUT_DIR

Two tiny CPU runs of the same 60 steps, one with `evals=` (the local tiny_mc task at the phase boundary at
step 20, at step 40 and at the last step) and one without; then `lm eval` on the first. Everything offline.
Prints a JSON summary (also written to OUT_DIR/summary.json).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "fixtures" / "eval_tasks"
TINY = [
    "trainer=cpu", "trainer.enable_progress_bar=false", "model.n_layer=2", "model.d_model=64", "model.n_head=4",
    "data.max_bytes=1500000", "data.tokenizer_sample_bytes=500000", "data.vocab_size=512", "data.seq_len=64",
    "data.batch_size=8", "data.num_workers=2", "callbacks={}", "sampling.prompts=[]",
    "trainer.max_steps=60", "trainer.val_every_steps=20", "trainer.limit_val_batches=4",
]  # fmt: skip
EVALS = ["evals.tasks=[tiny_mc]", f"evals.include_path={TASKS}", "evals.steps=[40]", "evals.batch_size=8"]


def train(out: Path, name: str, extra: list[str]) -> float:
    """Wall seconds of `python train.py` for one run."""
    args = [*TINY, f"run.root={out}", f"run.name={name}", f"data.cache_dir={out / 'cache'}", *extra]
    started = time.monotonic()
    subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, check=True, timeout=900)
    return time.monotonic() - started


def main(out: Path) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    train(out, "warmup", ["trainer.max_steps=1"])  # prepares the data once, outside both measurements
    with_s = train(out, "with_evals", EVALS)
    without_s = train(out, "without_evals", [])
    run = out / "with_evals"
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    ledger = json.loads((run / "cost.json").read_text())
    started = time.monotonic()
    lm_eval = [sys.executable, "-m", "lm.cli", "eval", str(run), "--tasks", "tiny_mc"]
    subprocess.run([*lm_eval, "--include-path", str(TASKS)], cwd=ROOT, check=True, timeout=900)
    eval_s = time.monotonic() - started
    evals_s = sum(r["seconds"] for r in records)
    summary = {
        "wall_s_with_evals": with_s,
        "wall_s_without_evals": without_s,
        "milestones": [r["step"] for r in records],
        "callback_seconds_per_milestone": [round(r["seconds"], 2) for r in records],
        "callback_share_of_run_ledger": evals_s / sum(ledger["seconds"].values()),
        "ledger_seconds": ledger["seconds"],
        "lm_eval_wall_s": eval_s,
        "lm_eval": json.loads((run / "eval.json").read_text())["scores"],
        "eval_md": (run / "eval.md").read_text(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
