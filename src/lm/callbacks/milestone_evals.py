"""BenchmarkEvaluator: lm-evaluation-harness tasks at milestones, priced, in evals.jsonl and TensorBoard.

The loss says how much a phase improved the model; benchmarks say what that bought in the units 1B models
are compared by (ARC-Easy, PIQA, HellaSwag...). Milestones are each phase boundary, chosen steps and the
last step of an invocation. Rank 0 converts the model in memory and runs the tasks while the other ranks
wait at the next collective; the time is charged to the `eval` bucket, so tokens/s and MFU stay training's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lm.base.tables import evals_markdown
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestones import MilestoneCallback
from lm.config import EvalsConfig, PhaseConfig
from lm.data.manifest import TOKENIZER
from lm.interop import hf
from lm.interop.evaluation import generators_kept, score, task_manager
from lm.store import rundir

log = logging.getLogger(__name__)


class BenchmarkEvaluator(MilestoneCallback):
    """Appends one record per milestone to the run's evals.jsonl and logs `eval/<task>/<metric>`.

    The milestones already evaluated are read back from evals.jsonl, not from the checkpoint: a run that
    crashed after an evaluation but before its next checkpoint does not pay for that evaluation again.
    """

    def __init__(self, cfg: EvalsConfig, phases: list[PhaseConfig], meter: CostMeter, run_dir: Path) -> None:
        super().__init__(cfg, phases, meter, run_dir)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:  # an unknown task is refused before the first step, not at a milestone
            task_manager(self.cfg.tasks, self.cfg.include_path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.done = {r["step"] for r in rundir.read_evals(self.run_dir)}

    # --- evaluation --------------------------------------------------------------------------------------

    def at_milestone(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Run the tasks on the model as it is at this step; rank 0 writes and logs the scores."""
        if not self.claim(trainer, "benchmarks", "score the checkpoint with `lm eval RUN_DIR`"):
            return
        step = trainer.global_step
        self.meter.switch("eval")  # paid for, but not training throughput
        started = time.monotonic()
        tokens, usd = self.meter.state.tokens, self.meter.usd()
        try:
            with generators_kept(pl_module.device):
                scores, errors = self.run_tasks(trainer, pl_module)
        except Exception as e:  # a benchmark's data out of reach must not end a paid-for training run
            log.error("benchmarks at step %d failed; training goes on: %s: %s", step, type(e).__name__, e)
            self.meter.switch("train")
            return
        seconds = time.monotonic() - started
        record = {
            "step": step,
            "tokens": tokens,
            "usd": usd,
            "phase": self.phase_name(step, tokens),
            "seconds": seconds,
            "limit": self.cfg.limit,
            "scores": scores,
        }
        if errors:  # the tasks that failed, with why; the others' scores are kept
            record["errors"] = errors
        for task, why in errors.items():
            log.error("benchmark %s at step %d failed; the other tasks are kept: %s", task, step, why)
        rundir.append_evals(self.run_dir, record)
        metrics = {
            f"eval/{task}/{metric}": value
            for task, values in scores.items()
            for metric, value in values.items()
            if not metric.endswith("_stderr")
        }
        for logger in trainer.loggers:  # at the index of the step's last batch, as Lightning logs val/loss
            logger.log_metrics(metrics, step=step - 1)
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("benchmarks", evals_markdown(scores), global_step=step)
        self.meter.switch("train")
        log.info("step %d benchmarks (%.1f s): %s", step, seconds, metrics)

    def run_tasks(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
        """The configured tasks on an in-memory `transformers` copy of the model, on the model's device:
        (task -> metric -> value, task -> why it failed)."""
        datamodule = trainer.datamodule
        dtype = torch.bfloat16 if pl_module.device.type == "cuda" else torch.float32
        model = hf.to_hf_model(pl_module.model, eos_id=datamodule.eot_id, dtype=dtype).to(pl_module.device)
        tokenizer = hf.hf_tokenizer(datamodule.data_dir / TOKENIZER, datamodule.cfg.eot_token)
        cfg = self.cfg
        out = score(
            model,
            tokenizer,
            cfg.tasks,
            limit=cfg.limit,
            include_path=cfg.include_path,
            batch_size=cfg.batch_size,
        )
        return out["scores"], out["errors"]
