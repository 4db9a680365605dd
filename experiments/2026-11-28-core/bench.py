"""CORE on a trained run, and lm's packed scorer against lm-evaluation-harness on the same requests.

1. CORE-k of the run's model on this machine with `lm eval`'s own path (lm.interop.offline): the time, the
   items, the figure.
2. The same rendered (context, continuation) requests scored by lm's `Scorer` and by lm-eval's HFLM
   (`loglikelihood`, on the `transformers` copy of the model, batch size 16 both), interleaved (lm, lm-eval,
   lm, ...) `--repeats` times in one process, so both see the same machine; the ratio of the medians, and
   the largest per-request log-likelihood difference as a check that both scored the same thing.

    python experiments/2026-11-28-core/bench.py RUN_DIR --data-dir ../shared/evals/core \
        [--core-limit N] [--tasks core:copa,...] [--limit N] [--repeats R] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.base.scores import core_line
from lm.evals import core
from lm.evals import own as offline
from lm.evals.scorer import Scorer
from lm.interop.hf import hf_tokenizer, load_run, to_hf_model
from lm.model import Transformer

TASKS = "core"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--core-limit", type=int, default=None, help="items per task for part 1 (default: all)")
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--limit", type=int, default=50, help="items per task for part 2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-core", action="store_true", help="part 2 only")
    ap.add_argument(
        "--context",
        type=int,
        default=None,
        help="widen the model's context to this many positions (weights unchanged: RoPE tables only), so "
        "10-shot prompts fit as they do in 1b's 2048 (speed only: scores past the trained length mean little)",
    )
    a = ap.parse_args()
    run = load_run(a.run)
    if a.context:
        wide = Transformer(dataclasses.replace(run.model_cfg, max_seq_len=a.context))
        wide.load_state_dict(run.model.state_dict())
        run.model, run.model_cfg = wide.eval(), wide.cfg
    tokenizer = Tokenizer.from_file(str(run.tokenizer_path))
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "load_average_at_start": os.getloadavg(),
        "run": str(a.run),
        "step": run.step,
        "model": {
            k: getattr(run.model_cfg, k)
            for k in ("n_layer", "d_model", "n_head", "max_seq_len", "vocab_size")
        },
    }

    # 1. CORE-k with lm eval's own path
    if a.skip_core:
        return part2(a, run, tokenizer, out)
    started = time.monotonic()
    plan = offline.resolve(["core"], a.data_dir, partial=True)
    resolve_s = time.monotonic() - started
    started = time.monotonic()
    counts, _ = offline.score_tasks(
        Scorer(run.model, tokenizer, run.eot_id, rows=a.batch), plan.tasks, limit=a.core_limit
    )
    seconds = time.monotonic() - started
    _, record = offline.summary(plan, counts, a.core_limit)
    out["core"] = {
        "label": record["label"],
        "value": record["value"],
        "tasks": record["tasks"],
        "left_out": record["left_out"],
        "limit": a.core_limit,
        "items": sum(c.n for c in counts.values()),
        "seconds": seconds,
        "resolve_seconds": resolve_s,
    }
    print(
        f"part 1: {core_line(record)}: {out['core']['items']} items in {seconds:.1f} s "
        f"(+{resolve_s:.1f} s checking and reading the files)",
        flush=True,
    )

    part2(a, run, tokenizer, out)


def part2(a, run, tokenizer, out: dict) -> None:
    """The same requests, lm's scorer against lm-eval's HFLM, interleaved."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    names = a.tasks.split(",")
    plan = offline.resolve(names, a.data_dir, partial=True)
    questions = [
        core.render(data, i) for data in plan.tasks for i in core.subset(len(data.items), a.limit, data.label)
    ]
    pairs = [q.pairs for q in questions]
    n_requests = sum(len(p) for p in pairs)
    harness = HFLM(
        pretrained=to_hf_model(run.model, eos_id=run.eot_id).eval(),
        tokenizer=hf_tokenizer(run.tokenizer_path, run.eot_token),
        batch_size=a.batch,
    )
    instances = [
        Instance("loglikelihood", {}, (run.eot_token + c, k), i)
        for i, (c, k) in enumerate(p for ps in pairs for p in ps)
    ]
    times = {"lm": [], "lm_eval": []}
    # One untimed call of each first: the first forward of each shape builds oneDNN's kernels (9.9 s against
    # 2.7 s for lm's second call of the same requests, seen here), which a long evaluation pays once.
    mine = Scorer(run.model, tokenizer, run.eot_id, rows=a.batch).score(pairs)
    theirs = harness.loglikelihood(instances, disable_tqdm=True)
    for _ in range(a.repeats):
        started = time.monotonic()
        mine = Scorer(run.model, tokenizer, run.eot_id, rows=a.batch).score(pairs)
        times["lm"].append(time.monotonic() - started)
        started = time.monotonic()
        theirs = harness.loglikelihood(instances, disable_tqdm=True)
        times["lm_eval"].append(time.monotonic() - started)
        print(f"  lm {times['lm'][-1]:.2f} s, lm-eval {times['lm_eval'][-1]:.2f} s", flush=True)
    flat = [s for q in mine for s in q]
    lm_tokens = sum(
        len(u.prefix) + sum(len(b) for _, b, _ in u.branches)
        for u in Scorer(run.model, tokenizer, run.eot_id).units(pairs)[1]
    )
    harness_tokens = sum(len(r.seq) - 1 for r in Scorer(run.model, tokenizer, run.eot_id).units(pairs)[0])
    diff = max(abs(s.logprob - t[0]) for s, t in zip(flat, theirs))
    greedy_same = all(s.greedy == t[1] for s, t in zip(flat, theirs))
    lm_s, harness_s = statistics.median(times["lm"]), statistics.median(times["lm_eval"])
    lm_min, harness_min = min(times["lm"]), min(times["lm_eval"])
    out["versus_lm_eval"] = {
        "tasks": names,
        "items_per_task": a.limit,
        "questions": len(questions),
        "requests": n_requests,
        "seconds": times,
        "median_lm_s": lm_s,
        "median_lm_eval_s": harness_s,
        "speedup": harness_s / lm_s,
        "speedup_of_minima": harness_min / lm_min,
        "max_abs_logprob_diff": diff,
        "tokens_through_the_model": {"lm": lm_tokens, "one_sequence_per_request": harness_tokens},
        "greedy_flags_equal": greedy_same,
    }
    print(
        f"part 2: {n_requests} requests ({len(questions)} questions): lm {lm_s:.2f} s, lm-eval {harness_s:.2f} s "
        f"(medians of {a.repeats}): {harness_s / lm_s:.2f}x (minima: {harness_min / lm_min:.2f}x); {harness_tokens / lm_tokens:.2f}x fewer tokens; max |logprob diff| {diff:.2e}, greedy flags equal: {greedy_same}"
    )
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
