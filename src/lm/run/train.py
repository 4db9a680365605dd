"""main(cfg): compose the objects of one run, train, and leave the run directory behind.

config -> runtime (device, precision, price) -> run directory -> doctor -> resume point
       -> data + model + callbacks + Trainer -> fit -> report
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import hydra
import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from lm.base.exits import CheckpointSaveError, Preempted, RunDirRemoved, exit_within, intended_code
from lm.callbacks.activation_stride import ActivationCheckpointingStride
from lm.callbacks.consensus import Consensus
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestone_evals import BenchmarkEvaluator
from lm.callbacks.milestone_samples import MilestoneSampler
from lm.callbacks.nonfinite import NonFiniteGuard
from lm.callbacks.order import by_priority
from lm.callbacks.phase_tracker import PhaseTracker
from lm.callbacks.progress import LossProgressBar
from lm.callbacks.resume_check import ResumeCheck, check_resumable
from lm.callbacks.run_tokenizer import KeepTokenizer
from lm.callbacks.spike import SpikeGuard
from lm.callbacks.spot import SpotGuard
from lm.callbacks.stopper import (
    EarlyStopper as DiminishingReturnsStopper,  # old name until the one builder lands
)
from lm.callbacks.throughput_alarm import ThroughputAlarm
from lm.checkpoint.callback import RunCheckpoint
from lm.checkpoint.local import AtomicCheckpointIO, remote_behind, remote_checkpoints, resume_checkpoint
from lm.checkpoint.remote import RemoteCheckpoints, run_identity
from lm.config import LMConfig, conf_dir, to_objects
from lm.data import data_module
from lm.engine import activation_checkpointing, runtime
from lm.engine.kernels import sdpa_backends
from lm.engine.module import LMModule
from lm.engine.parallel import build_strategy, check_strategy, cluster_plugins
from lm.engine.runtime import resolve_runtime
from lm.interop import hf
from lm.numbers import cost, run_plan
from lm.numbers.memory import Workload
from lm.run.doctor import Target, preflight
from lm.run.report import write_report
from lm.store import atomic, rundir
from lm.store.lock import RunLock

log = logging.getLogger(__name__)


def main(dcfg: DictConfig) -> float | None:
    """Train one run as configured; returns the last validation loss (the objective for Hydra sweepers).

    However the run ends, its DataLoader workers are stopped and its lock released before this returns, and the
    process is bounded to exit within `EXIT_GRACE_S` with the code the outcome maps to.
    """
    error: BaseException | None = None
    try:
        with contextlib.ExitStack() as on_exit:
            return train(dcfg, on_exit)
    except BaseException as e:
        error = e
        raise
    finally:
        # A sweep's exit code is decided after its last job: a sweep that hangs on the way out is a crash.
        exit_within(1 if rundir.in_multirun() else intended_code(error))


def train(dcfg: DictConfig, on_exit: contextlib.ExitStack) -> float | None:
    """The run itself; `on_exit` takes what must be undone however it ends (the lock, the data workers)."""
    started_at = time.monotonic()
    cfg = to_objects(dcfg)
    rt, plan, run_dir = check_run(cfg)
    datamodule = data_module(cfg.data, plan.end.tokens, cfg.phases.phases)
    datamodule.check_prepared()  # prepared data that is corrupt is refused before the run directory changes
    # The bucket is probed and claimed (another run's folder refused) before the run directory changes.
    remote = remote_checkpoints(cfg.checkpoint, run_identity(cfg.run, cfg.model, cfg.data), cfg.run, run_dir)
    ckpt_path = open_run(cfg, dcfg, run_dir, remote, on_exit)
    runtime.set_matmul_precision(cfg.precision.tf32)
    ac, decide = checkpointing_decision(cfg, rt)
    log_runtime(cfg, rt, ac, run_dir)
    module = build_module(cfg, rt, ac, resumed=ckpt_path is not None)
    meter = cost_meter(cfg, rt, plan, module, run_dir, started_at, ac)
    callbacks = run_callbacks(
        cfg, plan, meter, run_dir, module, resumed=ckpt_path is not None, remote=remote, decide=decide
    )
    trainer = build_trainer(cfg, run_dir, rt.precision, callbacks)
    on_exit.callback(stop_data_workers, trainer)
    if decide is None:  # a deferred decision logs the hparams once it is made
        for logger in trainer.loggers:
            logger.log_hyperparams(meter.about)
    fit(trainer, module, datamodule, ckpt_path)
    return finish(trainer, run_dir, remote)


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


def checkpointing_decision(
    cfg: LMConfig, rt: runtime.Runtime
) -> tuple[activation_checkpointing.Decision, Callable[[], activation_checkpointing.Decision] | None]:
    """The activation checkpointing stride, and the function that decides it at setup when it is deferred.

    `auto` on a GPU is measured by rank 0 once the processes are up (ActivationCheckpointingStride), so that
    every rank trains with one stride; anything else (a configured stride, `auto` on a CPU) is known now.
    """
    workload = Workload(cfg.model, cfg.data.batch_size, cfg.data.seq_len, rt.precision, rt.cuda)
    decide = functools.partial(
        activation_checkpointing.decide, cfg.activation_checkpointing, workload, cfg.kernels.liger
    )
    if cfg.activation_checkpointing.auto and rt.cuda:
        return activation_checkpointing.Decision(0, "measured by rank 0 at setup", pending=True), decide
    return decide(), None


def build_module(
    cfg: LMConfig, rt: runtime.Runtime, ac: activation_checkpointing.Decision, *, resumed: bool
) -> LMModule:
    """The seeded LightningModule, its weights from `model.init_from` on a fresh start."""
    pl.seed_everything(cfg.run.seed, workers=True)
    module = LMModule(
        cfg.model,
        cfg.optim,
        ac_every=ac.every,
        compile=rt.compile,
        compile_mode=cfg.kernels.compile_mode,
        liger=cfg.kernels.liger,
        fp8=rt.fp8,
        fp8_emulate=cfg.precision.fp8_emulate,
    )
    if cfg.model.init_from is not None and not resumed:  # a resume continues from its checkpoint
        hf.load_init_from(module.model)
    return module


def fit(
    trainer: pl.Trainer, module: LMModule, datamodule: pl.LightningDataModule, ckpt_path: Path | None
) -> None:
    """Train, from `ckpt_path` when resuming; a SIGTERM Lightning caught itself is a preemption."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException as e:  # Lightning's own handler fired before SpotGuard's was installed
        raise Preempted("SIGTERM") from e


