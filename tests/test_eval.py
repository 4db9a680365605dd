"""Evaluation beyond the loss: validation bits per byte, `lm eval` (lm-evaluation-harness on a bundled local
task, offline), and benchmarks at milestones (`evals=`)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lm import rundir
from lm.data import load_manifest, load_tokenizer, shard_paths
from lm.data.dataset import TokenWindows, val_batches
from lm.module import LMModule
from lm.train import main

from .test_train import scalars


def test_val_bpb_is_the_validation_nats_over_the_bytes_of_text(tiny_cfg, tmp_path, data_cache):
    cfg = tiny_cfg("trainer.max_steps=4", "trainer.val_every_steps=4", "trainer.limit_val_batches=3")
    main(cfg)
    run = tmp_path / "runs" / "smoke"
    (step, bpb), *_ = scalars(run, "val/bpb")[-1:]

    # By hand: the checkpoint's summed nats over the validated windows, and the UTF-8 bytes the tokenizer
    # decodes their targets to (the whole stretch at once, end-of-text left out).
    folder = next(p for p in data_cache.iterdir() if (p / "manifest.json").is_file())
    manifest = load_manifest(folder)
    windows = TokenWindows(shard_paths(folder, manifest, "val"), cfg.data.seq_len, manifest["dtype"])
    batches = val_batches(len(windows), cfg.data.batch_size)[:3]
    module = LMModule.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    nats = 0.0
    tokenizer = load_tokenizer(folder)
    with torch.no_grad():
        for idx in batches:
            x = torch.stack([windows[i] for i in idx])
            logits = module.model(x[:, :-1])
            nats += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    ids = torch.cat([windows[i][1:] for idx in batches for i in idx]).tolist()
    n_bytes = len(tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8"))
    assert step == 3
    assert bpb == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert rundir.read_scalars(run)["val/bpb"].values[-1] == pytest.approx(bpb)
