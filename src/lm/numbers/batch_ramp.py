"""The batch-size ramp: rows per micro-batch of each optimizer step, and the tokens that steps add up to.

With `data.batch_ramp_steps` > 0 a run starts at `data.batch_ramp_start` x data.batch_size rows per micro-batch
and doubles in equal stages until the full batch at step `batch_ramp_steps` (start 0.25 over 100 steps:
B/4 for steps 0..49, B/2 for 50..99, B from 100 on). Few distinct shapes, so `torch.compile` recompiles a
bounded number of times; small batches early are where the gradient noise scale is small (McCandlish et al.
2018), so those steps cost fewer tokens for nearly the same progress.

Every reader of "tokens after n steps" (the cost meter, the plan's end, phases at a token count, the sampler's
stream position) goes through `BatchRamp`, so they agree; with the ramp off every number is exactly
steps x tokens per step, as before the ramp existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from lm.config import DataConfig


@dataclass(frozen=True)
class BatchRamp:
    """Rows per micro-batch of each optimizer step, and the tokens and stream samples the steps add up to."""

    batch_size: int
    """Full micro-batch rows per device (data.batch_size)."""
    seq_len: int = 1
    """Tokens per row."""
    accumulate: int = 1
    """Micro-batches per optimizer step."""
    world: int = 1
    """Processes of the job."""
    steps: int = 0
    """Optimizer steps the ramp lasts (data.batch_ramp_steps); 0: the full batch from the first step."""
    start: float = 0.25
    """The first stage's share of the full batch (data.batch_ramp_start)."""

    @cached_property
    def stages(self) -> tuple[tuple[int, int], ...]:
        """(first step, rows) of each stage, the full batch last. The ramp doubles from `start` up: start 0.25
        is two stages (B/4, B/2) before B; stages split `steps` evenly (the first ones one step shorter)."""
        full = ((0, self.batch_size),)
        if self.steps <= 0 or self.start >= 1:
            return full
        n = max(1, math.ceil(-math.log2(self.start) - 1e-9))  # doublings from start to the full batch
        fractions = [self.start * 2**i for i in range(n)]
        firsts = [self.steps * i // n for i in range(n)]
        ramp = tuple(
            (first, max(1, round(self.batch_size * f)))
            for first, f, end in zip(firsts, fractions, [*firsts[1:], self.steps])
            if end > first  # a ramp shorter than its stages leaves the empty ones out
        )
        return (*ramp, (self.steps, self.batch_size))

    @cached_property
    def _before(self) -> tuple[int, ...]:
        """Rows before each stage's first step."""
        out, rows = [0], 0
        for (first, b), (nxt, _) in zip(self.stages, self.stages[1:]):
            rows += (nxt - first) * b
            out.append(rows)
        return tuple(out)

    def _stage(self, step: int) -> int:
        return max(i for i, (first, _) in enumerate(self.stages) if first <= step)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one full-batch optimizer step over the whole job."""
        return self.batch_size * self.seq_len * self.accumulate * self.world

    def batch_at(self, step: int) -> int:
        """Rows of each micro-batch of optimizer step `step` on each device."""
        return self.stages[self._stage(step)][1]

    def samples_before(self, step: int) -> int:
        """Rows one micro-batch slot of one device took over steps 0..step-1 (closed form, O(stages))."""
        if step <= 0:
            return 0
        i = self._stage(step)
        first, b = self.stages[i]
        return self._before[i] + (step - first) * b

    def tokens_through(self, steps: int) -> int:
        """Tokens trained by the first `steps` optimizer steps over the whole job."""
        return self.samples_before(steps) * self.seq_len * self.accumulate * self.world

    def tokens_of(self, step: int) -> int:
        """Tokens of optimizer step `step` over the whole job."""
        return self.batch_at(step) * self.seq_len * self.accumulate * self.world

    def steps_for_tokens(self, tokens: int | float) -> int:
        """The fewest optimizer steps that train at least `tokens` tokens (the inverse of tokens_through)."""
        per_row = self.seq_len * self.accumulate * self.world
        rows = math.ceil(tokens / per_row) if tokens > 0 else 0
        for i in reversed(range(len(self.stages))):
            if rows > self._before[i] or i == 0:
                first, b = self.stages[i]
                return first + -(-(rows - self._before[i]) // b)
        raise AssertionError("unreachable: stage 0 always answers")

    def describe(self) -> str:
        """The ramp in words for the run's plan line ('' when off)."""
        if len(self.stages) == 1:
            return ""
        rows = " -> ".join(f"{b} from step {first:,}" for first, b in self.stages)
        return f"batch ramp: {rows} rows per micro-batch"


def ramp_of(data: DataConfig, accumulate: int = 1, world: int = 1) -> BatchRamp:
    """The ramp of a data config (`data.batch_size`, `seq_len`, `batch_ramp_steps`, `batch_ramp_start`)."""
    return BatchRamp(
        data.batch_size, data.seq_len, accumulate, world, data.batch_ramp_steps, data.batch_ramp_start
    )


def seq_len_warmup(data: DataConfig) -> tuple[tuple[int, int], ...]:
    """(first step, window length) of each stage of `data.seq_len_warmup_steps`, the full seq_len last: the
    batch ramp's doubling stages over the window length instead of the rows (start 0.25 over 100 steps:
    seq_len/4 for steps 0..49, seq_len/2 for 50..99). One stage when off. Each window of a stage is cut into
    seq_len/length pieces (`lm.engine.module.short_windows`), so every step trains the same tokens."""
    ramp = BatchRamp(data.seq_len, steps=data.seq_len_warmup_steps, start=data.seq_len_warmup_start)
    return ramp.stages


def window_len_at(stages: tuple[tuple[int, int], ...], step: int) -> int:
    """The training window length of optimizer step `step` under `seq_len_warmup`'s stages."""
    return max((first, length) for first, length in stages if first <= step)[1]


def describe_seq_len_warmup(stages: tuple[tuple[int, int], ...]) -> str:
    """The warm-up in words for the run's plan line ('' when off)."""
    if len(stages) == 1:
        return ""
    rows = " -> ".join(f"{t} from step {first:,}" for first, t in stages)
    return f"sequence-length warm-up: windows of {rows} tokens"
