"""Stop signals: save at the next step boundary, exit 75, and let `lm supervise` (or any restarter) resume.

A spot reclaim sends SIGTERM with ~2 minutes' notice; a user or a monitor sends SIGUSR1. The handler only sets
a flag: saving inside a signal handler would interrupt the optimizer step (or a checkpoint write) half-way.
The flag is read at every optimizer-step boundary and agreed across ranks, so all ranks save the same step.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lm.callbacks.steps import StepWatch
from lm.exits import EXIT_PREEMPTED, Preempted

log = logging.getLogger(__name__)

# DataLoader workers are forked from the trainer and would otherwise inherit its handlers (or die on a
# group-wide SIGTERM, taking the pending save with them). While a guard is active, forked children get a
# no-op handler instead: a Python handler (not SIG_IGN) so that a child which execs starts with defaults.
_shield_children = False


def _child_ignores_stop_signals() -> None:
    if _shield_children:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, _ignore)


def _ignore(signum: int, frame: Any) -> None:
    pass


os.register_at_fork(after_in_child=_child_ignores_stop_signals)


def rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from, as tensors and plain values (so checkpoints still load
    with `weights_only=True`)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class SpotGuard(pl.Callback):
    """SIGTERM/SIGUSR1 -> checkpoint at the next step boundary -> exit `EXIT_PREEMPTED`; carries the RNG state.

    Replaces Lightning's SIGTERM handler while training, because that one runs a collective inside the
    handler, aborts validation mid-way and exits with code 0 (which a restarter reads as "finished").
    """

    def __init__(self, signals: list[str] | tuple[str, ...] = ("SIGTERM", "SIGUSR1")) -> None:
        self.signals = [signal.Signals[name] if isinstance(name, str) else name for name in signals]
        self.received: signal.Signals | None = None
        self.steps = StepWatch()

    # -- signal handling -------------------------------------------------------------------------------

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            log.warning("received %s: saving a checkpoint at the next step boundary", self.received.name)

    def _install(self) -> None:
        global _shield_children
        _shield_children = True
        for sig in self.signals:
            signal.signal(sig, self._handler)  # Lightning's connector restores the originals at teardown

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()
        self.steps.start(trainer)

    def stop_requested(self, trainer: pl.Trainer) -> bool:
        """Whether any rank received a stop signal (an all-reduce MAX; no collective on one process)."""
        local = self.received is not None or trainer.received_sigterm
        return trainer.strategy.reduce_boolean_decision(local, all=False)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.steps.ended(trainer):
            return
        if not self.stop_requested(trainer):
            return
        name = self.received.name if self.received else "SIGTERM"
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and hasattr(ckpt, "save_now"):
            ckpt.save_now(trainer)
        log.warning(
            "%s: saved step %d; exiting with %d (restart me)", name, trainer.global_step, EXIT_PREEMPTED
        )
        raise Preempted(name)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        global _shield_children
        _shield_children = False

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        global _shield_children
        _shield_children = False

    # -- state carried in the checkpoint ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "rng" in state_dict:
            set_rng_state(state_dict["rng"])
