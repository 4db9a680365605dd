"""FP8 (torchao's emulation) against the same weights in fp32, on the CPU: what an FP8 forward changes.

    python experiments/2026-11-24-fp8-selftest/fp8_numerics.py

For each recipe: the loss of a batch and the largest logit difference, on a tiny lm model with random weights
(4 blocks, d_model 128, vocab 512). Emulation computes what the FP8 kernels compute (casts with the same
scales, products accumulated in high precision), not how fast: speed awaits a GPU.
"""

import torch

from lm.engine import fp8
from lm.model import ModelConfig, Transformer

torch.manual_seed(0)
cfg = ModelConfig(vocab_size=512, n_layer=4, d_model=128, n_head=4, max_seq_len=128)
ids = torch.randint(0, 512, (8, 129), generator=torch.Generator().manual_seed(1))
for recipe in ("tensorwise", "rowwise"):
    torch.manual_seed(0)
    plain, converted = Transformer(cfg).eval(), Transformer(cfg).eval()
    converted.load_state_dict(plain.state_dict())
    names = fp8.convert(converted, recipe, emulate=True)
    with torch.no_grad():
        a, b = plain(ids[:, :-1]), converted(ids[:, :-1])
    loss_a = torch.nn.functional.cross_entropy(a[..., :512].flatten(0, 1), ids[:, 1:].flatten())
    loss_b = torch.nn.functional.cross_entropy(b[..., :512].flatten(0, 1), ids[:, 1:].flatten())
    diff = (a - b)[..., :512].abs().max().item()
    print(
        f"{recipe:10s} {len(names)} linears in FP8; loss fp32 {loss_a.item():.5f}, fp8 {loss_b.item():.5f} "
        f"({loss_b.item() - loss_a.item():+.2e}); max |logit diff| {diff:.3e} "
        f"({diff / a[..., :512].abs().max().item():.2%} of the largest logit)"
    )
