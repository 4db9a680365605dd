"""Run under `torchrun --nproc-per-node=W`: Muon on an FSDP2 model vs single-process Muon on a copy.

Every rank trains the FSDP2 model and, beside it, an unsharded copy. The copy's optimizer steps on the FSDP2
model's averaged gradient, gathered whole, so both optimizers see the same gradient bit for bit and any
difference in the weights is the optimizer's. (Feeding each rank the same batch is not enough on 3 ranks:
(g + g + g) / 3 rounds where (g + g) / 2 does not, and the bf16 orthogonalisation grew that 1e-9 into 0.017
in 20 steps.) Writes the largest weight difference after each step to argv[1] (rank 0).
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
    # Row counts that leave uneven shards (torch.chunk's split) on every world the tests use: the SwiGLU's 137
    # rows split 69/68 on 2 ranks, 46/46/45 on 3 and 35/35/35/32 on 4; d_model 56 (4 heads of 14, even for
    # RoPE) splits 19/19/18 on 3. (48 and 136 divided evenly by 2 and 4, so no shard was ever uneven.)
    cfg = ModelConfig(n_layer=3, d_model=56, n_head=4, vocab_size=256, ffn_hidden=137)
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
        logits = sharded(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        for n, p in single.named_parameters():
            p.grad = grads[n].clone()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
        diffs.append(max((full[n] - p).abs().max().item() for n, p in single.named_parameters()))
    world = dist.get_world_size()
    uneven = sorted(n for n, p in sharded.named_parameters() if p.ndim == 2 and p.size(0) % world)
    moved = min(
        (p - q).abs().max().item() for p, q in zip(single.parameters(), start.parameters(), strict=True)
    )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"diffs": diffs, "moved": moved, "world": world, "uneven": uneven}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
