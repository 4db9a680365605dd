"""Past one GPU: how many GPUs a model needs under FSDP2, how much host memory a checkpoint save takes, and how
long it stalls training, for each checkpoint format. `lm plan --scale-out` prints it; the doctor's checkpoint
line says which format the run should write and why.

Device memory under FSDP2 on W GPUs (`fsdp_estimate`): the states of `lm.numbers.memory` (weights, gradients,
optimizer, autocast copies) divided by W, plus two blocks' weights gathered whole (the block computing and the
next one prefetched), plus one micro-batch's activations, with activation checkpointing on every block (what a
model that needs sharding runs with).

A checkpoint holds fp32 weights and AdamW's two moments: 12 bytes a parameter (`CHECKPOINT_BYTES`). Its save,
by format (`save_plans`):

    full       rank 0 gathers the whole state into its host memory (12 N bytes on one node), then writes it
               alone; training waits for the gather and the write.
    sharded    every rank copies its shard to host memory (12 N / W) and writes it; the nodes write in
               parallel; training waits for the slowest.
    async      every rank copies its shard into pinned host memory, kept for the run (12 N / W per rank), and
               training resumes; the write overlaps the next steps (at most one in flight), so the stall is the
               copy.

Bandwidths are assumptions, named so the numbers can be redone: `WRITE_GBPS` per node (a local NVMe or a
parallel file system's share per node), `GATHER_GBPS` into rank 0 (the inter-node network), `STAGE_GBPS` per
GPU from device to pinned host memory. They set the seconds, not the ratios between formats' host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lm.model import ModelConfig
from lm.numbers.memory import (
    GiB,
    MemoryEstimate,
    estimate,
    parameter_count,
)

CHECKPOINT_BYTES = 12
"""Bytes a parameter in a training checkpoint: fp32 weights and AdamW's two fp32 moments."""
WRITE_GBPS = 2.0
"""Sequential write bandwidth per node, GB/s (a local NVMe; a shared file system's per-node share)."""
GATHER_GBPS = 10.0
"""Bandwidth into rank 0 when it gathers a full state dict, GB/s (a 100 Gb/s NIC, or NVLink within a node)."""
STAGE_GBPS = 10.0
"""Device-to-pinned-host copy per GPU, GB/s (PCIe gen4/gen5 in practice)."""
FULL_FILE_STALL_S = 30.0
"""...and while its save stalls training at most this long (5% of the GPU time at a save every 10 minutes)."""
FULL_FILE_HOST_SHARE = 0.25
"""The full file stays the better deal while its gathered copy takes at most this share of rank 0's host
memory (the rest is the data loader's, the page cache's and the other ranks' on that node)."""


def fsdp_estimate(
    model: ModelConfig, world: int, *, seq_len: int, precision: str, batch_size: int = 1, cuda: bool = True
) -> MemoryEstimate:
    """One GPU's peak memory with the model's states sharded over `world` GPUs, every block checkpointed."""
    return estimate(
        model,
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        ac_every=1,
        cuda=cuda,
        shards=world,
    )


def gpus_needed(
    model: ModelConfig,
    memory_gb: float,
    *,
    seq_len: int,
    precision: str = "bf16-mixed",
    gpus_per_node: int = 8,
    max_gpus: int = 4096,
    headroom: float = 0.05,
) -> int | None:
    """The fewest GPUs (1, 2, 4, ... up to a node, then whole nodes) on which one sequence per GPU fits."""
    world = 1
    while world <= max_gpus:
        est = fsdp_estimate(model, world, seq_len=seq_len, precision=precision)
        if est.total <= memory_gb * 1e9 * (1 - headroom):
            return world
        world = world * 2 if world < gpus_per_node else world + gpus_per_node
    return None


@dataclass(frozen=True)
class SavePlan:
    """One checkpoint format's save, for a model on `world` GPUs."""

    format: str
    """`full`, `sharded` or `async` (sharded with checkpoint.async_save)."""
    checkpoint_bytes: int
    host_bytes_per_node: int
    """Host memory the save takes on the busiest node (rank 0's for the full file)."""
    stall_s: float
    """Seconds training waits for the save."""
    write_s: float
    """Seconds until the checkpoint is on disk."""