def finish(trainer: pl.Trainer, run_dir: Path, remote: RemoteCheckpoints | None) -> float | None:
    """Rank 0 writes the report and checks the mirror; every rank returns the last validation loss."""
    if trainer.is_global_zero:
        behind = remote_behind(remote, run_dir) if remote is not None else None  # after the last upload
        finish_report(trainer, run_dir)
        if behind:
            raise CheckpointSaveError(behind)  # exit 74: the run's mirror is not what a new machine needs
    val_loss = trainer.callback_metrics.get("val/loss")
    return float(val_loss) if val_loss is not None else None


def open_run(
    cfg: LMConfig,
    dcfg: DictConfig,
    run_dir: Path,
    remote: RemoteCheckpoints | None,
    on_exit: contextlib.ExitStack,
) -> Path | None:
    """Take the run directory and say where the run resumes from (None: a fresh start).

    The refusals before this leave the run directory as it was; the lock comes before anything in it
    changes (a fetched or set-aside checkpoint, an archived run, config.yaml), and another architecture or
    optimizer is refused before the run directory is written.
    """
    if rank_zero_only.rank == 0:
        lock = RunLock(run_dir).acquire()
        on_exit.callback(lock.release)
        on_exit.push(functools.partial(explain_removal, lock))  # before the release: it reads the lock
        atomic.remove_stale_temporaries(run_dir, skip=("archive", rundir.CHECKPOINTS))
    ckpt_path = resume_checkpoint(run_dir, cfg.run.resume, remote)
    check_resumable(ckpt_path, cfg.model, cfg.optim.name, cfg.data)
    if cfg.model.init_from is not None and ckpt_path is None:  # a resume continues from its checkpoint
        hf.check_init_from(cfg.model)
    if rank_zero_only.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_config(run_dir, dcfg)
        if remote is not None:
            rundir.write_run_id(run_dir, remote.run_id)
    return ckpt_path


