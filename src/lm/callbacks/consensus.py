"""Consensus: how ranks agree on the step boundary's decisions (stop, save now, over budget, a lost run).

Some decisions must be taken by every rank at the same optimizer step, because what follows is collective (a
checkpoint save, the end of training): a stop signal may reach one rank only, each rank reads its own clock.
Lightning's `strategy.reduce_boolean_decision` agrees at once, but it all-reduces and then reads the result on
the host (`bool(tensor)`): on a GPU that waits for every kernel queued so far, at every optimizer step.

Here the agreement is pipelined by one step. At each step boundary `StepBoundary` hands every rank's votes to
`exchange`, which launches one non-blocking all-reduce (MAX) of a small int tensor holding them and returns the
previous step's agreement, staged to host memory behind an event (on CUDA: `HostCopy`, a pinned `non_blocking`
copy; on gloo the tensor lives on the host and the `Work` is waited on). Every rank acts at the same step, one
step after the first rank raised a flag, and the host only waits for a collective launched a step earlier. A
flag agreed now withdraws this rank's vote for it, so one event (a slow window, a budget crossing) is acted on
once. On one process there is nothing to agree with: the votes are the answer, at once.

Hangs are ruled out by construction: `exchange` is called at every optimizer step on every rank (the step
boundary calls it before acting on anything), the flags are a fixed tuple (the same layout everywhere), and
the round in flight is settled at the next step or at train end, which every rank reaches at the same step.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lm.callbacks.host_copy import HostCopy

FLAGS = ("stop", "budget_over", "budget_near", "slow", "run_dir_lost", "save_failed")
"""The step boundary's decisions, in the order of the agreed tensor."""


class Consensus:
    """Agree on the named boolean flags across ranks, one optimizer step late and without a host sync."""

    def __init__(self, names: tuple[str, ...] = FLAGS) -> None:
        self.names = names
        self._pending: _Round | None = None

    @staticmethod
    def distributed(trainer: pl.Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()

    def exchange(self, trainer: pl.Trainer, votes: dict[str, bool]) -> dict[str, bool]:
        """Cast this rank's votes for this step; returns the flags to act on now (every name of `names`).

        One process: the votes themselves. Several: whether any rank raised each flag at the previous
        optimizer step, the same answer on every rank; this step's round is launched before returning."""
        unknown = set(votes) - set(self.names)
        if unknown:
            raise KeyError(f"consensus flags {sorted(unknown)} are not among {self.names}")
        if not self.distributed(trainer):
            return {name: bool(votes.get(name, False)) for name in self.names}
        agreed = self.settle()
        cast = [int(bool(votes.get(name, False)) and not agreed[name]) for name in self.names]
        self._pending = _Round(cast, trainer.strategy.root_device)
        return agreed

    def settle(self) -> dict[str, bool]:
        """The round in flight's answer (all False when none is): waits only for that round."""
        pending, self._pending = self._pending, None
        values = pending.result() if pending is not None else [0] * len(self.names)
        return {name: bool(v) for name, v in zip(self.names, values)}

    def drop(self) -> None:
        """Forget the round in flight without waiting (another rank may be gone: never wait while failing)."""
        self._pending = None


class _Round:
    """One launched all-reduce (MAX) of the ranks' flags, staged to host memory without waiting for it."""

    def __init__(self, votes: list[int], device: torch.device) -> None:
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

    def result(self) -> list[int]:
        """The agreed flags; waits only for this round (launched a step ago), never for later work."""
        if self.staged is not None:
            return self.staged.value().tolist()
        self.work.wait()  # gloo: the reduced tensor is on the host once the work is done
        return self.tensor.tolist()
