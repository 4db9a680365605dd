"""Stop signals: save at the next step boundary, exit 75, and let `lm supervise` (or any restarter) resume.

A spot reclaim sends SIGTERM with ~2 minutes' notice; a user or a monitor sends SIGUSR1. The handler only sets
a flag: saving inside a signal handler would interrupt the optimizer step (or a checkpoint write) half-way.
The step boundary (`lm.callbacks.step`) reads the flag at every optimizer step and agrees on it across ranks
(`Consensus`), so all ranks save the same step: the next boundary on one process, one step later under
DDP/FSDP (the agreement is pipelined so that no step waits on the device).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import lightning.pytorch as pl

from lm.base.exits import EXIT_PREEMPTED, Preempted
from lm.base.private_api import skip_sigterm_broadcast

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


def finishing(trainer: pl.Trainer) -> bool:
    """Whether the step that just ended is the run's last: max_steps reached, or a stopper already ended it."""
    max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else None
    return trainer.should_stop or (max_steps is not None and trainer.global_step >= max_steps)


class StopSignals:
    """SIGTERM/SIGUSR1 -> a checkpoint at the next step boundary -> exit `EXIT_PREEMPTED`.

    Replaces Lightning's SIGTERM handler while training, because that one runs a collective inside the
    handler, aborts validation mid-way and exits with code 0 (which a restarter reads as "finished"). The step
    boundary installs it, votes with `requested`, and on the agreed flag saves and calls `exit`.
    """

    def __init__(self, signals: list[str] | tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")) -> None:
        self.signals = [signal.Signals[name] if isinstance(name, str) else name for name in signals]
        self.received: signal.Signals | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            log.warning("received %s: saving a checkpoint at the next step boundary", self.received.name)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the person at the terminal will not wait for the save

    def install(self, trainer: pl.Trainer | None = None) -> None:
        """Take over the stop signals (Lightning's connector restores the originals at teardown).

        With `trainer` under torch.distributed, also stop Lightning's broadcast of rank 0's `received_sigterm`
        before every micro-batch (read with `.item()`: a host-device sync per micro-batch): with this handler
        in place Lightning's never sets that flag, and an earlier SIGTERM (which did) is agreed on here, so
        every rank (all install this) skips that collective."""
        global _shield_children
        _shield_children = True
        for sig in self.signals:
            signal.signal(sig, self._handler)
        if trainer is not None and trainer.world_size > 1:
            skip_sigterm_broadcast(trainer)

    @staticmethod
    def uninstall() -> None:
        global _shield_children
        _shield_children = False

    def requested(self, trainer: pl.Trainer) -> bool:
        """This rank's vote: a stop signal reached this process (here or through Lightning's handler)."""
        return self.received is not None or trainer.received_sigterm

    def exit(self, trainer: pl.Trainer) -> None:
        """After the agreed stop's save: exit 75 (restart me), unless only the last validation and the final
        save are left, which finish first (a resume would find max_steps reached and never measure them)."""
        if self.received is not None:
            name = self.received.name
        else:
            name = "SIGTERM" if trainer.received_sigterm else "a stop signal to another rank"
        if finishing(trainer):
            log.warning(
                "%s at the final step %d: saved; finishing the last validation, then exiting",
                name,
                trainer.global_step,
            )
            return
        log.warning(
            "%s: saved step %d; exiting with %d (restart me)", name, trainer.global_step, EXIT_PREEMPTED
        )
        raise Preempted(name)
