"""Ledger item e: the training stall of a checkpoint save on one GPU, the asynchronous sharded save (pinned
staging) beside the full file and the synchronous sharded save; goal: async <= 10% of the full file's stall.

experiments/2026-11-26-async-sharded/stall.py measured it on 2 CPU ranks; this is the same measurement on
CUDA: one FSDP2 rank under torchrun (NCCL for training, gloo for the background write), the `1b` shape in
bf16 mixed precision with fused AdamW, 8 x 2048 random tokens a step, eager (no compile: the stall is the
question, not the step). Each format trains STEPS steps from the same start and saves after steps SAVES[0] and
SAVES[1]: stall = that step's wall time (synchronized) minus the median of steps 1..SAVES[0]-1; `after` = what
the steps between the saves lose while the first background write runs. The async format's first write is
finished (untimed) before its second save, so the second stall is the staging alone into the pinned buffers the
first save allocated (they are kept for the run): the first save pays the allocation, every later one only the
copy. 2026-11-28 on an H200 measured the first only (14.6 s, 57% of the full file's). Each checkpoint is
deleted once measured (12.7 GB at 1b).

    python3 experiments/gpu/items/e_async_stall.py [1b|134m]
    python3 experiments/gpu/items/e_async_stall.py tiny      # this script's logic on a CPU: no GPU number
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import common

STEPS, SAVES = 12, (5, 9)
SHAPES = {"1b": (2048, 18, 16), "134m": (768, 12, 12), "tiny": (64, 2, 4)}
"""(d_model, n_layer, n_head) of the presets (conf/model/); `tiny` checks this script on a CPU (gloo, fp32)."""
BATCH, SEQ, VOCAB = 8, 2048, 32000


def worker(out: Path, preset: str) -> None:
    import importlib.util

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lm.checkpoint import files
    from lm.checkpoint.formats import FULL_FILE, SHARDED, AsyncShardedFolder
    from lm.config import OptimConfig
    from lm.engine import optim
    from lm.engine.parallel import shard_model
    from lm.model import ModelConfig, Transformer

    spec = importlib.util.spec_from_file_location(
        "stall", common.REPO / "experiments/2026-11-26-async-sharded/stall.py"
    )
    stall = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stall)  # its `checkpoint`: the state dicts Lightning's FSDP2 strategy hands over

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(rank)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    d_model, n_layer, n_head = SHAPES[preset]
    batch, seq, vocab = (BATCH, SEQ, VOCAB) if cuda else (2, 64, 512)
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layer=n_layer, n_head=n_head, max_seq_len=seq)
    results = []
    for fmt_name in ("full", "sharded", "async"):
        torch.manual_seed(0)
        with torch.device(dev):
            model = Transformer(cfg)
        mesh = init_device_mesh(dev, (dist.get_world_size(),))
        shard_model(model, mesh, precision="bf16-mixed" if cuda else "32-true")
        opt = optim.build(model, OptimConfig(lr=1e-4), fused=cuda)
        fmt = {"full": FULL_FILE, "sharded": SHARDED, "async": AsyncShardedFolder()}[fmt_name]
        gen = torch.Generator(device=dev).manual_seed(1)
        paths = [out / f"{fmt_name}-{files.step_name(step)}" for step in SAVES]
        times = []
        for step in range(STEPS):
            x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=dev, generator=gen)
            if fmt_name == "async" and step == SAVES[1]:
                fmt.wait()  # untimed: the second save's stall is its staging alone
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step in SAVES:
                path = paths[SAVES.index(step)]
                state = stall.checkpoint(model, opt, full=fmt_name == "full")
                if fmt_name != "full":
                    fmt.save(state, path)
                elif rank == 0:
                    FULL_FILE.save(state, path)
                del state
            sync()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if fmt_name == "async":
            fmt.wait()
        dist.barrier()
        waited = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.glob("*")))
        base = statistics.median(times[1 : SAVES[0]])
        results.append(
            {
                "format": fmt_name,
                "step_s": base,
                "stall_s": times[SAVES[0]] - base,
                "stall2_s": times[SAVES[1]] - base,
                "after_s": sum(t - base for t in times[SAVES[0] + 1 : SAVES[1]]),
                "wait_at_end_s": waited,
                "gib": size / 2**30,
                "times": times,
            }
        )
        if rank == 0:
            for path in paths:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            print(json.dumps(results[-1]), flush=True)
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        report = {"world": dist.get_world_size(), "preset": preset, "results": results}
        (out / "stall.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "1b"
    common.STANDIN = common.STANDIN or preset == "tiny"
    out = common.WORK / preset
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    code, _ = common.run([*cmd, __file__, "--worker", str(out), preset], common.left())
    if not (out / "stall.json").exists():
        common.result(f"failed: the worker exited {code} without stall.json", status="failed", **common.gpu())
        return
    report = json.loads((out / "stall.json").read_text())
    by = {r["format"]: r for r in report["results"]}
    full, sharded, bg = by["full"], by["sharded"], by["async"]
    ratio = bg["stall_s"] / full["stall_s"] if full["stall_s"] > 0 else float("nan")
    steady = bg["stall2_s"] / full["stall2_s"] if full["stall2_s"] > 0 else float("nan")
    both = (bg["stall_s"] + bg["after_s"]) / (full["stall_s"] + full["after_s"])
    summary = (
        f"{preset}, {full['gib']:.1f} GiB, step {full['step_s']:.3f} s: stall of the first save / a later one: "
        f"full {full['stall_s']:.2f} / {full['stall2_s']:.2f} s, sharded {sharded['stall_s']:.2f} / "
        f"{sharded['stall2_s']:.2f} s, async {bg['stall_s']:.2f} / {bg['stall2_s']:.2f} s = {ratio:.1%} / "
        f"{steady:.1%} of full (goal <= 10%: first {'met' if ratio <= 0.10 else 'missed'}, later "
        f"{'met' if steady <= 0.10 else 'missed'}); the first with the steps after it {both:.1%}"
    )
    common.result(summary, **common.gpu(), **report)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), sys.argv[3])
    else:
        common.main(main)
