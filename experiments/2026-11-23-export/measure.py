"""Numbers for issue 14's export: logits differences against transformers, and exporting the 1b shape.

    PYTHONPATH=src python experiments/2026-11-23-export/measure.py --tokenizer TOKENIZER_JSON --work DIR

1. The largest |lm logits - LlamaForCausalLM logits| per variant (tiny random models, norm gains randomised;
   the variants of tests/interop/test_export.py), fp32 `keep` and `truncate`, and bf16 for scale.
2. `lm export` of the `1b` preset's shape (conf/model/1b.yaml at plan_1b's vocabulary and context, random
   weights, no training): a run directory is written by hand (checkpoint + the given tokenizer), then
   `export()` is timed for fp32 and bf16 and the files are listed with their sizes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from lm.config import compose, to_objects
from lm.interop.hf import to_hf_model
from lm.model import ModelConfig, Transformer
from lm.store import rundir
from lm.tools.export import export

VARIANTS = {
    "gqa": dict(n_head=4, n_kv_head=2),
    "tied": dict(tie_embeddings=True),
    "untied": dict(tie_embeddings=False),
    "padded_vocab": dict(vocab_size=300, vocab_multiple=128),
    "rope_theta_norm_eps": dict(rope_theta=500000.0, norm_eps=1e-6),
}


def tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=320, n_layer=2, d_model=64, n_head=4, max_seq_len=32, vocab_multiple=64)
    model = Transformer(ModelConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@torch.no_grad()
def logits_differences() -> dict[str, dict[str, float]]:
    out = {}
    for name, overrides in VARIANTS.items():
        model = tiny(**overrides)
        real = model.cfg.vocab_size
        ids = torch.randint(0, real, (2, model.cfg.max_seq_len), generator=torch.Generator().manual_seed(1))
        ours = model(ids)
        row = {}
        for label, kwargs in [
            ("fp32 keep", dict(vocab="keep")),
            ("fp32 truncate", dict(vocab="truncate")),
            ("bf16 keep", dict(vocab="keep", dtype=torch.bfloat16)),
        ]:
            theirs = to_hf_model(model, eos_id=0, **kwargs)(ids).logits.float()
            row[label] = float((ours[..., : theirs.shape[-1]] - theirs).abs().max())
        out[name] = row
    return out


def fake_run(work: Path, tokenizer: Path) -> tuple[Path, ModelConfig, int]:
    """A run directory holding a random 1b-shaped checkpoint and `tokenizer`, as `lm export` reads it."""
    cfg = to_objects(compose(["+experiment=plan_1b"])).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    run = work / "run"
    (run / rundir.CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    checkpoint = {
        "hyper_parameters": {"model": asdict(cfg)},
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "global_step": 0,
    }
    torch.save(checkpoint, run / rundir.CHECKPOINTS / "last.ckpt")
    rundir.keep_tokenizer(run, tokenizer, "<|endoftext|>", 0, resumed=False)
    return run, cfg, model.num_parameters()


def time_exports(run: Path, work: Path) -> dict[str, dict]:
    out = {}
    for dtype in ("fp32", "bf16"):
        folder = work / f"hf-{dtype}"
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        export(run, folder, dtype=dtype)
        seconds = time.perf_counter() - started
        files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
        out[dtype] = {"seconds": round(seconds, 1), "files": files, "total_gb": sum(files.values()) / 1e9}
        print(dtype, json.dumps(out[dtype]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json (id 0 end of text)")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (~15 GB)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {"logits_max_abs_diff": logits_differences()}
    print(json.dumps(results, indent=1), flush=True)
    started = time.perf_counter()
    run, cfg, n_params = fake_run(args.work, args.tokenizer)
    results["1b"] = {
        "model": asdict(cfg),
        "parameters": n_params,
        "write_checkpoint_seconds": round(time.perf_counter() - started, 1),
        "exports": time_exports(run, args.work),
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
