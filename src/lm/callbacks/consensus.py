"""Consensus: the one place where ranks agree on a step-boundary decision (stop, save now, over budget).

Some decisions must be taken by every rank at the same optimizer step, because what follows is collective (a
checkpoint save, the end of training): a stop signal may reach one rank only, each rank reads its own clock.
Lightning's `strategy.reduce_boolean_decision` agrees at once, but it all-reduces and then reads the result on
the host (`bool(tensor)`): on a GPU that waits for every kernel queued so far, at every optimizer step.

Here the agreement is pipelined by one step. Callbacks cast their local flags during a step's
`on_train_batch_end` (`decide(trainer, name, flag)`); this callback, listed after them, then launches one
non-blocking all-reduce (MAX) of a small int tensor holding every flag, and stages its result to host memory
behind an event (on CUDA: `HostCopy`, a pinned `non_blocking` copy; on gloo the tensor already
lives on the host and the `Work` is waited on). The answer a callback gets at step N is the agreement of step
N-1's flags, so every rank acts at the same step, one step after the first rank raised the flag, and the host
only waits for a collective launched a whole step earlier. A True answer withdraws the vote just cast for the
same name, so one event (a slow window, a budget crossing) is acted on once.

On one process there is nothing to agree with: `decide` returns the local flag at once and nothing is
launched, so single-process runs behave exactly as before (a SIGTERM saves at the next step boundary).

Hangs are ruled out by construction: the collective is launched from this callback's own
`on_train_batch_end` at every optimizer step on every rank, whatever the other callbacks returned early on,
and the round in flight is settled at the next step (or at train end, which all ranks reach at the same
step). Flag names are registered at construction, in the same order on every rank (the same callbacks are
built everywhere), so the tensor layout agrees.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lm.callbacks.host_copy import HostCopy
from lm.callbacks.steps import StepWatch


class Consensus(pl.Callback):
    """Agree on named boolean flags across ranks, one optimizer step late and without a host sync."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._votes: dict[str, bool] = {}
        self._agreed: dict[str, bool] = {}
        self._pending: _Round | None = None
        self._settled_at: int | None = None  # the step whose answer `_agreed` holds
        self.steps = StepWatch()

    def register(self, name: str) -> None:
        """Declare a flag (at construction: every rank registers the same names in the same order)."""
        if name not in self.names:
            self.names.append(name)

    def attach(self, trainer: pl.Trainer) -> None:
        """Make sure this consensus runs as a callback (after the callbacks that vote, which it joins last)."""
        if self not in trainer.callbacks:
            trainer.callbacks.append(self)

    @staticmethod
    def distributed(trainer: pl.Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()

    def decide(self, trainer: pl.Trainer, name: str, flag: bool) -> bool:
        """Cast this rank's `flag` for this step; returns whether to act now.

        One process: `flag` itself. Several: whether any rank raised `name` at the previous optimizer step
        (the same answer on every rank). A True answer withdraws the vote just cast.
        """
        if not self.distributed(trainer):
            return bool(flag)
        if name not in self.names:
            raise KeyError(f"consensus flag {name!r} was not registered at construction")
        self._votes[name] = self._votes.get(name, False) or bool(flag)
        agreed = self.agreed(trainer, name)
        if agreed:
            self._votes[name] = False
        return agreed

    def agreed(self, trainer: pl.Trainer, name: str) -> bool:
        """The previous step's agreement on `name` (settling the round in flight first)."""
        self._settle(trainer.global_step)
        return self._agreed.get(name, False)

    def _settle(self, step: int | None) -> None:
        if self._settled_at == step and step is not None:
            return
        self._settled_at = step
        pending, self._pending = self._pending, None
        self._agreed = pending.result() if pending is not None else {}

    # --- Lightning hooks ---------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.steps.ended(trainer) or not self.distributed(trainer):
            return
        self._settle(trainer.global_step)  # answers nobody asked for this step are dropped, not carried
        votes = [int(self._votes.get(n, False)) for n in self.names]
        self._votes = {}
        self._pending = _Round(list(self.names), votes, trainer.strategy.root_device)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank ends training at the same step and launched the same rounds: waiting is safe.
        self._settle(None)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._pending = None  # another rank may be gone: never wait on a collective while failing


class _Round:
    """One launched all-reduce (MAX) of the ranks' flags, staged to host memory without waiting for it."""

    def __init__(self, names: list[str], votes: list[int], device: torch.device) -> None:
        self.names = names
        cuda = device.type == "cuda"
        host = torch.tensor(votes or [0], dtype=torch.int32)
        if cuda:
            host = host.pin_memory()
        self.tensor = host.to(device, non_blocking=cuda)
        self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, async_op=True)
        self.staged: HostCopy | None = None
        if cuda:
            self.work.wait()  # NCCL: orders the current stream after the collective; the host does not wait
            self.work = None
            self.staged = HostCopy(self.tensor)
        else:
            self.tensor.host_staging = True  # gloo reduces in host memory (tests/callbacks/test_sync.py)

    def result(self) -> dict[str, bool]:
        """The agreed flags; waits only for this round (launched a step ago), never for later work."""
        if self.staged is not None:
            values = self.staged.value().tolist()
        else:
            self.work.wait()  # gloo: the reduced tensor is on the host once the work is done
            values = self.tensor.tolist()
        return {name: bool(v) for name, v in zip(self.names, values)}
