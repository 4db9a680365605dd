"""The plan of a run in numbers: tokens per optimizer step, where the plan ends, its phases, Chinchilla.

`resolve()` computes them once per entry point (`lm.run.train`, `lm doctor`, `lm prepare`) into a `RunPlan`
that is passed down to whoever reads one of these numbers (the doctor, the data module's repeated-data warning,
the early stopper's forecast, the cost meter, `lm prepare`'s epoch count), so they cannot disagree.
A step's tokens count every device of the job: data.batch_size x data.seq_len x accumulation x world size;
with a batch-size ramp the first steps have fewer (`BatchRamp`: the plan's tokens <-> steps go through it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lm.base.findings import Finding
from lm.config import DataConfig, OptimConfig, PhaseConfig, TrainerConfig
from lm.numbers.batch_ramp import BatchRamp, describe_seq_len_warmup, ramp_of, seq_len_warmup
from lm.numbers.loss_law import (
    CHINCHILLA_TOKENS_PER_PARAM,
    USEFUL_EPOCHS,
    WORTHWHILE_EPOCHS,
    effective_tokens,
)


def devices_per_node(devices: Any, gpus: int) -> int:
    """Processes per node that `trainer.devices` asks for: a count, a list of device ids, or `auto` / -1 (every
    one of `gpus` visible GPUs, 1 without any). The one reading of trainer.devices: the plan, the doctor and
    the multirun check (lm.engine.parallel) all count ranks with it."""
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices >= 0:
        return devices
    if isinstance(devices, Iterable) and not isinstance(devices, str):
        return len(list(devices))
    return max(1, gpus)  # `auto` or -1


def world_size(trainer: TrainerConfig, cuda: bool | None = None) -> int:
    """Processes the job trains on: devices per node x nodes. `cuda` says whether the job's devices are GPUs
    (default: the accelerator can be one); `auto` and -1 count the GPUs visible here."""
    cuda = trainer.accelerator in ("auto", "gpu", "cuda") if cuda is None else cuda
    gpus = torch.cuda.device_count() if cuda else 0
    return devices_per_node(trainer.devices, gpus) * trainer.num_nodes


@dataclass(frozen=True)
class PlanEnd:
    """Where the whole plan ends (not this invocation: phase 1 of a plan stops long before)."""

    tokens: int
    """Tokens trained when the plan ends."""
    steps: int | None
    """Its optimizer step; None when the plan ends at a token count (`end_tokens` of the last phase)."""
    source: str
    """Where the numbers come from, for messages: `optim.total_steps=90,000 x 131,072 tokens/step`."""


@dataclass(frozen=True)
class RunPlan:
    """A run's plan, resolved once from its config and passed to everything that reads one of its numbers."""

    world: int
    """Processes the job trains on (`world_size`)."""
    tokens_per_device_step: int
    """Tokens one process trains per optimizer step: batch x seq_len x accumulation."""
    end: PlanEnd
    """Where the whole plan ends, counted over the whole job."""
    schedule_steps: int
    """The optimizer steps the LR schedule spans: optim.total_steps, else trainer.max_steps."""
    ramp: BatchRamp
    """Rows per step and the tokens steps add up to (the batch-size ramp; exactly steps x tokens_per_step off)."""
    phases: tuple[PhaseConfig, ...] = ()

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over the whole job."""
        return self.tokens_per_device_step * self.world

    @property
    def end_steps(self) -> int:
        """The plan's last optimizer step (a token-count end rounded up to whole steps)."""
        if self.end.steps is not None:
            return self.end.steps
        return self.ramp.steps_for_tokens(self.end.tokens)


def resolve(
    data: DataConfig,
    trainer: TrainerConfig,
    optim: OptimConfig,
    phases: Sequence[PhaseConfig] = (),
    world: int | None = None,
) -> RunPlan:
    """The plan's numbers for a job of `world` processes (default: `world_size(trainer)`).

    The plan ends at the last phase's `end_tokens`, else at the largest of trainer.max_steps,
    optim.total_steps and the last phase's `end_step` (the schedule and the phases may span more than this
    invocation)."""
    world = world_size(trainer) if world is None else world
    per_device = data.batch_size * data.seq_len * trainer.accumulate_grad_batches
    per_step = per_device * world
    ramp = ramp_of(data, trainer.accumulate_grad_batches, world)
    last = phases[-1] if phases else None
    if last is not None and last.end_tokens:
        end = PlanEnd(last.end_tokens, None, f"phase '{last.name}' end_tokens")
    else:
        steps, source = trainer.max_steps, "trainer.max_steps"
        if optim.total_steps and optim.total_steps > steps:
            steps, source = optim.total_steps, "optim.total_steps"
        if last is not None and last.end_step and last.end_step > steps:
            steps, source = last.end_step, f"phase '{last.name}' end_step"
        ramped = "".join(
            f", {d}" for d in (ramp.describe(), describe_seq_len_warmup(seq_len_warmup(data))) if d
        )
        end = PlanEnd(
            ramp.tokens_through(steps), steps, f"{source}={steps:,} x {per_step:,} tokens/step{ramped}"
        )
    return RunPlan(world, per_device, end, optim.total_steps or trainer.max_steps, ramp, tuple(phases))


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


def plan_findings(plan: RunPlan, n_params: int, cuda: bool, corpus: int | None = None) -> list[Finding]:
    """The doctor's tokens-per-parameter check: the plan's tokens per parameter against Chinchilla's ~20, and,
    with the corpus's training tokens known (`corpus`, prepared data), its epochs of that corpus and what the
    repeated tokens are worth (Muennighoff et al. 2023)."""
    end = plan.end
    ratio = end.tokens / n_params
    what = f"{end.tokens:,} tokens / {n_params:,} params = {ratio:.1f} tokens/param ({end.source}); Chinchilla ~20"
    epochs = end.tokens / corpus if corpus else 0.0
    if epochs > 1:
        worth = effective_tokens(end.tokens, corpus)
        what += f"; {epochs:.1f} epochs of the corpus's {corpus:,} tokens, worth ~{worth:,.0f} fresh ones"
    if cuda and epochs > USEFUL_EPOCHS:
        capped = plan.ramp.steps_for_tokens(int(WORTHWHILE_EPOCHS * corpus))
        return [
            Finding(
                "tokens/param",
                "warn",
                what,
                f"past ~{USEFUL_EPOCHS:g} epochs a repeated token is worth less and less (Muennighoff et al. 2023): "
                "a larger corpus buys a lower loss for the same money",
                f"trainer.max_steps={capped}" if epochs > WORTHWHILE_EPOCHS else "",
            )
        ]
    if cuda and ratio < CHINCHILLA_TOKENS_PER_PARAM / 2:
        return [
            Finding(
                "tokens/param",
                "warn",
                what,
                "a lower loss per $: train longer, or a smaller model for this compute (Hoffmann et al. 2022)",
                f"trainer.max_steps={plan.ramp.steps_for_tokens(chinchilla_tokens(n_params))}",
            )
        ]
    return [Finding("tokens/param", "ok", what)]
