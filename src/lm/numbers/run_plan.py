"""The plan of a run in numbers: tokens per optimizer step, where the plan ends, its phases, Chinchilla.

Every caller that needs one of these numbers (`lm prepare`'s epoch count, the doctor, the data module's
repeated-data warning, the early stopper's forecast, the cost meter) reads it here, so they cannot disagree.
A step's tokens count every device of the job: data.batch_size x data.seq_len x accumulation x world size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lm.config import LMConfig, PhaseConfig, TrainerConfig

CHINCHILLA_TOKENS_PER_PARAM = 20


def world_size(trainer: TrainerConfig) -> int:
    """Processes the job trains on: devices per node x nodes (`auto` and -1: every visible GPU, else 1)."""
    devices = trainer.devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    gpus = torch.cuda.device_count() if trainer.accelerator in ("auto", "gpu", "cuda") else 0
    if isinstance(devices, int):
        per_node = (gpus or 1) if devices == -1 else devices
    elif isinstance(devices, Iterable) and not isinstance(devices, str):
        per_node = len(list(devices))
    else:  # `auto`
        per_node = gpus or 1
    return per_node * trainer.num_nodes


def tokens_per_step(cfg: LMConfig, world: int | None = None) -> int:
    """Tokens of one optimizer step over the whole job (`world` processes; default: `world_size`)."""
    world = world_size(cfg.trainer) if world is None else world
    return cfg.data.batch_size * cfg.data.seq_len * cfg.trainer.accumulate_grad_batches * world


@dataclass(frozen=True)
class PlanEnd:
    """Where the whole plan ends (not this invocation: phase 1 of a plan stops long before)."""

    tokens: int
    """Tokens trained when the plan ends."""
    steps: int | None
    """Its optimizer step; None when the plan ends at a token count (`end_tokens` of the last phase)."""
    source: str
    """Where the numbers come from, for messages: `optim.total_steps=90,000 x 131,072 tokens/step`."""


def plan_end(cfg: LMConfig, world: int | None = None) -> PlanEnd:
    """The plan's end: the last phase's `end_tokens`, else the largest of trainer.max_steps, optim.total_steps
    and the last phase's `end_step` (the schedule and the phases may span more than this invocation)."""
    per_step = tokens_per_step(cfg, world)
    last = cfg.phases.phases[-1] if cfg.phases.phases else None
    if last is not None and last.end_tokens:
        return PlanEnd(last.end_tokens, None, f"phase '{last.name}' end_tokens")
    steps, source = cfg.trainer.max_steps, "trainer.max_steps"
    if cfg.optim.total_steps and cfg.optim.total_steps > steps:
        steps, source = cfg.optim.total_steps, "optim.total_steps"
    if last is not None and last.end_step and last.end_step > steps:
        steps, source = last.end_step, f"phase '{last.name}' end_step"
    return PlanEnd(steps * per_step, steps, f"{source}={steps:,} x {per_step:,} tokens/step")


def chinchilla_tokens(n_params: int) -> int:
    """The compute-optimal token budget of Hoffmann et al.: ~20 tokens per parameter."""
    return CHINCHILLA_TOKENS_PER_PARAM * n_params


def phase_at(step: int, tokens: int, phases: Sequence[PhaseConfig]) -> int:
    """Index of the phase that optimizer step `step` (with `tokens` trained so far) belongs to.

    A phase ending at step 200 holds steps 0..199; step 200 is the first of the next phase. Past the last
    phase the index is len(phases): training beyond the plan.
    """
    for i, phase in enumerate(phases):
        if phase.end_step is not None and step < phase.end_step:
            return i
        if phase.end_tokens is not None and tokens < phase.end_tokens:
            return i
    return len(phases)
