"""The one answer to "did an optimizer step just end?", which every callback's `on_train_batch_end` asks
(`StepWatch.advance`: it remembers the step it answered for, so it is asked once per micro-batch).

Lightning calls `on_train_batch_end` after every micro-batch; under gradient accumulation most of them end no
optimizer step. `trainer.global_step` moves exactly when one ends, so a callback remembers the step it last saw.
"""

from __future__ import annotations

import lightning.pytorch as pl


class StepWatch:
    """Remembers the last optimizer step seen; `advance(trainer)` is True once per optimizer step."""

    def __init__(self) -> None:
        self.step: int | None = None

    def start(self, trainer: pl.Trainer) -> None:
        """At train start (or a resume): the current step has already ended."""
        self.step = trainer.global_step

    def advance(self, trainer: pl.Trainer) -> bool:
        """Move to the trainer's step; True if an optimizer step ended since the last call (a state change,
        not a question: call it once per `on_train_batch_end`)."""
        if trainer.global_step == self.step:
            return False  # a micro-batch inside gradient accumulation
        self.step = trainer.global_step
        return True
