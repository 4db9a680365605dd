"""The order a run's callbacks run in, as data: each class says its `priority`, the run sorts once.

Lightning calls callbacks' hooks in list order, and ours depend on it (the cost meter counts a step before
the others read it; the consensus launches after every vote). A `priority` class attribute (OLMo-core's
convention: higher runs earlier) keeps that order beside the reason for it instead of in list positions.
A callback without one (a `cfg.callbacks` node: LearningRateMonitor, one's own) gets `DEFAULT_PRIORITY`:
after all of lm's step callbacks, before the checkpoint callback and the progress bar. Set `priority` on a
callback class of one's own to place it elsewhere; equal priorities keep the order they were listed in.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl

DEFAULT_PRIORITY = 0
"""Where a callback without a `priority` attribute runs (lm's are above it, checkpointing and the bar below)."""


def priority(callback: pl.Callback) -> int:
    """The callback's `priority`, or `DEFAULT_PRIORITY` for one that does not say."""
    return getattr(callback, "priority", DEFAULT_PRIORITY)


def by_priority(callbacks: Iterable[pl.Callback]) -> list[pl.Callback]:
    """Highest priority first; a stable sort, so equal priorities keep their listed order."""
    return sorted(callbacks, key=lambda c: -priority(c))
