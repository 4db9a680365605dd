"""Framework overhead: the same model, data and optimizer trained through `lm` (Lightning with every lm
callback, TensorBoard, checkpointing, the progress bar) and through a bare PyTorch loop.

Both run in this process, alternately, so the machine's noise hits both; the ratio of steps/s is taken per
pair and summarised by its median. The timed window is steps [warmup, warmup + steps) of each run, timed from
the end of one training batch to the end of another: setup, the last validation and the final checkpoint
are outside it in both.

    PYTHONPATH=src .venv/bin/python experiments/2026-11-22-overhead/bench_overhead.py --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from lm.config import conf_dir, register_configs, to_objects
from lm.data import LMDataModule
from lm.engine.module import LMModule, lr_lambda
from lm.run import build
from lm.run import train as lm_train

# Big enough that one step takes well over 50 ms on 2 CPU cores (the floor), small enough to run often.
MODEL = ["model.d_model=256", "model.n_layer=4", "model.n_head=4", "data.seq_len=256", "data.batch_size=8"]


class StepClock(pl.Callback):
    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def on_train_batch_end(self, *args) -> None:
        self.times.append(clock())


def clock() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): the second is blind to other jobs on a shared machine."""
    return time.perf_counter(), time.process_time()


def config(root: Path, total: int, extra: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(
            "train",
            overrides=[
                f"run.root={root}",
                "run.name=overhead",
                "run.resume=false",
                "trainer=cpu",
                f"trainer.max_steps={total}",
                f"trainer.val_every_steps={total}",  # one validation, at the end (outside the window)
                "trainer.limit_val_batches=2",
                # Every lm callback stays in the stack, with no event of its own inside the window: the
                # phase tracker's boundary evaluation and the milestone samples are work, not overhead.
                "phases.phases=[{name: all, end_step: 100000}]",
                "sampling.at_phase_ends=false",
                *MODEL,
                *extra,
            ],
        )


def window_rate(times: list[tuple[float, float]], warmup: int, steps: int) -> tuple[float, float]:
    """Steps per wall second and per CPU second, from the end of step `warmup` to that of `warmup + steps`."""
    (w0, c0), (w1, c1) = times[warmup - 1], times[warmup + steps - 1]
    return steps / (w1 - w0), steps / (c1 - c0)


def run_lm(dcfg, warmup: int, steps: int) -> tuple[float, float]:
    clock = StepClock()
    factory = build.build_callbacks
    build.build_callbacks = lambda *a, **k: [*factory(*a, **k), clock]
    try:
        lm_train.main(dcfg)
    finally:
        build.build_callbacks = factory
    return window_rate(clock.times, warmup, steps)


def run_bare(dcfg, warmup: int, steps: int) -> tuple[float, float]:
    """The same work without a framework: loader, forward, loss, backward, clip, AdamW, LR schedule."""
    cfg = to_objects(dcfg)
    pl.seed_everything(cfg.run.seed, workers=True)
    data = LMDataModule(cfg.data)
    data.prepare_data()
    data.setup("fit")
    module = LMModule(cfg.model, cfg.optim)
    model = module.model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.optim, cfg.trainer.max_steps))
    times = []
    for step, batch in enumerate(data.train_dataloader()):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(clock())
        if step + 1 >= warmup + steps:
            break
    return window_rate(times, warmup, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # 1: no OpenMP spin-waits, so CPU seconds ignore other jobs
    total = args.warmup + args.steps + 1
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        dcfg = config(Path(tmp), total, [])
        run_bare(dcfg, 2, 1)  # prepare the data and warm the allocator once, outside any measurement
        for i in range(args.pairs):
            order = ("lm", "bare") if i % 2 == 0 else ("bare", "lm")
            rates = {}
            for which in order:
                run = run_lm if which == "lm" else run_bare
                rates[which] = run(config(Path(tmp), total, []), args.warmup, args.steps)
            ratio = rates["lm"][0] / rates["bare"][0]
            cpu_ratio = rates["lm"][1] / rates["bare"][1]
            pairs.append(
                {
                    "lm_steps_per_s": rates["lm"][0],
                    "bare_steps_per_s": rates["bare"][0],
                    "ratio": ratio,
                    "cpu_ratio": cpu_ratio,
                    "order": "/".join(order),
                    "load_avg_1m": os.getloadavg()[0],
                }
            )
            print(
                f"pair {i}: lm {rates['lm'][0]:.3f} steps/s, bare {rates['bare'][0]:.3f} steps/s, "
                f"ratio {ratio:.4f} (per CPU second: {cpu_ratio:.4f})"
            )
    ratios = [p["ratio"] for p in pairs]
    cpu_ratios = [p["cpu_ratio"] for p in pairs]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": MODEL,
        "warmup": args.warmup,
        "steps": args.steps,
        "ms_per_step_bare": 1000 / statistics.median(p["bare_steps_per_s"] for p in pairs),
        "median_ratio": statistics.median(ratios),
        "overhead_pct": 100 * (1 - statistics.median(ratios)),
        "median_cpu_ratio": statistics.median(cpu_ratios),
        "cpu_overhead_pct": 100 * (1 - statistics.median(cpu_ratios)),
        "pairs": pairs,
    }
    args.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "pairs"}, indent=2))


if __name__ == "__main__":
    main()
