"""Run under `torchrun --nproc-per-node=W`: Muon on an FSDP2 model vs single-process Muon on a copy.

Every rank trains the FSDP2 model and, beside it, an unsharded copy with the same batches. Each rank feeds the
same batch, so FSDP2's averaged gradient is the single-process gradient exactly ((g + g) / 2 = g in floating
point): any difference in the weights is the optimizer's. Writes the largest weight difference after each
step to argv[1] (rank 0).
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lm.config import OptimConfig
from lm.engine import optim
from lm.engine.parallel import shard_model
from lm.model import ModelConfig, Transformer

STEPS = 20


def main(out: str, coefficients: str, ns_steps: int) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # 3 heads of 16 (d_model 48) and ffn 136: row counts that do not divide by 2 or 4 (uneven shards)
    cfg = ModelConfig(n_layer=3, d_model=48, n_head=3, vocab_size=256, ffn_hidden=136)
    single = Transformer(cfg)
    sharded, start = copy.deepcopy(single), copy.deepcopy(single)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard_model(sharded, mesh, precision="32-true")
    ocfg = OptimConfig(
        name="muon", lr=3e-3, weight_decay=0.1, muon_lr=0.02, ns_coefficients=coefficients, ns_steps=ns_steps
    )
    opts = [optim.build(m, ocfg, fused=False) for m in (single, sharded)]
    gen = torch.Generator().manual_seed(1)
    diffs = []
    for _ in range(STEPS):
        x = torch.randint(0, cfg.vocab_size, (4, 33), generator=gen)
        for model, opt in zip((single, sharded), opts, strict=True):
            logits = model(x[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
        diffs.append(max((full[n] - p).abs().max().item() for n, p in single.named_parameters()))
    moved = min(
        (p - q).abs().max().item() for p, q in zip(single.parameters(), start.parameters(), strict=True)
    )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"diffs": diffs, "moved": moved, "world": dist.get_world_size()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
