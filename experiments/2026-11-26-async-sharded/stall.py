"""The training stall of a checkpoint save, side by side: full file (rank 0 gathers, writes, fsyncs), sharded
(every rank writes its shards), and sharded in the background (checkpoint.async_save).

Run under torchrun (gloo on CPU, NCCL+gloo on GPU); every format trains the same FSDP2 model from the same
start. Stall = the wall time of the step that saves minus the median of the steps that do not (before it);
for the background save also the time added to the steps while the write runs (`after`).

    torchrun --standalone --nproc-per-node=2 experiments/2026-11-26-async-sharded/stall.py <out dir> [d_model n_layer]
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from lm.checkpoint import files
from lm.checkpoint.formats import FULL_FILE, SHARDED, AsyncShardedFolder
from lm.config import OptimConfig
from lm.engine import optim
from lm.engine.parallel import shard_model
from lm.model import ModelConfig, Transformer

STEPS, SAVE_AT, TOKENS = 10, 5, 128


def checkpoint(model, opt, full: bool) -> dict:
    """What Lightning's strategy hands the checkpoint IO (FSDP2Strategy: full or sharded state dicts)."""
    options = StateDictOptions(full_state_dict=full, cpu_offload=True)
    return {
        "state_dict": get_model_state_dict(model, options=options),
        "optimizer_states": [get_optimizer_state_dict(model, opt, options=options)],
        "global_step": SAVE_AT,
        "loops": {},
        "hyper_parameters": {},
    }


def run(fmt_name: str, out: Path, cfg: ModelConfig) -> dict:
    torch.manual_seed(0)
    model = Transformer(cfg)
    shard_model(model, init_device_mesh("cpu", (dist.get_world_size(),)), precision="32-true")
    opt = optim.build(model, OptimConfig(lr=1e-4), fused=False)
    fmt = {"full": FULL_FILE, "sharded": SHARDED, "async": AsyncShardedFolder()}[fmt_name]
    gen = torch.Generator().manual_seed(1)
    times, waited = [], 0.0
    for step in range(STEPS):
        x = torch.randint(0, cfg.vocab_size, (1, TOKENS + 1), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == SAVE_AT:
            path = out / f"{fmt_name}-{files.step_name(step)}"
            state = checkpoint(model, opt, full=fmt_name == "full")
            if fmt_name == "full":
                if dist.get_rank() == 0:
                    FULL_FILE.save(state, path)
            else:
                fmt.save(state, path)
        dist.barrier()  # every rank waits for the slowest, as the next step's collectives would make it
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if fmt_name == "async":
        fmt.wait()
    dist.barrier()
    waited = time.perf_counter() - t0
    base = statistics.median(times[1:SAVE_AT])  # step 0 warms up
    return {
        "format": fmt_name,
        "step_s": base,
        "stall_s": times[SAVE_AT] - base,
        "after_s": sum(t - base for t in times[SAVE_AT + 1 :]),
        "wait_at_end_s": waited,
        "times": times,
        "bytes": sum(p.stat().st_size for p in out.glob(f"{fmt_name}-*/*"))
        + sum(p.stat().st_size for p in out.glob(f"{fmt_name}-*.ckpt") if p.is_file()),
    }


def main() -> None:
    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    d_model, n_layer = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (768, 12)
    cfg = ModelConfig(vocab_size=32768, d_model=d_model, n_layer=n_layer, n_head=d_model // 64)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    results = [run(name, out, cfg) for name in ("full", "sharded", "async")]
    if dist.get_rank() == 0:
        report = {"world": dist.get_world_size(), "d_model": d_model, "n_layer": n_layer, "results": results}
        (out / "stall.json").write_text(json.dumps(report, indent=1))
        full = results[0]["stall_s"]
        for r in results:
            print(
                f"{r['format']:8s} step {r['step_s']:.2f} s  stall {r['stall_s']:6.2f} s ({r['stall_s'] / full:6.1%} "
                f"of full)  added after {r['after_s']:5.2f} s  wait at end {r['wait_at_end_s']:.2f} s  "
                f"{r['bytes'] / 2**30:.2f} GiB"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
