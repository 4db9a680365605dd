"""main(cfg): compose the objects of one run, train, and leave the run directory behind."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lm import cost
from lm.atomic import write_atomic
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.health import NonFiniteGuard, ThroughputAlarm
from lm.callbacks.phase_tracker import PhaseTracker
from lm.callbacks.progress import LossProgressBar
from lm.callbacks.sampler import MilestoneSampler
from lm.callbacks.spot import Preempted, SpotGuard
from lm.callbacks.stopper import DiminishingReturnsStopper
from lm.checkpointing import AtomicCheckpointIO, RunCheckpoint, remote_checkpoints, resume_checkpoint
from lm.config import LMConfig, TrainerConfig, conf_dir, to_objects
from lm.cost import load_catalog, price_per_hour, resolve_gpu
from lm.data import LMDataModule
from lm.doctor import Target, preflight
from lm.knobs import (
    CheckpointDecision,
    check_kernels,
    cuda_trial_probe,
    free_device_memory,
    resolve_activation_checkpointing,
    sdpa_backends,
)
from lm.module import LMModule
from lm.parallel import ResumeCheck, build_strategy, check_strategy, cluster_plugins
from lm.report import write_report

log = logging.getLogger(__name__)


def uses_cuda(trainer: TrainerConfig) -> bool:
    """Whether this run will train on an NVIDIA GPU."""
    return trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def resolve_precision(mode: str, cuda: bool) -> str:
    """`auto` becomes the fastest precision that is numerically safe on the device."""
    if mode == "16-mixed" and not cuda:
        raise ValueError(
            "precision=fp16 (16-mixed) needs a CUDA GPU; on a CPU use precision=auto, bf16 or fp32"
        )
    if mode.startswith("bf16") and cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision {mode} needs a GPU with bf16 (Ampere or newer); this one has none: use precision=fp16"
        )
    if mode != "auto":
        return mode
    if not cuda:
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


def run_directory(cfg: LMConfig) -> Path:
    """`<root>/<name>/`; in a multirun, one sub-directory per job named by its swept values (so a rerun
    of the same sweep resumes each job, and adding a value to the sweep never hands a job another's run)."""
    return run_directory_of(cfg.run.root, cfg.run.name)


def run_directory_of(root: str, name: str) -> Path:
    """`run_directory` from the run's root and name (what the sweep callback knows of a job)."""
    run_dir = Path(root) / name
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        run_dir = run_dir / job_dirname(swept_overrides())
    return run_dir


def swept_overrides() -> list[str]:
    """This multirun job's overrides of the keys its sweep varies (from the command line, or the sweeper's
    `hydra.sweeper.params`, which experiments like sweep_lr and the Optuna sweeper use)."""
    hc = HydraConfig.get()
    params = OmegaConf.select(hc, "sweeper.params") or {}
    return job_overrides(
        list(hc.overrides.task),
        sys.argv[1:],
        set(hc.job.config.override_dirname.exclude_keys),
        {str(k) for k in params},
    )


def job_overrides(
    task_overrides: list[str],
    argv: list[str],
    excluded: set[str] = frozenset(),
    sweeper_keys: set[str] = frozenset(),
) -> list[str]:
    """The overrides that tell a job apart: its values of the keys the command line (or the sweeper's params)
    sweeps; all of its overrides when the sweep is not on this process's command line (a launcher that runs
    jobs elsewhere)."""

    def key(override: str) -> str:
        return override.split("=", 1)[0].lstrip("+~")

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
        swept = {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}
    except Exception:  # argv is another program's (a remote launcher): name by every override instead
        swept = set()
    swept |= set(sweeper_keys)
    chosen = [o for o in task_overrides if key(o) in swept] or task_overrides
    return sorted(o for o in chosen if key(o) not in excluded)


def job_dirname(
    task_overrides: list[str],
    argv: list[str] | None = None,
    excluded: set[str] = frozenset(),
    sweeper_keys: set[str] = frozenset(),
) -> str:
    """A job's directory name: its values of the keys the sweep varies (`optim.lr=0.0003`), see
    `job_overrides`; pass the chosen overrides alone (argv None) to name them as they are. A long name keeps
    a readable prefix and a hash of the whole."""
    chosen = task_overrides if argv is None else job_overrides(task_overrides, argv, excluded, sweeper_keys)
    name = ",".join(sorted(chosen)).replace("/", "_") or "default"
    if len(name) > 120:
        name = f"{name[:80]}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    return name


def build_trainer(
    cfg: LMConfig, run_dir: Path, precision: str, callbacks: list[pl.Callback], remote=None
) -> pl.Trainer:
    """The Lightning Trainer with the run directory's checkpointing (mirrored to `remote`) and logging wired in."""
    t = cfg.trainer
    callbacks = [
        *callbacks,
        *(hydra.utils.instantiate(node) for node in cfg.callbacks.values()),
        # Lightning runs checkpoint callbacks last.
        RunCheckpoint(run_dir / "checkpoints", cfg.checkpoint, remote),
    ]
    if t.enable_progress_bar:
        callbacks.append(LossProgressBar())
    logger = (
        TensorBoardLogger(save_dir=run_dir, name="tb", version="", default_hp_metric=False)
        if cfg.logger.tensorboard
        else False
    )
    return pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(t.strategy),  # `fsdp` is FSDP2 (lm.parallel), anything else Lightning's
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


def main(dcfg: DictConfig) -> float | None:
    """Train one run as configured; returns the last validation loss (the objective for Hydra sweepers)."""
    started_at = time.monotonic()
    cfg = to_objects(dcfg)
    cuda = uses_cuda(cfg.trainer)
    precision = resolve_precision(cfg.precision.mode, cuda)  # refuses an impossible precision before any I/O
    check_kernels(cfg.kernels.liger, cuda)  # likewise Liger without CUDA or without liger_kernel
    device = resolve_gpu(cfg.gpu, torch.cuda.get_device_name() if cuda else None, conf_dir())
    price = price_per_hour(device.gpu, cfg.cost)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    check_strategy(cfg.trainer.strategy, cfg.trainer.devices, multirun)
    run_dir = run_directory(cfg)
    if cfg.doctor.enabled:  # before data preparation and the model; every rank, so all refuse together
        preflight(Target(cfg, device.gpu, cuda, precision, run_dir, load_catalog(conf_dir())))
    remote = remote_checkpoints(cfg.checkpoint, Path(cfg.run.root), run_dir)  # probes the bucket first
    ckpt_path = resume_checkpoint(run_dir, cfg.run.resume, remote)
    if rank_zero_only.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(dcfg, run_dir / "config.yaml")

    compile_model = cfg.kernels.compile if cfg.kernels.compile is not None else cuda
    torch.set_float32_matmul_precision("high" if cfg.precision.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = cfg.precision.tf32
    ac = activation_checkpointing(cfg, precision, cuda)
    log.info(
        "run %s on %s (catalog: %s): precision %s, tf32 %s, compile %s, liger %s, activation checkpointing %s "
        "(%s)%s",
        run_dir,
        device.device_name,
        device.gpu.name,
        precision,
        cfg.precision.tf32,
        compile_model,
        cfg.kernels.liger,
        ac.label,
        ac.reason,
        f", SDPA backends {sdpa_backends()}" if cuda else "",
    )

    pl.seed_everything(cfg.run.seed, workers=True)
    datamodule = LMDataModule(cfg.data)
    module = LMModule(
        cfg.model,
        cfg.optim,
        checkpoint_every=ac.every,
        compile=compile_model,
        compile_mode=cfg.kernels.compile_mode,
        liger=cfg.kernels.liger,
    )
    n_params = module.model.num_parameters()
    fpt = cost.flops_per_token(
        cfg.model, cfg.data.seq_len, module.model.num_parameters(exclude_embedding=True)
    )
    peak = cost.peak_flops(device.gpu, precision, cfg.precision.tf32)
    log.info(
        "%s parameters; MFU = tokens/s x %.3g FLOPs/token [%s] / %s; $%s/h per device (%s, %s)",
        f"{n_params:,}",
        fpt,
        cost.FLOPS_FORMULA,
        f"{peak / 1e12:g} TFLOP/s peak" if peak else "no catalogued peak: MFU not reported",
        price,
        cfg.cost.pricing if cfg.cost.price_per_hour is None else "cost.price_per_hour",
        device.gpu.price_source or "no source",
    )
    hparams = run_hparams(cfg, device, precision, compile_model, n_params, price, ac)
    meter = CostMeter(
        tokens_per_device_step=tokens_per_device_step(cfg),
        flops_per_token=fpt,
        peak_flops=peak,
        price_per_hour=price,
        log_every=cfg.trainer.log_every_n_steps,
        ledger=run_dir / "cost.json",
        started_at=started_at,
        about=hparams,
    )
    callbacks = run_callbacks(cfg, meter, run_dir, n_params)
    trainer = build_trainer(cfg, run_dir, precision, callbacks, remote)
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException as e:  # Lightning's own handler fired before SpotGuard's was installed
        raise Preempted("SIGTERM") from e

    if trainer.is_global_zero:
        report = write_report(run_dir)
        log.info("report: %s", report)
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("report", report.read_text(), global_step=trainer.global_step)
            experiment.flush()
    val_loss = trainer.callback_metrics.get("val/loss")
    return float(val_loss) if val_loss is not None else None


def activation_checkpointing(cfg: LMConfig, precision: str, cuda: bool) -> CheckpointDecision:
    """The block stride to checkpoint: as configured, or for `auto` measured on this process's GPU."""
    ac = cfg.activation_checkpointing
    probe = budget = None
    if ac.auto and cuda:
        # Lightning has not picked the device yet: under DDP each local rank trains on GPU LOCAL_RANK.
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        budget = free_device_memory(gpu)
        probe = cuda_trial_probe(
            cfg.model,
            batch_size=cfg.data.batch_size,
            seq_len=cfg.data.seq_len,
            precision=precision,
            liger=cfg.kernels.liger,
            device=gpu,
        )
    return resolve_activation_checkpointing(
        ac.every, ac.auto, cfg.model.n_layer, probe=probe, budget_bytes=budget, headroom=ac.headroom
    )


def run_callbacks(cfg: LMConfig, meter: CostMeter, run_dir: Path, n_params: int) -> list[pl.Callback]:
    """lm's own callbacks, in the order their hooks must run.

    The CostMeter comes first: at each optimizer step it counts the step's tokens and time before the
    phase tracker, the sampler and the stopper read them. The spot guards only need to run before the
    checkpoint callback, which Lightning always runs last.
    """
    # Before any hook that talks across ranks: ranks that resumed differently would pair the wrong collectives.
    callbacks: list[pl.Callback] = [ResumeCheck(meter), meter]
    if cfg.phases.phases:
        callbacks.append(PhaseTracker(cfg.phases.phases, meter, run_dir, cfg.trainer.limit_val_batches))
    if cfg.sampling.prompts:
        callbacks.append(MilestoneSampler(cfg.sampling, cfg.phases.phases, meter, run_dir / "samples.jsonl"))
    callbacks.append(stopper(cfg, meter, run_dir, n_params))
    s = cfg.spot
    callbacks += [
        SpotGuard(s.signals),
        ThroughputAlarm(s.slow_ratio, s.slow_window_s, s.baseline_steps, s.baseline_warmup),
        NonFiniteGuard(s.max_nonfinite, run_dir / "checkpoints"),
    ]
    return callbacks


def tokens_per_device_step(cfg: LMConfig) -> int:
    """Tokens one device trains on per optimizer step (x world size for the whole step)."""
    return cfg.data.batch_size * cfg.data.seq_len * cfg.trainer.accumulate_grad_batches


def stopper(cfg: LMConfig, meter: CostMeter, run_dir: Path, n_params: int) -> DiminishingReturnsStopper:
    """The early stopper, with the plan's end (the last phase's, else the schedule's) for the forecast."""
    last = cfg.phases.phases[-1] if cfg.phases.phases else None
    end_steps = cfg.optim.total_steps or cfg.trainer.max_steps
    if last is not None and last.end_step is not None:
        end_steps = max(end_steps, last.end_step)
    return DiminishingReturnsStopper(
        cfg.early_stopping,
        meter,
        run_dir,
        flat_lr=cfg.optim.schedule in ("wsd", "constant"),
        plan_end_tokens=last.end_tokens if last is not None and last.end_tokens else None,
        plan_end_steps=end_steps,
        chinchilla_tokens=cost.chinchilla_tokens(n_params),
    )


def run_hparams(
    cfg: LMConfig,
    device,
    precision: str,
    compile_model: bool,
    n_params: int,
    price,
    ac: CheckpointDecision | None = None,
) -> dict:
    """What TensorBoard's hparams tab shows for the run (the module adds the model and optimizer configs)."""
    ac = ac or CheckpointDecision(cfg.activation_checkpointing.every, "configured")
    return {
        "params": n_params,
        "gpu": device.gpu.name,
        "device": device.device_name,
        "precision": precision,
        "compile": compile_model,
        "activation_checkpointing": ac.every,
        "activation_checkpointing_auto": cfg.activation_checkpointing.auto,
        "tf32": cfg.precision.tf32,
        "liger": cfg.kernels.liger,
        "fused_adamw": cfg.optim.fused if cfg.optim.fused is not None else uses_cuda(cfg.trainer),
        "padded_vocab": cfg.model.padded_vocab_size,
        "tokens_per_device_step": tokens_per_device_step(cfg),
        "price_per_hour": price if price is not None else "unknown",
        "pricing": cfg.cost.pricing,
    }


def write_config(cfg: DictConfig, path: Path) -> None:
    """The composed config, resolved, written atomically (a crash never leaves half a file)."""
    write_atomic(path, OmegaConf.to_yaml(cfg, resolve=True))
