"""KV-cached vs uncached generation speed (random weights; speed does not depend on them).

python experiments/2026-11-22-forecast/generation_speed.py --n-layer 12 --d-model 768 --n-head 12 --vocab 32000
"""

import argparse
import time

import torch

from lm.interop.generate import generate
from lm.model import ModelConfig, Transformer

parser = argparse.ArgumentParser()
parser.add_argument("--n-layer", type=int, default=12)
parser.add_argument("--d-model", type=int, default=768)
parser.add_argument("--n-head", type=int, default=12)
parser.add_argument("--vocab", type=int, default=32000)
parser.add_argument("--context", type=int, default=512)
parser.add_argument("--new", type=int, default=128)
args = parser.parse_args()

torch.manual_seed(0)
cfg = ModelConfig(
    vocab_size=args.vocab,
    n_layer=args.n_layer,
    d_model=args.d_model,
    n_head=args.n_head,
    max_seq_len=args.context,
)
model = Transformer(cfg).eval()
print(f"{model.num_parameters():,} parameters, {torch.get_num_threads()} threads")
prompt = list(range(1, 17))
for use_cache in (True, False):
    start = time.perf_counter()
    out = generate(model, prompt, args.new, use_cache=use_cache)
    seconds = time.perf_counter() - start
    print(f"use_cache={use_cache}: {len(out)} tokens in {seconds:.2f} s ({len(out) / seconds:.1f} tokens/s)")
