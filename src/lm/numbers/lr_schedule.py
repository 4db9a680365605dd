"""The learning-rate schedule as pure arithmetic: the multiplier of the peak LR at each optimizer step.

It lives at the foundation so that the loss forecast (lm.numbers.loss_law), which needs the LR of every step of a
plan, and the training module, which drives `LambdaLR` with it, compute it in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from lm.config import OptimConfig


def lr_lambda(
    optim: OptimConfig, total_steps: int, cooldown: Callable[[], tuple[int, int] | None] | None = None
):
    """Learning-rate multiplier as a function of the optimizer step (for `LambdaLR`).

    `cooldown` returns (start step, length) once an early stop has been decided (see callbacks/stopper.py):
    from `start` the multiplier falls linearly from its value there to the floor over `length` steps.
    """
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio
    decay_start = total_steps - int(optim.decay_fraction * total_steps)

    def multiplier(step: int) -> float:
        window = cooldown() if cooldown is not None else None
        if window is not None and step >= window[0]:
            start, length = window
            at_start = scheduled(start)
            progress = min(1.0, (step - start) / max(1, length))
            return min(scheduled(step), at_start - (at_start - floor) * progress)
        return scheduled(step)

    def scheduled(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        if optim.schedule == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        # wsd: flat until the last decay_fraction of the run, then linear down to the floor.
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - floor) * progress

    return multiplier


def multipliers(
    optim: OptimConfig, total_steps: int, steps: int | None = None, cooldown: tuple[int, int] | None = None
) -> np.ndarray:
    """The multiplier of steps 0..steps-1 (default: the whole plan) as an array; `cooldown` as in lr_lambda."""
    f = lr_lambda(optim, total_steps, (lambda: cooldown) if cooldown is not None else None)
    return np.array([f(k) for k in range(total_steps if steps is None else steps)], dtype=np.float64)
