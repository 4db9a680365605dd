"""ResumeCheck: every rank of a job resumed the same step, with the global batch the checkpoint was made with."""

from __future__ import annotations

import logging

import lightning.pytorch as pl

log = logging.getLogger(__name__)


class ResumeCheck(pl.Callback):
    """At train start: every rank resumed the same step (else stop), and the global batch is the checkpoint's
    (else warn).

    Each rank finds its checkpoint in its own view of `run.root`; a folder that only rank 0's node sees lets
    the other nodes start fresh beside a resumed rank 0 (DDP would copy rank 0's weights but not its optimizer,
    step or data position, and the ranks would reach max_steps at different times and hang). The data stream
    position is step x global batch, so resuming with another global batch (8 GPUs -> 4 without doubling
    data.batch_size) re-reads or skips windows; the meter's tokens per step tell.
    """

    def __init__(self, meter=None) -> None:
        self.meter = meter

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1:
            rank0_step = trainer.strategy.broadcast(trainer.global_step, src=0)
            if trainer.strategy.reduce_boolean_decision(rank0_step != trainer.global_step, all=False):
                raise ValueError(
                    f"rank {trainer.global_rank} starts at step {trainer.global_step}, rank 0 at step "
                    f"{rank0_step} (or another rank disagrees): every node must see the same checkpoints. "
                    "Put run.root on storage that all nodes share"
                )
        m = self.meter
        if (
            m is not None
            and trainer.is_global_zero
            and m.state.step
            and m.state.tokens != m.state.step * m.tokens_per_step
        ):
            log.warning(
                "resuming at step %d with %d tokens a step, but %d tokens took %d steps so far (%.0f a step): "
                "the data stream position is step x global batch, so windows are re-read or skipped. Keep "
                "devices x nodes x data.batch_size x accumulation as before to continue the stream exactly",
                m.state.step, m.tokens_per_step, m.state.tokens, m.state.step, m.state.tokens / m.state.step,
            )  # fmt: skip
