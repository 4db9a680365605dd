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

The same object holds the run's other agreements, so the ranks agree through one mechanism, built once per
run (`lm.run.train`) and handed to every part that agrees:
- `agree`: a blocking round on each rank's problem (an exception or None) where the next act is collective
  and cannot wait a step: before and after a checkpoint write, and at train end before the final save;
- `gather` / `from_rank0`: a blocking round where every rank needs every rank's value (a milestone's CORE
  failure, the step each rank resumed at) or rank 0's decision (the stopper's at a validation, the activation
  checkpointing stride rank 0 measured);
- `reach_end`: the end of training, agreed where it is reached: after the final save and the end's optional
  work, the run's last collective. From there on no rank waits for another in a collective, so a rank that
  fails after it (a user callback at train end) waits for rank 0's exit work, which can still get there;
  a rank that fails before it leaves at once (the others' next collective then fails within seconds);
- `leave`: how every rank leaves, whatever launched it: rank 0 does its exit work first (the upload, an
  asynchronous save's finish, the ledger, the report), then the ranks tell each other their exit codes on a
  gloo group of their own (bounded by `exit_wait_s`), and every rank exits with one code (rank 0's, or the
  first other rank's that is not 0), rank 0 first where the others share its machine: Lightning's
  child-process observer SIGKILLs rank 0 within ~5 s of any rank exiting non-zero first, torchrun's agent
  SIGTERMs the other ranks once one exits non-zero.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lm.base.exits import EXIT_GRACE_S
from lm.callbacks.host_copy import HostCopy

log = logging.getLogger(__name__)

FLAGS = ("stop", "budget_over", "budget_near", "slow", "run_dir_lost", "save_failed", "run_file_failed")
"""The step boundary's decisions, in the order of the agreed tensor."""


class Consensus:
    """Agree on the named boolean flags across ranks, one optimizer step late and without a host sync."""

    def __init__(self, names: tuple[str, ...] = FLAGS, exit_wait_s: float = 900.0) -> None:
        self.names = names
        self._pending: _Round | None = None
        self.exit_wait_s = exit_wait_s
        """How long the other ranks wait for rank 0's exit work (`leave`): the upload's own bound and more."""
        self._exit_group: dist.ProcessGroup | None = None
        self.agreed_end = False
        """Every rank reached the end together (`reach_end`, or an exit every rank raised at once: `all_end_with`):
        `leave` waits for rank 0 only then; a rank that crashed alone must not wait for ranks stuck in a
        collective."""

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

    def agree(self, trainer: pl.Trainer, error: BaseException | None) -> None:
        """A blocking round: every rank calls this with its own problem (or None); if any rank has one, every
        rank raises (its own, else the lowest rank's), so no rank goes on alone into a collective the others
        left. One process: raise `error` if there is one."""
        errors = self.gather(trainer, error)
        first = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
        if first is not None and error is None:
            rank, error = first
            error.add_note(f"(raised on rank {rank}; this rank stops with it)")
        if error is not None:
            raise self.all_end_with(error)

    def gather(self, trainer: pl.Trainer, value: object) -> list:
        """A blocking round: every rank's `value` (picklable), in rank order, on every rank; one process:
        `[value]`. Every rank must call it at the same point."""
        if not self.distributed(trainer):
            return [value]
        values: list = [None] * trainer.world_size
        dist.all_gather_object(values, value)
        return values

    def from_rank0(self, trainer: pl.Trainer, value: object) -> object:
        """A blocking round: rank 0's `value` on every rank (the others' is ignored: pass None); one process:
        `value`. For a decision rank 0 takes alone so that every rank acts on the same one."""
        if not self.distributed(trainer):
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def reach_end(self, trainer: pl.Trainer) -> None:
        """Every rank, after the final save and the end's optional work: the run's last collective, agreed
        where it is reached. From here on every rank leaves with one code (`leave` waits for rank 0)."""
        self.settle()
        self.gather(trainer, None)
        self.agreed_end = True

    def all_end_with(self, error: BaseException) -> BaseException:
        """`error`, which every rank raises at once (an agreement's, a verdict every rank computed alike): their
        end is agreed, so every rank leaves with one code (`leave`). Returns `error`, to raise."""
        self.agreed_end = True
        return error

    # --- leaving ---------------------------------------------------------------------------------------

    def open_exit(self, trainer: pl.Trainer) -> None:
        """Every rank, at set-up: the gloo group `leave` talks on (its own, so its bound is not the training
        group's, and so it works beside NCCL)."""
        if self.distributed(trainer) and self._exit_group is None:
            timeout = datetime.timedelta(seconds=self.exit_wait_s)
            self._exit_group = dist.new_group(backend="gloo", timeout=timeout)

    def leave(self, code: int) -> int:
        """The code this process exits with, once rank 0's exit work is done: one code on every rank, rank 0's
        unless it is 0 and another rank's is not (a user callback's bug at train end on rank 1 is a crash).

        Call after everything a rank does on its way out (rank 0: the upload, the report). The ranks tell each
        other their codes (at most `exit_wait_s`), only when the end was agreed (`agreed_end`); a rank whose
        end was its own (a crash before the end was reached) leaves with its code at once."""
        group, self._exit_group = self._exit_group, None
        if group is None or not self.agreed_end or not dist.is_initialized():
            return code
        rank = dist.get_rank()
        told: list = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(told, (code, os.getpid(), socket.gethostname()), group=group)
        except Exception as e:  # a rank is gone, or took longer than the bound: leave with this rank's code
            log.error(
                "rank %d: the other ranks did not say how the run ends (%s); leaving with %d", rank, e, code
            )
            return code
        rank0_code, rank0_pid, host = told[0]
        final = rank0_code or next((c for c, _, _ in told if c), 0)
        if final != code:
            log.warning("rank %d: leaving with the run's code %d (this rank's was %d)", rank, final, code)
        log.info("rank %d leaves with %d", rank, final)
        if rank != 0 and host == socket.gethostname():
            # Rank 0 leaves first: a launcher that ends every rank once one exits non-zero (Lightning's observer
            # SIGKILLs, torchrun's agent SIGTERMs) then finds rank 0 gone and reports its code as the cause.
            # This rank's own SIGTERM is ignored meanwhile: it leaves with the same code in a moment anyway.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            wait_for_end(rank0_pid, EXIT_GRACE_S + 5.0)
        return final


def wait_for_end(pid: int, seconds: float) -> None:
    """Wait (at most `seconds`) until process `pid` of this host has ended (gone, or a zombie its parent has
    not reaped yet; as this process's parent, once this process is handed to another)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and running(pid):
        time.sleep(0.05)


def running(pid: int) -> bool:
    if os.getppid() == pid:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


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
