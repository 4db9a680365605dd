"""Ledger item c: the MFU levers on `1b` (then `134m`), each an `lm bench` row beside the current default,
measured in the same call.

First the attention kernels alone (lm has no SDPA-backend knob: a forward + backward of causal attention on
each model's shape under flash, cuDNN, memory-efficient and compiled flex_attention, CUDA events, median of 20).
Then one `lm bench` call per row, in priority order, while the box has room for another row as long as the
slowest so far: the default (`+experiment=plan_1b` with one micro-batch a step: bf16, compile, no checkpointing,
8 x 2048), FP8, CUDA graphs (`kernels.compile_mode=reduce-overhead`), Liger's fused linear cross-entropy with
compile, a larger micro-batch, max-autotune. Goals: bf16 >= 55% MFU on an H100 (50.8% on 2026-11-23), FP8 >=
1.25x bf16 (1.18x on 2026-11-26).

    python3 experiments/gpu/items/c_mfu_levers.py [1b|134m ...]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import common

BENCH = ["bench.warmup_steps=5", "bench.steps=15", "trainer.accumulate_grad_batches=1", "evals=off"]
MODELS = {
    "1b": (
        ["+experiment=plan_1b", "data.num_workers=4"],
        [
            ("default", []),
            ("fp8", ["precision=fp8"]),
            ("cuda graphs", ["kernels.compile_mode=reduce-overhead"]),
            ("liger + compile", ["kernels=liger_compile"]),
            ("micro-batch 12", ["data.batch_size=12"]),
            ("max-autotune", ["kernels.compile_mode=max-autotune-no-cudagraphs"]),
            ("fp8 rowwise", ["precision=fp8_rowwise"]),
        ],
    ),
    "134m": (
        [*common.DATA, "model=134m", "precision=bf16", "kernels=compile", "data.batch_size=8"],
        [
            ("default", []),
            ("fp8", ["precision=fp8"]),
            ("cuda graphs", ["kernels.compile_mode=reduce-overhead"]),
            ("micro-batch 32", ["data.batch_size=32"]),
        ],
    ),
}
SHAPES = {"1b": (8, 16, 2048, 128), "134m": (8, 12, 2048, 64)}
"""(batch, heads, sequence, head dim) of each model's attention."""
FIRST_ROW_S = {"1b": 150.0, "134m": 90.0}
"""What a row is assumed to take before one has been timed (compile included)."""


def attention(shape: tuple[int, int, int, int]) -> dict:
    """ms of a causal attention forward + backward per backend (None: the backend refused the shape)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, shape[2], shape[2], device="cuda")
    flex = torch.compile(flex_attention)

    def timed(fn) -> float:
        for _ in range(5):
            fn().backward(grad)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn().backward(grad)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    out = {}
    for name, backend in [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]:
        try:
            with sdpa_kernel(backend):
                out[name] = round(timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), 3)
        except RuntimeError as e:
            common.say(f"{name}: {e}")
            out[name] = None
    try:
        out["flex"] = round(timed(lambda: flex(q, k, v, block_mask=mask)), 3)
    except Exception as e:  # an Inductor lowering error is as much a result as a time
        common.say(f"flex: {type(e).__name__}: {e}")
        out["flex"] = None
    return out


def bench_row(model: str, label: str, overrides: list[str], timeout: float) -> dict:
    out_dir = common.WORK / model / label.replace(" ", "_").replace("+", "")
    args = [
        *MODELS[model][0],
        *BENCH,
        *overrides,
        f"bench.out_dir={out_dir}",
        f"bench.timeout_s={timeout:.0f}",
    ]
    code, seconds = common.lm("bench", args, timeout + 15)
    row = {"label": label, "overrides": overrides, "exit": code, "s": round(seconds, 1)}
    try:
        bench = json.loads((out_dir / "bench.json").read_text())["results"][0]
    except (OSError, ValueError, LookupError) as e:
        return {**row, "status": "error", "error": f"no bench.json: {e}"}
    keep = ("status", "error", "tokens_per_sec", "mfu", "peak_mem_gb", "precision", "gpu", "device")
    return {**row, **{k: bench.get(k) for k in keep}}


def describe(model: str, rows: list[dict]) -> str:
    base = next((r for r in rows if r["label"] == "default" and r["status"] == "ok"), None)
    if base is None:
        return f"{model}: default row {rows[0]['status'] if rows else 'not run'}"
    mfu = f"{base['mfu']:.1%} MFU" if base["mfu"] is not None else "no MFU (no catalogued peak)"
    parts = [f"{model} default {base['tokens_per_sec']:,.0f} tok/s, {mfu}"]
    for r in rows[1:]:
        if r["status"] == "ok":
            parts.append(f"{r['label']} {r['tokens_per_sec'] / base['tokens_per_sec']:.2f}x")
        else:
            parts.append(f"{r['label']} {r['status']}")
    bf16 = [r["mfu"] for r in rows if r["status"] == "ok" and "fp8" not in r["label"] and r["mfu"]]
    fp8 = [r["tokens_per_sec"] for r in rows if r["status"] == "ok" and r["label"] == "fp8"]
    if bf16:
        parts.append(
            f"best bf16 MFU {max(bf16):.1%} (goal >= 55%: {'met' if max(bf16) >= 0.55 else 'missed'})"
        )
    if fp8:
        ratio = fp8[0] / base["tokens_per_sec"]
        parts.append(f"FP8 {ratio:.2f}x (goal >= 1.25x: {'met' if ratio >= 1.25 else 'missed'})")
    return ", ".join(parts)


def main() -> None:
    import torch

    models = sys.argv[1:] or list(MODELS)
    fields: dict = {**common.gpu(), "attention_ms": {}, "rows": {}}
    for model in models:
        if torch.cuda.is_available() and common.left() > 60:
            fields["attention_ms"][model] = attention(SHAPES[model])
            common.say(f"attention {model}: {fields['attention_ms'][model]}")
    torch.cuda.empty_cache()
    summaries = []
    for model in models:
        rows, timed = [], []
        for label, overrides in MODELS[model][1]:
            slowest = max(timed) if timed else FIRST_ROW_S[model]
            if common.left() < 1.2 * slowest:
                common.say(
                    f"{model} {label}: not started ({common.left():.0f} s left, a row takes ~{slowest:.0f})"
                )
                break
            started = time.monotonic()
            rows.append(bench_row(model, label, overrides, min(common.left() - 15, 3 * slowest)))
            timed.append(time.monotonic() - started)
            common.say(f"{model} {label}: {rows[-1]}")
        fields["rows"][model] = rows
        if rows:
            summaries.append(describe(model, rows))
    ran = sum(len(r) for r in fields["rows"].values())
    planned = sum(len(MODELS[m][1]) for m in models)
    attn = "; ".join(
        f"attention {m} ms " + " ".join(f"{k} {v}" for k, v in ms.items())
        for m, ms in fields["attention_ms"].items()
    )
    summary = "; ".join(summaries) or "no bench row ran"
    common.result(f"{summary}; {attn} ({ran}/{planned} rows)", **fields)


if __name__ == "__main__":
    common.main(main)
