"""Muon against AdamW on the same model, data and step budget, on a CPU.

    PYTHONPATH=src python experiments/2026-11-23-muon/compare.py --shape micro --steps 300 \
        --out experiments/2026-11-23-muon/micro

1. LR sweep: `python train.py` (real runs, real data: the bundled stdlib corpus) for each optimizer at three
   peak LRs; each run's val/loss curve is read from its TensorBoard events.
2. At each optimizer's best LR (lowest final val loss): Muon runs with shorter budgets (each with its own
   warm-up/decay) give the tokens Muon needs to reach AdamW's final loss, a fairer measure than reading the
   stable part of one long Muon curve (its LR decay still ahead).
3. Step time: both optimizers on the same model in ONE process, steps interleaved, so the shared machine's
   load falls on both alike; the ratio converts tokens into wall time and dollars.
Writes results.json and val_loss.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
# Each shape: its model and data overrides. `micro` is the test suite's TINY model (2 x 64, 0.1M parameters +
# 66K of embedding and head), the only one a few hundred steps of fits in ~30 min of a shared 2-core CPU.
SHAPES = {
    "micro": [
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=4",
        "data.vocab_size=512",
        "data.seq_len=64",
    ],
    "tiny": ["model=tiny", "data.vocab_size=2048", "data.seq_len=128"],  # 4 x 128: 0.8M + 0.5M
}
DATA = [
    "data.max_bytes=4000000",
    "data.tokenizer_sample_bytes=1000000",
    "data.batch_size=16",
    "data.num_workers=0",
]
# Muon's best of the first three sat at the edge (1e-2), so the grid goes one step further for it.
LRS = {"adamw": [1e-3, 3e-3, 1e-2], "muon": [1e-3, 3e-3, 1e-2, 3e-2]}


def train(out: Path, name: str, shape: str, optim: str, lr: float, steps: int, val_every: int) -> Path:
    """One real training run; returns its run directory."""
    run_dir = out / "runs" / name
    if (run_dir / "report.md").exists():
        return run_dir  # already done (the script resumes after an interruption)
    cmd = [
        sys.executable, "train.py", *SHAPES[shape], *DATA, f"optim={optim}", f"optim.lr={lr}",
        f"optim.warmup_steps={max(1, steps // 20)}", f"trainer.max_steps={steps}",
        f"trainer.val_every_steps={val_every}", "trainer.limit_val_batches=8", "trainer=cpu",
        "trainer.enable_progress_bar=false", "sampling=off", "callbacks={}", "run.resume=false",
        f"checkpoint.every_n_steps={steps}", f"run.root={out / 'runs'}", f"run.name={name}",
        f"data.cache_dir={out / 'cache'}", "cost.price_per_hour=0.1",
    ]  # fmt: skip
    started = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=3600, stdout=subprocess.DEVNULL)
    print(f"{name}: {time.time() - started:.0f} s", flush=True)
    return run_dir


def val_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    from lm.store.rundir import read_scalars

    s = read_scalars(run_dir)["val/loss"]
    return [int(x) for x in s.steps], [float(v) for v in s.values]


def step_times(shape: str, steps: int) -> dict[str, float]:
    """Median seconds per optimizer step (forward, backward, clip, step) of each optimizer, interleaved."""
    from omegaconf import OmegaConf

    from lm.config import OptimConfig, compose, to_objects
    from lm.engine import optim as lm_optim
    from lm.model import ModelConfig, Transformer

    cfg = to_objects(compose([*SHAPES[shape], *DATA]))
    model_cfg = ModelConfig(**OmegaConf.to_container(OmegaConf.structured(cfg.model)))
    torch.manual_seed(0)
    models, optimizers = {}, {}
    for name in ("adamw", "muon"):
        models[name] = Transformer(model_cfg)
        optimizers[name] = lm_optim.build(models[name], OptimConfig(name=name), fused=False)
    batch = torch.randint(0, model_cfg.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1))
    times = {"adamw": [], "muon": []}
    for i in range(steps + 3):
        for name in ("adamw", "muon") if i % 2 else ("muon", "adamw"):
            started = time.perf_counter()
            logits = models[name](batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
            optimizers[name].step()
            optimizers[name].zero_grad()
            if i >= 3:  # warm-up steps (allocator, first-touch of the moments) are not timed
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def reach(steps: list[int], losses: list[float], target: float) -> float | None:
    """First step at which the curve reaches `target`, interpolated linearly between evaluations."""
    for (s0, l0), (s1, l1) in zip(zip(steps, losses), zip(steps[1:], losses[1:])):
        if l1 <= target < l0:
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return float(steps[0]) if losses and losses[0] <= target else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="micro", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--price", type=float, default=2.0, help="$/h of the machine, for the dollar column")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=LRS["adamw"])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=LRS["muon"])
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=[0.6, 0.8], help="Muon's shorter budgets"
    )
    args = parser.parse_args()
    lrs = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    args.out.mkdir(parents=True, exist_ok=True)
    tokens_per_step = 16 * int(
        next(o for o in SHAPES[args.shape] if o.startswith("data.seq_len")).split("=")[1]
    )
    val_every = max(1, args.steps // 16)

    curves: dict[str, dict] = {}
    for optim, grid in lrs.items():
        for lr in grid:
            name = f"{optim}-lr{lr:g}"
            curves[name] = dict(
                zip(
                    ("steps", "loss"),
                    val_curve(train(args.out, name, args.shape, optim, lr, args.steps, val_every)),
                )
            )
            curves[name].update(optim=optim, lr=lr, final=curves[name]["loss"][-1])
    best = {o: min((c for c in curves.values() if c["optim"] == o), key=lambda c: c["final"]) for o in lrs}
    target = best["adamw"]["final"]

    # Muon at its best LR with shorter budgets, each decayed to its own end: the shortest that reaches the target.
    budgets = {}
    for fraction in args.fractions:
        steps = int(args.steps * fraction)
        name = f"muon-lr{best['muon']['lr']:g}-steps{steps}"
        _, losses = val_curve(train(args.out, name, args.shape, "muon", best["muon"]["lr"], steps, val_every))
        budgets[steps] = losses[-1]
    short_enough = [s for s, loss in budgets.items() if loss <= target]
    muon_steps = min(short_enough) if short_enough else None
    on_curve = reach(best["muon"]["steps"], best["muon"]["loss"], target)

    seconds = step_times(args.shape, 20)
    ratio = seconds["muon"] / seconds["adamw"]
    cost = {}
    for optim, steps in (("adamw", args.steps), ("muon", muon_steps)):
        if steps is not None:
            wall = steps * seconds[optim]
            cost[optim] = {
                "steps": steps,
                "tokens": steps * tokens_per_step,
                "wall_s": wall,
                "usd": wall / 3600 * args.price,
            }
    results = {
        "shape": args.shape,
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "curves": curves,
        "best_lr": {o: c["lr"] for o, c in best.items()},
        "adamw_final_loss": target,
        "muon_final_loss_at_best_lr": best["muon"]["final"],
        "muon_short_budgets_final_loss": budgets,
        "muon_steps_to_adamw_final_short_runs": muon_steps,
        "muon_steps_to_adamw_final_on_full_curve": on_curve,
        "step_seconds_one_process": seconds,
        "muon_step_time_ratio": ratio,
        "price_per_hour": args.price,
        "to_adamw_final": cost,
    }
    if "muon" in cost:
        results["token_ratio"] = cost["muon"]["tokens"] / cost["adamw"]["tokens"]
        results["dollar_ratio"] = cost["muon"]["usd"] / cost["adamw"]["usd"]
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(args.out, curves, best, tokens_per_step, target)
    print(json.dumps({k: v for k, v in results.items() if k != "curves"}, indent=1))


def plot(out: Path, curves: dict, best: dict, tokens_per_step: int, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    for c in curves.values():
        is_best = c is best[c["optim"]]
        tokens = np.array(c["steps"]) * tokens_per_step / 1e6
        ax.plot(tokens, c["loss"], color=colors[c["optim"]], lw=2.2 if is_best else 0.8,
                alpha=1 if is_best else 0.45, label=f"{c['optim']} lr={c['lr']:g}" + (" (best)" if is_best else ""))  # fmt: skip
    ax.axhline(target, color="gray", ls="--", lw=0.8, label="AdamW's final loss")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.set_title("Muon vs AdamW, same model and data (CPU)")
    fig.tight_layout()
    fig.savefig(out / "val_loss.png", dpi=120)


if __name__ == "__main__":
    main()
