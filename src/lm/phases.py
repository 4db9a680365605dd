"""Phases are data: a list of records and a pure lookup from training progress to the phase index."""

from __future__ import annotations

from collections.abc import Sequence

from lm.config import PhaseConfig


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
