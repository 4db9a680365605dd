"""The one builder: the composed config -> the LightningModule, the callbacks and the Trainer of a run.

Every verb that builds a run calls these (`lm.run.train.main`, `lm bench`, and through them `lm selftest` and
`lm plan --calibrate`), so a new module argument or callback is added once, and a benchmark measures the module
and Trainer a run trains.

    build_module(cfg)                                  the seeded LMModule (a script with a composed cfg: this)
    build_callbacks(cfg, plan, meter, run_dir, module)  every callback of the run, in the order their hooks run
    build_trainer(cfg, run_dir, precision, callbacks)   the Trainer: strategy, precision, logging, checkpoint IO
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig

from lm.callbacks.consensus import Consensus
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestone_samples import MilestoneSampler
from lm.callbacks.nonfinite import NonFiniteGuard
from lm.callbacks.phase_tracker import PhaseTracker
from lm.callbacks.progress import LossProgressBar
from lm.callbacks.run_tokenizer import KeepTokenizer
from lm.callbacks.spike import SpikeGuard
from lm.callbacks.step import AfterOthers, StepBoundary
from lm.callbacks.stop_signals import StopSignals
from lm.callbacks.stopper import EarlyStopper
from lm.callbacks.throughput_alarm import ThroughputAlarm
from lm.checkpoint.checkpointer import Checkpointer
from lm.checkpoint.run_state import RunState
from lm.config import LMConfig, to_objects
from lm.engine import activation_checkpointing, runtime
from lm.engine.module import LMModule
from lm.engine.parallel import build_strategy, cluster_plugins, job_processes
from lm.engine.runtime import resolve_runtime
from lm.numbers import cost, run_plan
from lm.numbers.batch_ramp import seq_len_warmup, window_len_at
from lm.numbers.memory import Workload
from lm.store import rundir
from lm.store.tensorboard_layout import RunLogger

log = logging.getLogger(__name__)


def objects(cfg: LMConfig | DictConfig) -> LMConfig:
    """The typed config of a composed one (`lm.config.compose`, Hydra's), every check run; typed as given."""
    return to_objects(cfg) if isinstance(cfg, DictConfig) else cfg


def decide_now(cfg: LMConfig, rt: runtime.Runtime) -> activation_checkpointing.Decision:
    """The activation checkpointing stride, decided in this process (`auto` on a GPU measured here)."""
    ac, decide = checkpointing_decision(cfg, rt)
    return decide() if decide is not None else ac


def checkpointing_decision(
    cfg: LMConfig, rt: runtime.Runtime
) -> tuple[activation_checkpointing.Decision, Callable[[], activation_checkpointing.Decision] | None]:
    """The activation checkpointing stride, and the function that decides it at setup when it is deferred.

    `auto` on a GPU is measured by rank 0 once the processes are up (`LMModule.decide_activation_checkpointing`),
    so that every rank trains with one stride; anything else (a configured stride, `auto` on a CPU) is known now.
    """
    workload = Workload(cfg.model, cfg.data.batch_size, cfg.data.seq_len, rt.precision, rt.cuda)
    decide = functools.partial(
        activation_checkpointing.decide, cfg.activation_checkpointing, workload, cfg.kernels.liger
    )
    if cfg.activation_checkpointing.auto and rt.cuda:
        return activation_checkpointing.Decision(0, "measured by rank 0 at setup", pending=True), decide
    return decide(), None


def build_module(
    cfg: LMConfig | DictConfig,
    rt: runtime.Runtime | None = None,
    ac: activation_checkpointing.Decision | None = None,
    *,
    init_from: bool = True,
    total_steps: int | None = None,
    eot_id: int | None = None,
    run_state: RunState | None = None,
    decide: Callable[[], activation_checkpointing.Decision] | None = None,
    from_rank0: Callable[[pl.Trainer, Any], Any] | None = None,
) -> LMModule:
    """The seeded LightningModule a run of `cfg` trains.

    `rt`: the resolved runtime (default: resolved from `cfg`); `ac`: the activation checkpointing decision
    (default: `decide_now`). `init_from`: load `model.init_from`'s weights when it is set (a fresh start; a
    resume continues from its checkpoint, a bench measures speed). `total_steps`: the LR schedule's span where
    neither `optim.total_steps` nor the Trainer's `max_steps` is the one wanted. `eot_id`: the end-of-text id
    `model.doc_mask` splits documents at, where no data module will set it (a run's comes from its manifest).
    `run_state`: the run's RunState, whose LR cooldown (an early stop's) the schedule follows. `decide`:
    `activation_checkpointing=auto` on a GPU, which rank 0 measures at setup (`checkpointing_decision`);
    `from_rank0`: how every rank gets rank 0's measurement (the run's `Consensus.from_rank0`).
    """
    cfg = objects(cfg)
    rt = rt if rt is not None else resolve_runtime(cfg)
    ac = ac if ac is not None else decide_now(cfg, rt)
    pl.seed_everything(cfg.run.seed, workers=True)
    module = LMModule(
        cfg.model,
        cfg.optim,
        total_steps=total_steps,
        ac_every=ac.every,
        compile=rt.compile,
        compile_mode=cfg.kernels.compile_mode,
        liger=cfg.kernels.liger,
        fp8=rt.fp8,
        fp8_emulate=cfg.precision.fp8_emulate,
        eot_id=eot_id,
        window_stages=seq_len_warmup(cfg.data) if cfg.data.seq_len_warmup_steps else None,
        lr_cooldown=(lambda: run_state.lr_cooldown) if run_state is not None else None,
        decide_stride=decide,
        from_rank0=from_rank0,
    )
    if cfg.model.init_from is not None and init_from:
        from lm.interop import hf  # an optional feature: loaded when configured

        hf.load_init_from(module.model)
    return module


def cost_meter(
    cfg: LMConfig,
    rt: runtime.Runtime,
    plan: run_plan.RunPlan,
    module: LMModule,
    run_dir: Path,
    started_at: float,
    ac: activation_checkpointing.Decision,
    run_state: RunState,
) -> CostMeter:
    """The meter, with the FLOPs per token and peak that MFU is measured against (both logged once); its
    ledger is `run_state`'s (the run's one, made by `lm.run.train`), which every part of the step then shares."""
    n_params = module.model.num_parameters()
    non_embedding = module.model.num_parameters(exclude_embedding=True)
    fpt = cost.flops_per_token(cfg.model, cfg.data.seq_len, non_embedding)
    peak = cost.peak_flops(rt.gpu, rt.precision, cfg.precision.tf32, fp8=rt.fp8 is not None)
    log.info(
        "model: %s parameters (%s non-embedding); MFU = tokens/s x %.3g FLOPs/token [%s] / %s; "
        "$%s/h per device (%s, %s)",
        f"{n_params:,}",
        f"{non_embedding:,}",
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
        run_state=run_state,
        flops_at=warmup_flops(cfg, non_embedding),
    )


def warmup_flops(cfg: LMConfig, non_embedding: int) -> Callable[[int], float] | None:
    """FLOPs per token of each step under `data.seq_len_warmup_steps` (its windows are shorter, so attention
    costs less per token); None without a warm-up (one figure throughout)."""
    if not cfg.data.seq_len_warmup_steps:
        return None
    stages = seq_len_warmup(cfg.data)
    return lambda step: cost.flops_per_token(cfg.model, window_len_at(stages, step), non_embedding)


def build_callbacks(
    cfg: LMConfig,
    plan: run_plan.RunPlan,
    meter: CostMeter,
    run_dir: Path,
    module: LMModule,
    *,
    resumed: bool,
    consensus: Consensus,
    checkpointer: Checkpointer | None = None,
) -> list[pl.Callback]:
    """Every callback of the run, lm's and `cfg.callbacks`, in the order Lightning calls their hooks.

    The step itself is one callback, `StepBoundary` (lm.callbacks.step), which runs the step boundary as a
    written sequence and owns the run's RunState (the meter's), the guards and the agreement across ranks.
    The others are listed for their own hooks, in the order given here with the reason for each.
    A callback of one's own (`cfg.callbacks`) comes after lm's: it sees each step counted, agreed and saved.

    `checkpointer`: the run's (default: one without a bucket), which gives the resume check and the saver.
    `consensus`: how the ranks agree, the run's one (`lm.run.train` builds it, and it also says how every rank
    leaves): the step boundary's, the saver's, the resume check's, the stopper's and the benchmarks'.
    """
    checkpointer = checkpointer or Checkpointer(run_dir, cfg.checkpoint)
    resume_check, saver = checkpointer.callbacks(meter, consensus)
    g = cfg.guards
    ckpt_dir = run_dir / rundir.CHECKPOINTS
    observers: list[pl.Callback] = []  # called by the step boundary at each counted step, in this order
    if cfg.evals.tasks:  # before the phase tracker: a phase's row in phases.csv carries its end's CORE
        from lm.callbacks.milestone_evals import BenchmarkEvaluator  # optional: loaded when configured

        observers.append(BenchmarkEvaluator(cfg.evals, cfg.phases.phases, meter, run_dir, consensus))
    if cfg.phases.phases:
        observers.append(PhaseTracker(cfg.phases.phases, meter, run_dir, cfg.trainer.limit_val_batches))
    if cfg.sampling.prompts:
        observers.append(MilestoneSampler(cfg.sampling, cfg.phases.phases, meter, run_dir))
    early = stopper(cfg, plan, meter, run_dir, module.model.num_parameters(), consensus)
    step = StepBoundary(
        meter=meter,
        saver=saver,
        stopper=early,
        signals=StopSignals(g.signals),
        alarm=ThroughputAlarm(g.slow_ratio, g.slow_window_s, g.baseline_steps, g.baseline_warmup),
        nonfinite=NonFiniteGuard(g.max_nonfinite, ckpt_dir, meter.run, saver),
        spike=SpikeGuard(g.spike_factor, g.spike_window, g.max_spikes, ckpt_dir, meter.run, saver),
        observers=tuple(observers),
        consensus=consensus,
    )
    # 1. ranks that resumed differently would pair up any later hook's collectives wrongly: checked first;
    # 2. the step: RunState restored before any other load hook reads it; the step boundary's sequence;
    # 3. the meter's clock (train, eval and checkpoint time), which the step's count reads; at train start
    # it logs the run's hparams (the module's stride decided at setup included).
    callbacks: list[pl.Callback] = [resume_check, step, meter]
    # 4. the observers' own hooks (train start and end, validation), then the stopper's (each validation);
    # 5. the run's tokenizer beside its checkpoints (setup only: what sample/export/eval read).
    callbacks += [*observers, early, KeepTokenizer(run_dir, resumed=resumed)]
    # 6. one's own callbacks;
    callbacks += [hydra.utils.instantiate(node) for node in cfg.callbacks.values()]
    # 7. the step boundary's last word: a stop decided in validation, the final save (after every callback's
    # train-end work, which it then holds); 8. the saver's own hooks (set-up, finishing a background write);
    # 9. the progress bar.
    callbacks += [AfterOthers(step), saver]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(LossProgressBar())
    return callbacks


def stopper(
    cfg: LMConfig,
    plan: run_plan.RunPlan,
    meter: CostMeter,
    run_dir: Path,
    n_params: int,
    consensus: Consensus | None = None,
) -> EarlyStopper:
    """The early stopper, with the plan's end for the forecast (in tokens, or in steps that the meter turns
    into tokens once it knows the world size)."""
    end = plan.end
    return EarlyStopper(
        cfg.early_stopping,
        meter,
        run_dir,
        flat_lr=cfg.optim.schedule in ("wsd", "constant"),
        plan_end_tokens=end.tokens if end.steps is None else None,
        plan_end_steps=end.steps,
        chinchilla_tokens=run_plan.chinchilla_tokens(n_params),
        optim=cfg.optim,
        schedule_steps=plan.schedule_steps,
        references=references(cfg, plan),
        consensus=consensus,
    )


def references(cfg: LMConfig, plan: run_plan.RunPlan) -> list:
    """The reference curves `early_stopping.forecast_reference` names, read and checked against the run
    (none configured: nothing of the reference forecast is loaded)."""
    if not cfg.early_stopping.forecast_reference:
        return []
    from lm.numbers.reference import curve_key  # an optional feature: loaded when configured
    from lm.run.references import load_references

    return load_references(
        cfg.early_stopping.forecast_reference,
        curve_key(cfg.optim, plan.schedule_steps, plan.tokens_per_step, cfg.data),
        required=cfg.early_stopping.forecast_model == "reference",
    )


def build_trainer(
    cfg: LMConfig,
    run_dir: Path,
    precision: str,
    callbacks: list[pl.Callback],
    *,
    checkpointer: Checkpointer | None = None,
    **overrides: Any,
) -> pl.Trainer:
    """The Lightning Trainer with the run's callbacks (`build_callbacks`: checkpointing included) and logging.

    `checkpointer`: the run's, whose format the checkpoint plugin writes (default: the full file).
    `overrides`: Trainer arguments that replace the run's (`lm bench`: one device, no logger, no saves); they
    also win over `trainer.extra`.
    """
    t = cfg.trainer
    runtime.quiet_lightning()
    checkpointer = checkpointer or Checkpointer(run_dir, cfg.checkpoint)
    if "logger" in overrides:
        logger = overrides.pop("logger")
    else:
        logger = (
            RunLogger(save_dir=run_dir, name=rundir.TB, version="", default_hp_metric=False)
            if cfg.logger.tensorboard
            else False
        )
    args = dict(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        # `fsdp` is FSDP2 (lm.engine.parallel), anything else Lightning's
        strategy=build_strategy(t.strategy, cfg.checkpoint.format == "sharded", processes=job_processes(t)),
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
        enable_checkpointing=False,  # no ModelCheckpoint of Lightning's: the run's saver (RunCheckpoint) saves
        default_root_dir=run_dir,
        logger=logger,
        callbacks=callbacks,
        plugins=[checkpointer.io(), *cluster_plugins()],
    )
    if "enable_model_summary" not in t.extra:
        # Lightning's summary says "Total FLOPs: 0" (it has no example input); `cost_meter` logs lm's one line.
        args["enable_model_summary"] = False
    extra = {k: v for k, v in t.extra.items() if k not in overrides}
    return pl.Trainer(**{**args, **overrides}, **extra)


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