def save_plans(n_params: int, world: int, gpus_per_node: int = 8) -> list[SavePlan]:
    """The three formats' saves for `n_params` on `world` GPUs (`gpus_per_node` to a node)."""
    ckpt = n_params * CHECKPOINT_BYTES
    per_node = ckpt / world * min(world, gpus_per_node)
    full_write = ckpt / 1e9 / WRITE_GBPS + (ckpt / 1e9 / GATHER_GBPS if world > 1 else 0.0)
    shard_write = per_node / 1e9 / WRITE_GBPS
    stage = ckpt / world / 1e9 / STAGE_GBPS
    return [
        SavePlan("full", ckpt, ckpt, full_write, full_write),
        SavePlan("sharded", ckpt, int(per_node), shard_write, shard_write),
        SavePlan("async", ckpt, int(per_node), stage, stage + shard_write),
    ]


def recommend_format(n_params: int, world: int, host_bytes: float | None) -> tuple[str, str]:
    """(`full` or `sharded`, why): the full file while its gathered copy takes at most a quarter of rank 0's
    host memory, the model stays within one node and its save stalls training at most `FULL_FILE_STALL_S`
    (one file, resumable and readable anywhere); sharded with async saves past any of these."""
    ckpt = n_params * CHECKPOINT_BYTES
    if world <= 1:
        return "full", "one process: nothing to shard"
    if host_bytes is not None and ckpt > FULL_FILE_HOST_SHARE * host_bytes:
        return "sharded", (
            f"the full file gathers {ckpt / GiB:.1f} GiB on rank 0, more than "
            f"{FULL_FILE_HOST_SHARE:.0%} of its {host_bytes / GiB:.0f} GiB host memory"
        )
    if world > 8:
        return (
            "sharded",
            f"{world} GPUs span nodes: rank 0's gather of {ckpt / GiB:.1f} GiB crosses the network",
        )
    full, _, background = save_plans(n_params, world)
    if full.stall_s > FULL_FILE_STALL_S:
        return "sharded", (
            f"the full file's save would hold every GPU ~{full.stall_s:.0f} s, an async sharded one "
            f"~{background.stall_s:.1f} s"
        )
    return "full", (
        f"the gathered {ckpt / GiB:.1f} GiB fits rank 0's host memory and saves in ~{full.stall_s:.0f} s: "
        "one file, readable anywhere"
    )


def scale_out_table(
    name: str,
    model: ModelConfig,
    gpus: list[tuple[str, float]],
    *,
    seq_len: int,
    precision: str = "bf16-mixed",
) -> str:
    """`lm plan --scale-out`: per catalog GPU, the GPUs the model needs and each format's save."""
    n_params = parameter_count(model)[0]
    lines = [
        f"{name}: {n_params / 1e9:.2f}B parameters, a checkpoint of {n_params * CHECKPOINT_BYTES / GiB:.0f} GiB "
        f"(fp32 weights + AdamW moments); FSDP2, {precision}, one {seq_len}-token sequence per GPU, "
        f"activation checkpointing on every block",
        f"assumed: write {WRITE_GBPS:g} GB/s per node, gather {GATHER_GBPS:g} GB/s into rank 0, "
        f"stage {STAGE_GBPS:g} GB/s per GPU (lm.numbers.scale_out)",
        "",
        "| GPU | GPUs | nodes | GiB/GPU | full: host, stall | sharded: host/node, stall | async: pinned/node, stall |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpu, memory_gb in gpus:
        world = gpus_needed(model, memory_gb, seq_len=seq_len, precision=precision)
        if world is None:
            lines.append(f"| {gpu} | does not fit | | | | | |")
            continue
        est = fsdp_estimate(model, world, seq_len=seq_len, precision=precision)
        full, sharded, background = save_plans(n_params, world)
        lines.append(
            f"| {gpu} | {world} | {math.ceil(world / 8)} | {est.total / GiB:.0f} | "
            f"{full.host_bytes_per_node / GiB:.0f} GiB, {full.stall_s:.0f} s | "
            f"{sharded.host_bytes_per_node / GiB:.0f} GiB, {sharded.stall_s:.0f} s | "
            f"{background.host_bytes_per_node / GiB:.0f} GiB, {background.stall_s:.1f} s |"
        )
    return "\n".join(lines)