def explain_removal(lock: RunLock, kind, error: BaseException | None, tb) -> None:
    """A run whose directory was removed under it fails at its next write somewhere (TensorBoard's event file,
    a ledger), with an error that points elsewhere; say what happened instead (exit 74). A stop signal's or
    a rollback's exit (SystemExit) keeps its own code."""
    if isinstance(error, Exception) and lock.removed():
        raise RunDirRemoved(
            f"the run directory {lock.path.parent} was removed while the run was training; nothing to save to "
            f"(its checkpoints and logs went with it, and this process stops rather than write a partial "
            f"copy). Restore the folder to resume, or start over with run.resume=false or another run.name",
        ) from error


def stop_data_workers(trainer: pl.Trainer) -> None:
    """Shut every loop's DataLoader workers down now (a no-op once Lightning's teardown did).

    Lightning's teardown is skipped when an error is raised while it handles another; the workers ignore
    SIGTERM (`lm.data.datamodule.ignore_stop_signals`), so multiprocessing's exit handler would wait for them
    for ever.
    """
    for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop):
        if loop._combined_loader is not None:
            for loader in loop._combined_loader.flattened:
                _shutdown_workers_and_reset_iterator(loader)


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


def cost_meter(
    cfg: LMConfig,
    rt: runtime.Runtime,
    plan: run_plan.RunPlan,
    module: LMModule,
    run_dir: Path,
    started_at: float,
    ac: activation_checkpointing.Decision,
) -> CostMeter:
    """The meter, with the FLOPs per token and peak that MFU is measured against (both logged once)."""
    n_params = module.model.num_parameters()
    fpt = cost.flops_per_token(
        cfg.model, cfg.data.seq_len, module.model.num_parameters(exclude_embedding=True)
    )
    peak = cost.peak_flops(rt.gpu, rt.precision, cfg.precision.tf32, fp8=rt.fp8 is not None)
    log.info(
        "%s parameters; MFU = tokens/s x %.3g FLOPs/token [%s] / %s; $%s/h per device (%s, %s)",
        f"{n_params:,}",
        fpt,
        cost.FLOPS_FORMULA,
        f"{peak / 1e12:g} TFLOP/s peak" if peak else "no catalogued peak: MFU not reported",
        rt.price,
        cfg.cost.pricing if cfg.cost.price_per_hour is None else "cost.price_per_hour",
        rt.gpu.price_source or "no source",
    )
    return CostMeter(
        tokens_per_device_step=plan.tokens_per_device_step,
        flops_per_token=fpt,
        peak_flops=peak,
        price_per_hour=rt.price,
        log_every=cfg.trainer.log_every_n_steps,
        run_dir=run_dir,
        started_at=started_at,
        about=run_hparams(cfg, rt, plan, n_params, ac),
        ramp=replace(plan.ramp, world=1),  # the meter sets the world it finds at setup
    )


def run_callbacks(
    cfg: LMConfig,
    plan: run_plan.RunPlan,
    meter: CostMeter,
    run_dir: Path,
    module: LMModule,
    *,
    resumed: bool,
    remote: RemoteCheckpoints | None = None,
    decide: Callable[[], activation_checkpointing.Decision] | None = None,
) -> list[pl.Callback]:
    """Every callback of the run, lm's and `cfg.callbacks`, in the order their hooks must run: sorted once by
    each class's `priority` (lm.callbacks.order), where the reason for its place is written.

    `decide`: `activation_checkpointing=auto` on a GPU, measured by rank 0 at setup (None: decided already).
    """
    consensus = Consensus()
    callbacks: list[pl.Callback] = [ResumeCheck(meter), meter]
    if cfg.phases.phases:
        callbacks.append(PhaseTracker(cfg.phases.phases, meter, run_dir, cfg.trainer.limit_val_batches))
    if cfg.sampling.prompts:
        callbacks.append(MilestoneSampler(cfg.sampling, cfg.phases.phases, meter, run_dir))
    if cfg.evals.tasks:
        callbacks.append(BenchmarkEvaluator(cfg.evals, cfg.phases.phases, meter, run_dir))
    callbacks.append(stopper(cfg, plan, meter, run_dir, module.model.num_parameters(), consensus))
    s = cfg.spot
    callbacks += [
        SpotGuard(s.signals, consensus),
        ThroughputAlarm(s.slow_ratio, s.slow_window_s, s.baseline_steps, s.baseline_warmup, consensus),
        NonFiniteGuard(s.max_nonfinite, run_dir / rundir.CHECKPOINTS),
        SpikeGuard(s.spike_factor, s.spike_window, s.max_spikes, run_dir / rundir.CHECKPOINTS),
        consensus,
        KeepTokenizer(run_dir, resumed=resumed),  # what sample/export/eval read
    ]
    if decide is not None:  # it logs the hparams once it has decided
        callbacks.append(ActivationCheckpointingStride(decide, meter, log_hparams=True))
    callbacks += [hydra.utils.instantiate(node) for node in cfg.callbacks.values()]
    callbacks.append(RunCheckpoint(run_dir / rundir.CHECKPOINTS, cfg.checkpoint, remote))
    if cfg.trainer.enable_progress_bar:
        callbacks.append(LossProgressBar())
    return by_priority(callbacks)


