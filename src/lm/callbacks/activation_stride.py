"""ActivationCheckpointingStride: `activation_checkpointing=auto` decided once, by rank 0, for every rank.

`auto` measures trial steps against the free memory of a GPU. Decided in each process before the Trainer
exists (there is no process group yet), ranks whose GPUs had different free memory (another process on one,
a fragmented allocator) could pick different strides: different recomputation per rank, and under FSDP
different collectives in the backward. This callback decides in `setup`, which Lightning calls once the
strategy has set up the process group and before `configure_model` (sharding, compilation) and before the
model reaches the device: rank 0 runs `decide` (its probe on its GPU), `strategy.broadcast` hands its
decision to the others, and every rank sets it on the model. The run's log line, the meter's `about` (the
cost ledger's `run`) and TensorBoard's hparams get the stride the run actually trains with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning.pytorch as pl

from lm.callbacks.cost_meter import CostMeter
from lm.engine.activation_checkpointing import Decision

log = logging.getLogger(__name__)


class ActivationCheckpointingStride(pl.Callback):
    """Rank 0 runs `decide()` (the probe: `lm.engine.activation_checkpointing.decide` in a run, a stand-in in
    tests) at setup; every rank trains with its decision. `meter`: the CostMeter whose `about` records it
    (found among the trainer's callbacks when not given); `log_hparams`: also log `about` to the loggers."""

    def __init__(
        self,
        decide: Callable[[], Decision],
        meter: CostMeter | None = None,
        log_hparams: bool = False,
    ) -> None:
        self.decide = decide
        self.meter = meter
        self.log_hparams = log_hparams
        self.decision: Decision | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.decision is not None:
            return
        decision = self.decide() if trainer.is_global_zero else None
        decision = trainer.strategy.broadcast(decision, src=0)  # rank 0 decides, the others follow
        self.decision = decision
        pl_module.model.ac_every = decision.every
        log.info(
            "activation checkpointing %s (%s)%s",
            decision.label,
            decision.reason,
            f", decided by rank 0 for all {trainer.world_size} ranks" if trainer.world_size > 1 else "",
        )
        meter = self.meter or next((c for c in trainer.callbacks if isinstance(c, CostMeter)), None)
        if meter is not None:
            meter.about["activation_checkpointing"] = decision.every
            if self.log_hparams:
                for logger in trainer.loggers:
                    logger.log_hyperparams(meter.about)
