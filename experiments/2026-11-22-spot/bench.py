"""Restart cost of a preemption for `tiny` on this machine, and checkpoint size/write time (measured for tiny,
extrapolated for 1b from this disk's measured fsync'd write bandwidth).

    PYTHONPATH=src python experiments/2026-11-22-spot/bench.py   # from the repository root
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lm.checkpoint.local import AtomicCheckpointIO, estimate_checkpoint_bytes
from lm.model import ModelConfig, Transformer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REPEATS = 3


def train(root: Path, out: Path, *extra: str) -> tuple[float, float]:
    """Run `python train.py` (the smoke defaults, CPU); returns (launch time, exit time)."""
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "train.py", f"run.root={root}", "trainer=cpu", "trainer.enable_progress_bar=false"]
    cmd += ["trainer.max_steps=60", "trainer.val_every_steps=1000", "checkpoint.every_n_steps=25"]
    cmd += ["+callbacks.clock._target_=clock.Clock", f"+callbacks.clock.out={out}", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode not in (0, 75):
        sys.exit(proc.stderr[-3000:])
    return t0, time.time()


def preemption(root: Path, k: int) -> dict:
    name = f"run.name=bench{k}"
    first, second = root / f"first{k}.json", root / f"second{k}.json"
    t0, t_exit = train(root, first, name, "+callbacks.clock.sigterm_at=40")
    a = json.loads(first.read_text())
    t1, _ = train(root, second, name)
    b = json.loads(second.read_text())
    assert b["start_step"] == 41, b["start_step"]  # resumed right after the step the signal saved
    return {
        "fresh_start_to_first_step_s": a["first_step_end"] - t0,
        "signal_to_exit_s": t_exit - a["signal_at"],
        "restart_to_first_step_s": b["first_step_end"] - t1,
        "step_s": a["median_step_s"],
    }


def write_time(ckpt: dict, directory: Path, n: int = 5) -> float:
    io, times = AtomicCheckpointIO(), []
    for i in range(n):
        t = time.perf_counter()
        io.save_checkpoint(ckpt, directory / f"w{i}.ckpt")
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as tmp:
        root = Path(tmp)
        runs = [preemption(root, k) for k in range(REPEATS)]
        result = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        tiny_ckpt = root / "bench0/checkpoints/last.ckpt"
        result["tiny_ckpt_bytes"] = tiny_ckpt.resolve().stat().st_size
        result["tiny_write_s"] = write_time(torch.load(tiny_ckpt, weights_only=False), root)
        # This disk's fsync'd bandwidth with a 1 GiB checkpoint, for the 1b extrapolation.
        big = {"w": torch.zeros(2**28)}  # 1 GiB of fp32
        result["disk_gib_per_s"] = 1.0 / write_time(big, root, n=3)

    with torch.device("meta"):
        model = Transformer(
            ModelConfig(vocab_size=32000, max_seq_len=2048, n_layer=18, d_model=2048, n_head=16)
        )
    n = sum(p.numel() for p in model.parameters())
    result["1b_params"] = n
    result["1b_ckpt_gib"] = estimate_checkpoint_bytes(n) / 2**30
    result["1b_write_s_this_disk"] = result["1b_ckpt_gib"] / result["disk_gib_per_s"]
    result["runs"] = runs
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