def stopper(
    cfg: LMConfig,
    plan: run_plan.RunPlan,
    meter: CostMeter,
    run_dir: Path,
    n_params: int,
    consensus: Consensus | None = None,
) -> DiminishingReturnsStopper:
    """The early stopper, with the plan's end for the forecast (in tokens, or in steps that the meter turns
    into tokens once it knows the world size)."""
    end = plan.end
    return DiminishingReturnsStopper(
        cfg.early_stopping,
        meter,
        run_dir,
        flat_lr=cfg.optim.schedule in ("wsd", "constant"),
        plan_end_tokens=end.tokens if end.steps is None else None,
        plan_end_steps=end.steps,
        chinchilla_tokens=run_plan.chinchilla_tokens(n_params),
        consensus=consensus,
        optim=cfg.optim,
        schedule_steps=plan.schedule_steps,
    )


def build_trainer(
    cfg: LMConfig,
    run_dir: Path,
    precision: str,
    callbacks: list[pl.Callback],
) -> pl.Trainer:
    """The Lightning Trainer with the run's callbacks (`run_callbacks`: checkpointing included) and logging."""
    t = cfg.trainer
    runtime.quiet_lightning()
    logger = (
        TensorBoardLogger(save_dir=run_dir, name=rundir.TB, version="", default_hp_metric=False)
        if cfg.logger.tensorboard
        else False
    )
    return pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(
            t.strategy
        ),  # `fsdp` is FSDP2 (lm.engine.parallel), anything else Lightning's
        precision=precision,
        max_steps=t.max_steps,
        max_epochs=-1,  # the data stream is infinite: steps, not epochs, end training
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        # Lightning counts validation intervals in micro-batches; ours is in optimizer steps.
        val_check_interval=t.val_every_steps * t.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        use_distributed_sampler=False,  # the step-indexed sampler shards by rank itself
        default_root_dir=run_dir,
        logger=logger,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO(), *cluster_plugins()],
        **t.extra,
    )


def run_hparams(
    cfg: LMConfig,
    rt: runtime.Runtime,
    plan: run_plan.RunPlan,
    n_params: int,
    ac: activation_checkpointing.Decision,
) -> dict:
    """What TensorBoard's hparams tab shows for the run (the module adds the model and optimizer configs)."""
    return {
        "params": n_params,
        "gpu": rt.gpu.name,
        "device": rt.device_name,
        "precision": rt.precision,
        "compile": rt.compile,
        "activation_checkpointing": "auto" if ac.pending else ac.every,  # set at setup when pending
        "activation_checkpointing_auto": cfg.activation_checkpointing.auto,
        "tf32": cfg.precision.tf32,
        "liger": cfg.kernels.liger,
        "fused_adamw": rt.fused_adamw,
        "padded_vocab": cfg.model.padded_vocab_size,
        "tokens_per_device_step": plan.tokens_per_device_step,
        "price_per_hour": rt.price if rt.price is not None else "unknown",
        "pricing": cfg.cost.pricing,
    }


def finish_report(trainer: pl.Trainer, run_dir: Path) -> None:
    """report.md and its plots, also in TensorBoard's text tab (rank 0)."""
    report = write_report(run_dir)
    log.info("report: %s", report)
    experiment = getattr(trainer.logger, "experiment", None)
    if hasattr(experiment, "add_text"):
        experiment.add_text("report", report.read_text(), global_step=trainer.global_step)
        experiment.flush()
