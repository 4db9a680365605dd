"""Muon on FSDP2 shards: each matrix orthogonalised once per step, by the rank that owns it.

Under FSDP2 parameters, gradients and momentum are row shards (`Shard(0)`) and Newton-Schulz needs the whole
matrix; torch's `Muon` accepts the shards but does not give single-process Muon's weights. So, as Moonlight's
ZeRO-1 Muon (torchtitan's and Dion's do the same): matrix i belongs to rank i mod W; each rank sends its rows of
every matrix's Nesterov update to the owner (`gather`), the owner orthogonalises it with the single-process
function and sends the rows back (`scatter`); momentum, decoupled decay and the LR scale (from the global shape)
are torch's `_single_tensor_muon` on the local rows. With equal gradients the weights equal single-process
Muon's (tests/engine/test_muon_fsdp.py). Cost: every matrix crosses the network twice a step in fp32; the
orthogonalisation FLOPs are divided by W."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lm.base.private_api import muon_adjust_lr

Orthogonalise = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
"""(the whole update matrix, its param group) -> the orthogonalised matrix."""


def is_sharded(p: torch.Tensor) -> bool:
    """Whether `p` is a DTensor (an FSDP2 shard)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def row_split(rows: int, world: int) -> list[int]:
    """Rows of each rank's shard under `Shard(0)`: torch.chunk's split (ceil(rows / W) each, the last ranks
    shorter or empty), which is how DTensor and FSDP2 lay out a row-sharded tensor."""
    size = -(-rows // world)
    return [max(0, min(size, rows - r * size)) for r in range(world)]


def check_layout(p: torch.Tensor) -> None:
    """Refuse layouts other than FSDP2's one-dimensional row sharding, naming what was found."""
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise NotImplementedError(
            f"sharded Muon takes FSDP2's row shards (one mesh dimension, Shard(0)); this parameter has "
            f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh (tensor parallelism is not supported: "
            "use trainer=fsdp alone)"
        )


@torch.no_grad()
def step(groups: list[dict[str, Any]], state: dict, orthogonalise: Orthogonalise) -> None:
    """One Muon step over `groups` whose parameters are row-sharded DTensors (every rank calls it).

    The same parameters in the same order on every rank (FSDP2 gives every rank every gradient), so the
    round-robin owners and the collectives line up.
    """
    todo: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []  # (group, param, local update rows)
    for group in groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            check_layout(p)
            if "momentum_buffer" not in state[p]:
                state[p]["momentum_buffer"] = torch.zeros_like(p.grad)  # a DTensor, sharded like the grad
            grad, buf = p.grad.to_local(), state[p]["momentum_buffer"].to_local()
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            todo.append((group, p, update))
    if not todo:
        return
    mesh_group = todo[0][1].device_mesh.get_group()
    world, rank = dist.get_world_size(mesh_group), dist.get_rank(mesh_group)
    owner = [i % world for i in range(len(todo))]

    # 1. every rank's rows of matrix i to its owner, padded to one shard size (gather takes equal sizes)
    gathered: list[list[torch.Tensor] | None] = []
    works = []
    for i, (_, p, update) in enumerate(todo):
        rows, cols = p.shape
        size = -(-rows // world)
        padded = update.new_zeros(size, cols)
        padded[: update.size(0)] = update
        bucket = [torch.empty_like(padded) for _ in range(world)] if owner[i] == rank else None
        dst = dist.get_global_rank(mesh_group, owner[i])
        works.append(dist.gather(padded, bucket, dst=dst, group=mesh_group, async_op=True))
        gathered.append(bucket)
    for work in works:
        work.wait()

    # 2. the owner orthogonalises the whole matrix; every rank gets its rows back
    mine: list[torch.Tensor] = []
    works = []
    for i, (group, p, update) in enumerate(todo):
        rows, cols = p.shape
        split = row_split(rows, world)
        size = -(-rows // world)
        chunks = None
        if owner[i] == rank:
            whole = torch.cat([t[:n] for t, n in zip(gathered[i], split, strict=True)])
            ortho = orthogonalise(whole, group).to(update.dtype)  # bf16 -> fp32 is exact
            chunks = []
            for r, n in enumerate(split):
                chunk = ortho.new_zeros(size, cols)
                chunk[:n] = ortho[sum(split[:r]) : sum(split[:r]) + n]
                chunks.append(chunk)
        out = update.new_empty(size, cols)
        src = dist.get_global_rank(mesh_group, owner[i])
        works.append(dist.scatter(out, chunks, src=src, group=mesh_group, async_op=True))
        mine.append(out)
    for work in works:
        work.wait()

    # 3. decay and update on the local rows, scaled by the whole matrix's shape
    for (group, p, update), out in zip(todo, mine, strict=True):
        lr = group["lr"]
        local = p.to_local()
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(out[: update.size(0)], alpha=-muon_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
