"""main(cfg): one run, from its config to the run directory it leaves behind.

config -> runtime (device, precision, price) -> run directory -> doctor -> the Checkpointer's resume point
       -> data + (lm.run.build) module + callbacks + Trainer -> fit -> report
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from lm.base.exits import CheckpointSaveError, Preempted, RunDirRemoved, exit_within, intended_code
from lm.base.private_api import shutdown_data_workers
from lm.callbacks.consensus import Consensus
from lm.callbacks.milestones import record_failure
from lm.checkpoint.checkpointer import Checkpointer
from lm.checkpoint.remote import run_identity
from lm.checkpoint.run_state import RunState
from lm.config import LMConfig, conf_dir, to_objects
from lm.data import data_module
from lm.engine import activation_checkpointing, runtime
from lm.engine.kernels import sdpa_backends
from lm.engine.module import LMModule
from lm.engine.parallel import check_strategy
from lm.engine.runtime import resolve_runtime
from lm.numbers import cost, run_plan
from lm.run import build
from lm.run.doctor import Target, preflight
from lm.run.report import write_report
from lm.store import atomic, rundir
from lm.store.atomic import removed_message
from lm.store.lock import RunLock
from lm.store.tensorboard_layout import write_layout

log = logging.getLogger(__name__)


def main(dcfg: DictConfig) -> float | None:
    """Train one run as configured; returns the last validation loss (the objective for Hydra sweepers).

    However the run ends, its DataLoader workers are stopped and its lock released before this returns, and the
    process is bounded to exit within `EXIT_GRACE_S` with the code the outcome maps to. Under several ranks,
    an end they agreed on (training over, a stop, a failure every rank raised together) leaves with rank 0's
    code once rank 0's exit work is done (`Consensus.leave`): the upload of the stop's checkpoint, the report.
    """
    error: BaseException | None = None
    consensus = Consensus(exit_wait_s=exit_wait_s(dcfg))
    try:
        with contextlib.ExitStack() as on_exit:
            result = run_training(dcfg, on_exit, consensus)
    except BaseException as e:
        error = e
    code = consensus.leave(intended_code(error))
    # A sweep's exit code is decided after its last job: a sweep that hangs on the way out is a crash.
    exit_within(1 if rundir.in_multirun() else code)
    if code != intended_code(error):
        raise SystemExit(code) from error  # rank 0's code, which this rank was told
    if error is not None:
        raise error
    return result


def exit_wait_s(dcfg: DictConfig) -> float:
    """How long the other ranks wait for rank 0's exit work: its upload's bound, and minutes for the rest."""
    upload = dcfg.checkpoint.get("upload_timeout_s", None)
    return (3600.0 if upload is None else float(upload)) + 300.0


def run_training(dcfg: DictConfig, on_exit: contextlib.ExitStack, consensus: Consensus) -> float | None:
    """The run itself; `on_exit` takes what must be undone however it ends (the lock, the data workers);
    `consensus`: how its ranks agree."""
    started_at = time.monotonic()
    runtime.quiet_lightning()  # before the doctor's table: every record printed once
    cfg = to_objects(dcfg)
    rt, plan, run_dir = check_run(cfg)
    datamodule = data_module(cfg.data, plan.end.tokens, cfg.phases.phases)
    datamodule.check_prepared()  # prepared data that is corrupt is refused before the run directory changes
    # The bucket is probed and claimed (another run's folder refused) before the run directory changes.
    identity = run_identity(cfg.run, cfg.model, cfg.data)
    checkpointer = Checkpointer.open(cfg.checkpoint, cfg.run, run_dir, identity)
    ckpt_path = open_run(cfg, dcfg, checkpointer, on_exit)
    runtime.set_matmul_precision(cfg.precision.tf32)
    ac, decide = build.checkpointing_decision(cfg, rt)
    log_runtime(cfg, rt, ac, run_dir)
    run_state = RunState()  # all a resume needs beyond weights and optimizer (owned by StepBoundary)
    module = build.build_module(
        cfg,
        rt,
        ac,
        init_from=ckpt_path is None,
        run_state=run_state,
        decide=decide,
        from_rank0=consensus.from_rank0,
    )
    meter = build.cost_meter(cfg, rt, plan, module, run_dir, started_at, ac, run_state)
    callbacks = build.build_callbacks(
        cfg,
        plan,
        meter,
        run_dir,
        module,
        resumed=ckpt_path is not None,
        checkpointer=checkpointer,
        consensus=consensus,
    )
    trainer = build.build_trainer(cfg, run_dir, rt.precision, callbacks, checkpointer=checkpointer)
    if isinstance(trainer.logger, TensorBoardLogger):  # the Custom Scalars tab opens on the loss
        write_layout(trainer.logger, priced=bool(rt.price), mixture=bool(cfg.data.mixture))
    on_exit.callback(stop_data_workers, trainer)
    on_exit.callback(atomic.undefer, run_dir)  # deferred by the step boundary while it trains
    fit(trainer, module, datamodule, ckpt_path)
    return finish(trainer, run_dir, checkpointer)


def check_run(cfg: LMConfig) -> tuple[runtime.Runtime, run_plan.RunPlan, Path]:
    """The runtime, plan and run directory, after the checks that need neither data nor model."""
    rt = resolve_runtime(cfg)  # refuses an impossible precision or Liger without CUDA before any I/O
    check_strategy(cfg.trainer.strategy, cfg.trainer.devices, rundir.in_multirun())
    plan = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, cfg.phases.phases)  # read by all below
    run_dir = rundir.run_directory(cfg.run.root, cfg.run.name)
    if cfg.doctor.enabled:  # before data preparation and the model; every rank, so all refuse together
        catalog = cost.load_catalog(conf_dir())
        preflight(Target(cfg, rt.gpu, rt.cuda, rt.precision, run_dir, catalog, plan))
    return rt, plan, run_dir


def fit(
    trainer: pl.Trainer, module: LMModule, datamodule: pl.LightningDataModule, ckpt_path: Path | None
) -> None:
    """Train, from `ckpt_path` when resuming; a SIGTERM Lightning caught itself is a preemption."""
    try:
        # weights_only: a resume reads the checkpoint as data (lm.checkpoint.files), FSDP2's meta.pt too
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException as e:  # Lightning's own handler fired before StopSignals' was installed
        raise Preempted("SIGTERM") from e


def finish(trainer: pl.Trainer, run_dir: Path, checkpointer: Checkpointer) -> float | None:
    """Rank 0 writes the report and checks the mirror; every rank returns the last validation loss.

    A report that fails is recorded (the log, failures.jsonl, TensorBoard's text tab) and the run still ends 0:
    its training is saved. A run file rank 0 could not write after the final save (the ledger at teardown) is its exit code (74),
    which `Consensus.leave` then gives every rank."""
    if (unwritten := atomic.undefer(run_dir)) is not None:
        raise unwritten
    if trainer.is_global_zero:
        behind = checkpointer.mirror_behind()  # after the last upload
        try:
            finish_report(trainer, run_dir)
        except Exception as e:  # the report is optional work: the run is trained and saved, so it ends 0
            record_failure(trainer, run_dir, "the report", e)
        if behind:
            raise CheckpointSaveError(behind)  # exit 74: the run's mirror is not what a new machine needs
    val_loss = trainer.callback_metrics.get("val/loss")
    return float(val_loss) if val_loss is not None else None


def open_run(
    cfg: LMConfig, dcfg: DictConfig, checkpointer: Checkpointer, on_exit: contextlib.ExitStack
) -> Path | None:
    """Take the run directory and say where the run resumes from (None: a fresh start).

    The refusals before this leave the run directory as it was; the lock comes before anything in it
    changes (a fetched or set-aside checkpoint, an archived run, config.yaml), and another architecture or
    optimizer is refused before the run directory is written.
    """
    run_dir = checkpointer.run_dir
    if rank_zero_only.rank == 0:
        lock = RunLock(run_dir).acquire()
        on_exit.callback(lock.release)
        on_exit.push(functools.partial(explain_removal, lock))  # before the release: it reads the lock
        atomic.remove_orphaned_temporaries(run_dir, skip=("archive", rundir.CHECKPOINTS))
    ckpt_path = None
    if cfg.run.resume:
        ckpt_path = checkpointer.resume_point()
    else:
        checkpointer.archive_run()
    checkpointer.check_resumable(ckpt_path, cfg.model, cfg.optim.name, cfg.data)
    if cfg.model.init_from is not None and ckpt_path is None:  # a resume continues from its checkpoint
        from lm.interop import hf  # an optional feature: loaded when configured

        hf.check_init_from(cfg.model)
    if rank_zero_only.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_config(run_dir, dcfg)
        if checkpointer.remote is not None:
            rundir.write_run_id(run_dir, checkpointer.remote.run_id)
    return ckpt_path


def explain_removal(lock: RunLock, kind, error: BaseException | None, tb) -> None:
    """A run whose directory was removed under it fails at its next write somewhere (TensorBoard's event file,
    a ledger), with an error that points elsewhere; say what happened instead (exit 74). A stop signal's or
    a rollback's exit (SystemExit) keeps its own code."""
    if isinstance(error, Exception) and lock.removed():
        raise RunDirRemoved(removed_message(lock.path.parent)) from error


def stop_data_workers(trainer: pl.Trainer) -> None:
    """Shut every loop's DataLoader workers down now (a no-op once Lightning's teardown did).

    Lightning's teardown is skipped when an error is raised while it handles another; the workers ignore
    SIGTERM (`lm.data.datamodule.ignore_stop_signals`), so multiprocessing's exit handler would wait for them
    for ever.
    """
    shutdown_data_workers(trainer)


def log_runtime(
    cfg: LMConfig, rt: runtime.Runtime, ac: activation_checkpointing.Decision, run_dir: Path
) -> None:
    log.info(
        "run %s on %s (catalog: %s): precision %s, tf32 %s, compile %s, liger %s, activation checkpointing %s "
        "(%s)%s",
        run_dir,
        rt.device_name,
        rt.gpu.name,
        rt.precision_label,
        cfg.precision.tf32,
        rt.compile,
        cfg.kernels.liger,
        ac.label,
        ac.reason,
        f", SDPA backends {sdpa_backends()}" if rt.cuda else "",
    )


def finish_report(trainer: pl.Trainer, run_dir: Path) -> None:
    """report.md and its plots, also in TensorBoard's text tab (rank 0)."""
    report = write_report(run_dir)
    log.info("report: %s", report)
    experiment = getattr(trainer.logger, "experiment", None)
    if hasattr(experiment, "add_text"):
        experiment.add_text("report", report.read_text(), global_step=trainer.global_step)
        experiment.flush()
