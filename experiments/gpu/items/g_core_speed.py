"""Ledger items g and h: how long DCLM CORE takes on the flagship shape, scored by lm's packed scorer.

The `1b` model (18 x 2048, 32K vocabulary, 2048-token context), random weights in bf16 (the time does not
depend on what the weights know: every item is scored the same way), the 32K tokenizer run.sh prepares, the
CORE task files the session's checkout carries (../shared/evals/core or shared/evals/core: 18 of 22, so the
figure is CORE-18's time; the 4 missing tasks add about a fifth). `LIMIT` items per task (a number, the
in-loop CORE-500) or `all`. Reports seconds, items, tokens through the model and tokens/s, and the share of a
1B run's time that one milestone costs (the run: 20 tokens per parameter at the step time of ledger item c).

    python3 experiments/gpu/items/g_core_speed.py 500 [ROWS]    # item g: CORE-500 <= 90 s
    python3 experiments/gpu/items/g_core_speed.py all [ROWS]    # item h: full CORE <= 12 min
"""

from __future__ import annotations

import glob
import os
import sys
import time

import common

LIMIT = None if (sys.argv[1] if len(sys.argv) > 1 else "500") == "all" else int(sys.argv[1])
ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 16


def tokenizer_json() -> str:
    """The 32K tokenizer run.sh's `lm prepare +experiment=plan_1b` left in LM_CACHE (the tiny one when standing in)."""
    cache = os.environ.get("LM_CACHE", os.path.expanduser("~/.cache/lm"))
    from tokenizers import Tokenizer

    for path in sorted(glob.glob(f"{cache}/**/tokenizer.json", recursive=True)):
        if Tokenizer.from_file(path).get_vocab_size() >= (400 if common.STANDIN else 30000):
            return path
    raise FileNotFoundError(f"no prepared tokenizer under {cache}: run lm prepare +experiment=plan_1b first")


def main() -> None:
    import torch
    from tokenizers import Tokenizer

    from lm.evals import own as offline
    from lm.evals.scorer import Scorer
    from lm.model import ModelConfig, Transformer

    tokenizer = Tokenizer.from_file(tokenizer_json())
    vocab = tokenizer.get_vocab_size()
    if common.STANDIN:
        cfg = ModelConfig(vocab_size=vocab, n_layer=2, d_model=64, n_head=4, max_seq_len=64)
        device, dtype = "cpu", torch.float32
    else:
        cfg = ModelConfig(vocab_size=vocab, n_layer=18, d_model=2048, n_head=16, max_seq_len=2048)
        device, dtype = "cuda", torch.bfloat16
    model = Transformer(cfg).to(device=device, dtype=dtype).eval()
    plan = offline.resolve(["core"], common.core_dir(), partial=True)
    scorer = Scorer(model, tokenizer, 0, rows=ROWS)
    tokens = 0
    forward = scorer.forward

    def counting(rows, requests, results):  # tokens through the model, padding included
        nonlocal tokens
        tokens += len(rows) * max(sum(u.size for u in row) for row in rows)
        return forward(rows, requests, results)

    scorer.forward = counting
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.monotonic()
    counts, _ = offline.score_tasks(scorer, plan.tasks, limit=LIMIT)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.monotonic() - started
    _, core = offline.summary(plan, counts, LIMIT)
    items = sum(c.n for c in counts.values())
    # A 1B run at 20 tokens per parameter: 21.1B tokens at ledger item c's 1b step rate, when it is known.
    rate = float(os.environ.get("LM_1B_TOKENS_PER_S", "0")) or None
    share = seconds / (21.1e9 / rate) if rate else None
    goal = 90 if LIMIT == 500 else 720
    common.result(
        f"{core['label']} ({'all' if LIMIT is None else LIMIT} items/task, {items} items) in {seconds:.1f} s "
        f"(goal <= {goal} s: {'met' if seconds <= goal else 'missed'}); {tokens / seconds:,.0f} tokens/s "
        f"through the 1b model in bf16, {ROWS} rows of {cfg.max_seq_len}",
        status="done",
        seconds=round(seconds, 2),
        items=items,
        tokens=tokens,
        rows=ROWS,
        core=core["value"],
        share_of_1b_run=share,
        left_out=core["left_out"],
        **common.gpu(),
    )


if __name__ == "__main__":
    common.main(main)
