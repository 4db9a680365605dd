"""Store recorded runs as compact curve fixtures, with validation losses precise to < 0.01.

For each run directory: tests/fixtures/curves/<run name>.json with the schedule (optim section, total steps, tokens
per step), the training loss (every logged step), the in-run validation loss, and `val`: every kept checkpoint
(one per 100 steps) evaluated on `WINDOWS` validation windows, the same windows in the same order as the run's
loader. The noise of one such evaluation is the standard error of the mean over its windows (`val_windows_se`,
at the final checkpoint).

    python experiments/2026-11-23-forecast/extract_curves.py /tmp/forecast23/tiny_*
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from lm.checkpoint.files import checkpoint_step
from lm.config import DataConfig
from lm.data.datamodule import LMDataModule
from lm.engine.module import LMModule
from lm.store import rundir

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "curves"
WINDOWS = 3840


def val_batches(config) -> list[torch.Tensor]:
    """The first WINDOWS validation windows, batched as the run's loader batches them."""
    data = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), config.data))
    data.num_workers = 0
    dm = LMDataModule(data)
    dm.setup("validate")
    batches, n = [], 0
    for batch in dm.val_dataloader():
        batches.append(batch)
        n += len(batch)
        if n >= WINDOWS:
            break
    return batches


def window_losses(ckpt: Path, batches: list[torch.Tensor]) -> np.ndarray:
    """Mean loss of each window under a checkpoint's model."""
    model = LMModule.load_from_checkpoint(ckpt, map_location="cpu").model.eval()
    losses = []
    with torch.no_grad():
        for batch in batches:
            logits = model(batch[:, :-1])
            per_token = F.cross_entropy(
                logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="none"
            )
            losses += per_token.view(batch.shape[0], -1).mean(dim=1).tolist()
    return np.array(losses)


def extract(run_dir: Path) -> dict:
    config = rundir.read_config(run_dir)
    scalars = rundir.read_scalars(run_dir)
    train, inrun = scalars["train/loss"], scalars["val/loss"]
    batches = val_batches(config)
    ckpts = sorted((checkpoint_step(p), p) for p in (run_dir / "checkpoints").glob("step-*.ckpt"))
    steps, means, windows = [], [], None
    for step, path in ckpts:
        windows = window_losses(path, batches)
        steps.append(step)
        means.append(round(float(windows.mean()), 4))
    tokens_per_step = config.data.batch_size * config.data.seq_len * config.trainer.accumulate_grad_batches
    return {
        "name": run_dir.name,
        "optim": OmegaConf.to_container(config.optim),
        "total_steps": int(config.optim.total_steps or config.trainer.max_steps),
        "tokens_per_step": int(tokens_per_step),
        "train": {"step": train.steps.tolist(), "loss": np.round(train.values, 4).tolist()},
        "val": {"step": steps, "loss": means},
        "val_in_run": {"step": inrun.steps.tolist(), "loss": np.round(inrun.values, 4).tolist()},
        "val_windows": len(windows),
        "val_windows_se": round(float(windows.std(ddof=1) / np.sqrt(len(windows))), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for run_dir in args.runs:
        curve = extract(run_dir)
        (OUT / f"{curve['name']}.json").write_text(json.dumps(curve, separators=(",", ":")) + "\n")
        print(
            f"{curve['name']}: {len(curve['train']['step'])} train, {len(curve['val']['step'])} val points; "
            f"final val {curve['val']['loss'][-1]:.4f}; one evaluation's noise (SE over {curve['val_windows']} "
            f"windows) {curve['val_windows_se']:.4f}"
        )


if __name__ == "__main__":
    main()
