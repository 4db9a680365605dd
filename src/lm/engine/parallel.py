"""More than one device: Lightning's DDP as it is, and FSDP2 (`fully_shard` per block) through Lightning.

`trainer.strategy=fsdp` means FSDP2 on Lightning's `ModelParallelStrategy`, not Lightning's `FSDPStrategy`
(FSDP1): FSDP2 shards each parameter as a DTensor (no flat parameters, so the optimizer and the gradient
norm see ordinary named parameters), composes with per-block `torch.compile` and activation checkpointing,
is what torchtitan builds on, and runs on CPUs with gloo, so it is tested on every commit.

Under SLURM, SIGUSR1 belongs to lm.callbacks.stop_signals.StopSignals (save at the next step, exit 75, the sbatch
script requeues); Lightning's own SLURM auto-requeue, which would save a second, differently named
checkpoint from inside the signal handler, is switched off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

from lm.base.exits import Refused
from lm.config import TrainerConfig
from lm.numbers.run_plan import devices_per_node, world_size

log = logging.getLogger(__name__)

FSDP = "fsdp"
"""The `trainer.strategy` value that selects `FSDP2Strategy`."""


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` as pure FSDP: one data-parallel mesh dimension over every process of the job.

    Checkpoints (`checkpoint.format`): `full` (the default) gathers weights and optimizer state on rank 0 into
    one `step-<N>.ckpt` written through the run's atomic CheckpointIO (~12 bytes a parameter of rank 0's host
    memory: 12 GB at 1B); `sharded` has every rank write its own shards in parallel into a `step-<N>.ckpt/`
    folder (`lm.checkpoint.formats.ShardedFolder`), nothing gathered anywhere. Both rotate, link as
    `last.ckpt`, are checked for corruption at resume and resume on any world size or strategy.

    `processes` is the job's world size (`job_processes`): the one data-parallel dimension spans all of it, no
    tensor parallelism (Lightning's `auto` would shard within a node and split tensors across nodes).
    """

    def __init__(self, sharded_checkpoints: bool = False, processes: int = 1, **kwargs) -> None:
        if "save_distributed_checkpoint" in kwargs:
            raise Refused("set checkpoint.format=sharded (or full), not save_distributed_checkpoint")
        self.sharded_checkpoints = sharded_checkpoints
        super().__init__(
            data_parallel_size=processes,
            tensor_parallel_size=1,
            save_distributed_checkpoint=sharded_checkpoints,
            **kwargs,
        )

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A full checkpoint: Lightning's (rank 0 writes through the run's CheckpointIO). A sharded one: every
        rank hands its shards to the same CheckpointIO, whose format (`ShardedFolder`) writes them together."""
        if not self.sharded_checkpoints:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = self.broadcast(str(filepath))  # one folder for every rank: rank 0's name
        self.checkpoint_io.save_checkpoint(checkpoint, path)


def build_strategy(name: str, sharded_checkpoints: bool = False, processes: int = 1) -> str | Strategy:
    """The Trainer's `strategy` argument for `trainer.strategy`: our FSDP2 over `processes` ranks for `fsdp`,
    else Lightning's name."""
    return FSDP2Strategy(sharded_checkpoints, processes) if name == FSDP else name


def job_processes(trainer: TrainerConfig) -> int:
    """The job's world size before the Trainer exists: torchrun's or SLURM's when they launched it, else
    `trainer.devices` (auto: the visible GPUs) x `trainer.num_nodes`, as Lightning's launcher will start it.
    Lightning checks it against the real one when the strategy sets up (a mismatch fails there, loudly)."""
    for env in (TorchElasticEnvironment, SLURMEnvironment):
        if env.detect():
            return env().world_size()
    return world_size(trainer)


def cluster_plugins() -> list:
    """Under SLURM, Lightning's environment without its SIGUSR1 auto-requeue (StopSignals owns the signal)."""
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def is_sharded(strategy: Strategy) -> bool:
    """Whether the weights are sharded across ranks, so that every forward needs every rank."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    return isinstance(strategy, ModelParallelStrategy | FSDPStrategy | DeepSpeedStrategy)


def shard_model(
    model: torch.nn.Module, mesh, *, precision: str, compile: bool = False, compile_mode: str | None = None
) -> None:
    """FSDP2 in place: each transformer block is one unit (gathered for its forward, freed after), the rest
    (embedding, final norm, head) the root unit. Under bf16 mixed precision the gathers move bf16 weights
    and gradients are reduced in fp32; sharded parameters and AdamW moments stay fp32.

    Blocks are compiled one by one before sharding (torchtitan's order): FSDP's hooks stay outside the graphs.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if precision.startswith("bf16-mixed"):
        # cast_forward_inputs=False: FSDP would cast the fp32 RoPE tables a block receives to bf16 in its
        # forward hook, a hook it skips when activation checkpointing recomputes the block in the backward
        # pass, so the recomputed tensors would differ in dtype from the saved ones (a CheckpointError seen
        # on an H100). Uncast, the tables stay fp32 in both passes, as under single-device bf16-mixed.
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        if compile:
            block.compile(mode=compile_mode)
        # The last block is gathered again at once for the backward pass: keep it gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The global L2 norm of the gradients, a plain tensor also when they are FSDP2 shards (DTensors)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor: the shards' norms are already combined
    return full_tensor() if full_tensor is not None else norm


def externally_launched() -> bool:
    """Whether torchrun or SLURM started the ranks (so Lightning's launcher does not re-run the command)."""
    return TorchElasticEnvironment.detect() or SLURMEnvironment.detect()


def check_strategy(strategy: str, devices, multirun: bool) -> None:
    """Refuse, before anything is built, strategies lm does not configure and launches that cannot work.

    Lightning's FSDP1 names would wrap the whole model as one unit and refuse norm clipping; a Hydra sweep
    (`-m`) whose jobs start ranks with Lightning's launcher would run the whole sweep in every rank, since
    that launcher re-runs the command line once per extra rank.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    if strategy != FSDP and strategy in FSDPStrategy.get_registered_strategies():
        raise Refused(
            f"trainer.strategy={strategy} is Lightning's FSDP1, which lm does not configure (no per-block "
            "wrapping, no gradient-norm clipping); use trainer=fsdp (FSDP2, one unit per block)"
        )
    if not multirun or "spawn" in strategy or externally_launched():
        return
    n = devices_per_node(devices, torch.cuda.device_count())
    if n > 1 or str(devices).strip() == "-1":
        raise Refused(
            f"a Hydra multirun (-m) cannot start {n if n > 1 else 'several'} processes per job with "
            f"trainer.strategy={strategy}: Lightning's launcher re-runs the command line for each rank, so "
            "every rank would run the whole sweep. Run one command per sweep point, or start the ranks with "
            "torchrun / srun"
        )
