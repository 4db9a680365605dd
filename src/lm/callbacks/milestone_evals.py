"""BenchmarkEvaluator: benchmarks at milestones, priced, in evals.jsonl and TensorBoard.

The loss says how much a phase improved the model; benchmarks say what that bought in the units models are
compared by (DCLM CORE, HellaSwag, ARC-Easy...). Milestones are each phase boundary, chosen steps and the
last step of an invocation. The scoring is lm.evals' one entry, as `lm eval`'s: CORE and the `@olmo` sets on
every rank's share of each task's items, the counts summed across ranks, so every rank holds the same
figure; lm-evaluation-harness tasks on rank 0 on an in-memory `transformers` copy while the other ranks wait
at the next collective. The time is charged to the `eval`
bucket, so tokens/s and MFU stay training's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lm.base.scores import core_metrics, is_core
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestones import MilestoneCallback
from lm.config import EvalsConfig, PhaseConfig
from lm.data.manifest import TOKENIZER
from lm.engine.parallel import is_sharded
from lm.evals import evaluate, own
from lm.evals.progress import Progress
from lm.store import rundir

log = logging.getLogger(__name__)
PROGRESS_S = 30.0
"""How often a milestone's scoring says how far it is (rank 0's log)."""


class BenchmarkEvaluator(MilestoneCallback):
    """Appends one record per milestone to the run's evals.jsonl and logs `eval/<task>/<metric>`.

    The milestones already evaluated are read back from evals.jsonl, not from the checkpoint: a run that
    crashed after an evaluation but before its next checkpoint does not pay for that evaluation again.
    """

    def __init__(self, cfg: EvalsConfig, phases: list[PhaseConfig], meter: CostMeter, run_dir: Path) -> None:
        super().__init__(cfg, phases, meter, run_dir)
        self.plan: own.Plan | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # An unknown task, a missing or changed CORE file: refused before the first step, not at a milestone,
        # and on every rank alike (a refusal on rank 0 alone would leave the others in the first collective).
        self.plan = evaluate.prepare(self.cfg)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.done = {r["step"] for r in rundir.read_evals(self.run_dir)}

    # --- evaluation --------------------------------------------------------------------------------------

    def at_milestone(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Score the model as it is at this step; rank 0 writes and logs the scores."""
        step = trainer.global_step
        self.done.add(step)
        if is_sharded(trainer.strategy):  # a forward on sharded weights needs every rank in lockstep
            log.warning("benchmarks are skipped under FSDP; score the checkpoint with `lm eval RUN_DIR`")
            return
        self.meter.switch("eval")  # paid for, but not training throughput
        started = time.monotonic()
        tokens, usd = self.meter.state.tokens, self.meter.usd()
        result = self.score(trainer, pl_module)
        scores, errors, core = result.scores, result.errors, result.core
        seconds = time.monotonic() - started
        self.meter.switch("train")
        if not trainer.is_global_zero:
            return
        record = {
            "step": step,
            "tokens": tokens,
            "usd": usd,
            "phase": self.phase_name(step, tokens),
            "seconds": seconds,
            "limit": self.cfg.limit,
            "scores": scores,
        }
        if core is not None:
            record["core"] = core
        if errors:  # the tasks that failed, with why; the others' scores are kept
            record["errors"] = errors
        for task, why in errors.items():
            log.error("benchmark %s at step %d failed; the other tasks are kept: %s", task, step, why)
        rundir.append_evals(self.run_dir, record)
        metrics = {
            f"eval/{task}/{metric}": value
            for task, values in scores.items()
            if not is_core(task)
            for metric, value in values.items()
            if not metric.endswith("_stderr")
        }
        if core is not None:
            metrics |= core_metrics(core)
        for logger in trainer.loggers:  # at the index of the step's last batch, as Lightning logs val/loss
            logger.log_metrics(metrics, step=step - 1)
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("benchmarks", result.markdown(), global_step=step)
        log.info("step %d benchmarks (%.1f s): %s", step, seconds, metrics)

    def score(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> evaluate.Result:
        """The model as it is at this step, through lm.evals' one entry: every rank its share of lm's own
        tasks (the counts summed), rank 0 the lm-eval tasks."""
        datamodule = trainer.datamodule
        dtype = torch.bfloat16 if pl_module.device.type == "cuda" else torch.float32
        subject = evaluate.of_lm(
            pl_module.model, datamodule.data_dir / TOKENIZER, datamodule.cfg.eot_token, datamodule.eot_id,
            hf_dtype=dtype,
        )  # fmt: skip

        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            return trainer.strategy.reduce(tensor.to(pl_module.device), reduce_op="sum").cpu()

        return evaluate.evaluate(
            subject, self.cfg, self.plan, harness_here=trainer.is_global_zero, rank=trainer.global_rank,
            world=trainer.world_size, reduce=reduce,
            progress=Progress(PROGRESS_S, log.info if trainer.is_global_zero else lambda _: None, "benchmarks"),
        )  # fmt: skip
