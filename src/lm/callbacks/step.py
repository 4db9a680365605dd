"""StepBoundary: the training step's control, written once, in the order it happens.

Lightning runs the forward, backward and optimizer step; everything lm decides around them is here:

    each backward            the spike guard adds the micro-batch's loss to the step's
    before the optimizer     the previous step's verdicts are read (a rollback exits 75 here); this step's
                             non-finite and spike verdicts are handed to the optimizer (skip on the device)
    after the optimizer      1. count      tokens, time and dollars of the step (CostMeter)
    (`on_train_batch_end`,   2. observe    phase rows, milestone samples and benchmarks (they read the count)
    once per step)           3. vote       this rank: a stop signal, the budget, a slow host, the run
                                           directory lost, a background save or an upload failed, a run
                                           file not written (rank 0's writes keep their failure: deferred)
                             4. agree      the votes across ranks (Consensus: one step late, no host sync)
                             5. act        a lost run, a failed save or run file: exit 74 on every rank; the
                                           stopper's budget or cooldown: stop; a stop signal: save, exit 75;
                                           a slow host: save
                             6. save       the scheduled checkpoint (`checkpoint.every_n_steps`)
    after validation         the stopper's decision: the run stops (`AfterOthers`, after every callback)
    at train end             1. save       the last step, agreed, before anything optional (a background
                                           write finished): a failure after it costs extras, never training
                             2. observe    the last milestone's samples and benchmarks, the phase's partial
                                           row (a failure is recorded, training is saved)
                             3. end        the run's last collective, agreed where it is reached
                                           (`Consensus.reach_end`): from here every rank leaves with one
                                           code; then the other callbacks' train-end hooks (one's own)
    at a save                the RunState snapshot (after the meter starts charging checkpoint time and
                             the guards settle the step just taken)
    at a resume              RunState restored before any other part reads it

The guards, the stop signals, the throughput alarm and the consensus are plain objects this callback owns;
the design card's callbacks (PhaseTracker, MilestoneSampler, EarlyStopper) stay Lightning callbacks for their
own hooks (validation, train start and end) and are called here at the step boundary. A callback of one's own
(`cfg.callbacks`) is listed after this one: it sees each step counted, agreed and, on a save step, saved; what
it records then is in the next checkpoint (a callback's `state_dict` is saved by Lightning with every
checkpoint).
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl
import torch

from lm.base.exits import CheckpointSaveError, Diverged
from lm.callbacks.consensus import Consensus
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.nonfinite import NonFiniteGuard
from lm.callbacks.spike import SpikeGuard
from lm.callbacks.steps import StepWatch
from lm.callbacks.stop_signals import StopSignals
from lm.callbacks.stopper import EarlyStopper
from lm.callbacks.throughput_alarm import ThroughputAlarm
from lm.checkpoint.callback import RunCheckpoint
from lm.checkpoint.resume_check import ResumeCheck
from lm.checkpoint.run_state import RUN_STATE, from_checkpoint, rng_state, set_rng_state
from lm.store import atomic


class Observer(Protocol):
    """A callback that looks at each counted step (PhaseTracker, the milestone callbacks) and at the end, once
    the last step is saved."""

    def at_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None: ...

    def at_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None: ...


class StepBoundary(pl.Callback):
    """See the module docstring: the one place where a step is counted, judged, agreed on, stopped and saved,
    and the one owner of the run's RunState (`meter.run`), snapshotted at each save and restored at resume."""

    def __init__(
        self,
        *,
        meter: CostMeter,
        saver: RunCheckpoint,
        stopper: EarlyStopper,
        signals: StopSignals,
        alarm: ThroughputAlarm,
        nonfinite: NonFiniteGuard,
        spike: SpikeGuard,
        observers: tuple[Observer, ...] = (),
        consensus: Consensus,
    ) -> None:
        self.meter, self.saver, self.stopper = meter, saver, stopper
        self.signals, self.alarm = signals, alarm
        self.nonfinite, self.spike = nonfinite, spike
        self.observers = observers
        self.consensus = consensus
        self.run_dir = saver.dirpath.parent
        self.state = meter.run
        """The run's RunState, which every part of the step shares."""
        self.steps = StepWatch()

    # --- RunState: saved whole, restored first -------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Called as Lightning builds the checkpoint dict, i.e. when a save is staged: a background write
        # pickles this deep snapshot, never the live record.
        self.meter.switch("checkpoint")  # what follows is checkpoint time
        self.settle_guards()  # a checkpoint holds the guards' counts up to its own step
        settings = ResumeCheck.run_settings(trainer, pl_module)
        checkpoint[RUN_STATE] = self.state.snapshot(rng=rng_state(), settings=settings)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        restore(self.meter, checkpoint)
        self.spike.attach(trainer)  # the checkpoint's skipped data windows, and any rollback's since

    # --- set-up --------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.spike.attach(trainer)  # before the training loader is built: the sampler skips the windows
        if stage == "fit":
            self.consensus.open_exit(trainer)  # every rank, in the same order as any other group

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.signals.install()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        atomic.defer(self.run_dir)  # a run file's failed write is a vote, not an exit on one rank
        self.signals.install(trainer)
        self.steps.start(trainer)
        self.nonfinite.start(trainer)
        self.spike.start(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.alarm.interrupt()

    # --- the step, before its optimizer step -------------------------------------------------------------

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self.spike.add(trainer, loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # The previous step's verdicts, long computed by now (either may roll back: exit 75).
        self.settle_guards(log_metric=True)
        # This step's, on the device: the non-finite guard's `found_inf` first, the spike guard's joins it.
        self.nonfinite.judge(trainer, pl_module, optimizer)
        self.spike.judge(trainer, pl_module, optimizer)

    def settle_guards(self, log_metric: bool = False) -> None:
        """The guards' verdicts on the steps taken, read on the host; a rollback (75) or a repeated divergence
        (65) is raised on every rank at the same step (their verdicts come from all-reduced losses and
        gradients), and every rank then leaves with rank 0's code (its rollbacks.json decides 65 or 75)."""
        try:
            self.nonfinite.settle(log_metric=log_metric)
            self.spike.settle()
        except Diverged as e:
            self.consensus.all_end_with(e)
            raise

    # --- the step boundary ---------------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.steps.advance(trainer):
            return  # a micro-batch inside gradient accumulation
        # 1. count
        self.meter.count(trainer, pl_module)
        # 2. observe
        for observer in self.observers:
            observer.at_step(trainer, pl_module)
        # 3. vote
        lost, failure = self.saver.between_saves()
        unwritten = atomic.deferred(self.run_dir)  # rank 0's run files: the ledger, phases, samples, ...
        votes = {
            "stop": self.signals.requested(trainer),
            **self.stopper.votes(),
            "slow": self.alarm.vote(trainer, batch, self.saver.saved_step),
            "run_dir_lost": lost,
            "save_failed": failure is not None,
            "run_file_failed": unwritten is not None,
        }
        # 4. agree (every rank, every step: no rank is left in the collective)
        decided = self.consensus.exchange(trainer, votes)
        # 5. act
        self.fail(decided, failure, unwritten)
        self.stopper.at_step(trainer, decided)
        if self.stopper.stopping:  # its budget, or its cooldown's end
            trainer.should_stop = True
        if decided["stop"]:
            self.saver.save_now(trainer)
            try:
                self.signals.exit(trainer)  # exit 75, unless only the final validation and save are left
            except SystemExit as e:
                self.consensus.all_end_with(e)
                raise
        if decided["slow"]:
            self.alarm.alarm()
            self.saver.save_now(trainer)
        # 6. save
        self.saver.poll()  # a background write that finished becomes the newest checkpoint
        if self.saver.due(trainer):
            self.saver.save_now(trainer)

    def fail(
        self, decided: dict[str, bool], failure: BaseException | None, unwritten: OSError | None
    ) -> None:
        """Exit 74 on every rank at once on an agreed failure: the run directory lost, a background save or an
        upload failed, a run file not written (each rank raises its own error, else one naming rank 0)."""
        try:
            self.saver.fail_between_saves(decided["run_dir_lost"], decided["save_failed"], failure)
            if decided["run_file_failed"]:
                raise unwritten or CheckpointSaveError(
                    "a run file could not be written on rank 0 (its message names the file and the fix); "
                    "every rank stops with it. The checkpoints are intact; rerun the same command to resume"
                )
        except OSError as e:
            self.consensus.all_end_with(e)
            raise

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.settle_guards()
        self.consensus.settle()  # every rank ends at the same step, with the same rounds launched
        # 1. save: the last step, before any optional work (its agreement includes the run files written so far)
        self.final_save(trainer)
        # 2. observe: the last milestone, the phase's partial row (their failures are recorded, not raised)
        for observer in self.observers:
            observer.at_end(trainer, pl_module)
        # 3. end: the last collective of the run; one's own callbacks' train-end hooks come after it
        self.consensus.reach_end(trainer)

    # --- after every other callback (`AfterOthers`, last in the run's list) --------------------------------

    def stop_if_decided(self, trainer: pl.Trainer) -> None:
        """A stop the stopper decided in validation (or that a resumed run keeps): the run ends after this
        step (`trainer.should_stop`: Lightning validates once more, then the final save)."""
        if self.stopper.stopping:
            trainer.should_stop = True

    def final_save(self, trainer: pl.Trainer) -> None:
        """The last step of the invocation, saved before the end's optional work (the last milestone, the
        phase's partial row, one's own callbacks, the report), after one agreement that includes the run-file
        writes so far; a background write finished, or every rank stops with 74."""
        self.saver.save_now(trainer)
        self.saver.finish_or_fail(trainer)  # while every rank's process group is still up for the collectives

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.consensus.drop()  # another rank may be gone: never wait on a collective while failing
        self.signals.uninstall()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.signals.uninstall()


class AfterOthers(pl.Callback):
    """The step boundary's hooks that must run after every other callback's, listed last but the progress bar:
    the stop a validation decided (the stopper's hook comes first). What they decide is `StepBoundary`'s."""

    def __init__(self, boundary: StepBoundary) -> None:
        self.boundary = boundary

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.boundary.stop_if_decided(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.boundary.stop_if_decided(trainer)


def restore(meter: CostMeter, checkpoint: dict[str, Any]) -> None:
    """Put a checkpoint's RunState (or a legacy checkpoint's callback states) in place of the run's: the
    meter books this start-up as a restart's, the RNG continues where the checkpoint left it."""
    record = from_checkpoint(checkpoint)
    if record is None:
        return
    startup = meter.before_restore()
    meter.run.load(record)
    meter.restored(startup)
    if meter.run.rng is not None:
        set_rng_state(meter.run.rng)
