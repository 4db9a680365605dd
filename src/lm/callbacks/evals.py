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
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lm import hf, rundir
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.steps import StepWatch
from lm.config import EvalsConfig, PhaseConfig
from lm.data.manifest import TOKENIZER
from lm.evaluate import generators_kept, score, task_manager
from lm.parallel import is_sharded
from lm.plan import phase_at
from lm.tables import evals_markdown

log = logging.getLogger(__name__)


class BenchmarkEvaluator(Callback):
    """Appends one record per milestone to the run's evals.jsonl and logs `eval/<task>/<metric>`.

    The milestones already evaluated are read back from evals.jsonl, not from the checkpoint: a run that
    crashed after an evaluation but before its next checkpoint does not pay for that evaluation again.
    """

    def __init__(self, cfg: EvalsConfig, phases: list[PhaseConfig], meter: CostMeter, run_dir: Path) -> None:
        self.cfg = cfg
        self.phases = phases
        self.meter = meter
        self.run_dir = run_dir
        self.steps = StepWatch()
        self.done: set[int] = set()

    def is_milestone(self, step: int, tokens: int) -> bool:
        """Whether optimizer step `step` (with `tokens` trained) is a milestone other than the last step."""
        if step in self.cfg.steps:
            return True
        if self.cfg.at_phase_ends and self.phases and step > 0:
            before = tokens - self.meter.tokens_per_step
            return phase_at(step, tokens, self.phases) != phase_at(step - 1, before, self.phases)
        return False

    # --- Lightning hooks ---------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:  # an unknown task is refused before the first step, not at a milestone
            task_manager(self.cfg.tasks, self.cfg.include_path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start(trainer)
        self.done = {r["step"] for r in rundir.read_evals(self.run_dir)}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.steps.ended(trainer):
            return
        step = trainer.global_step  # the meter, earlier in the list, has counted this step's tokens
        if step not in self.done and self.is_milestone(step, self.meter.state.tokens):
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.cfg.at_last_step and trainer.global_step > 0 and trainer.global_step not in self.done:
            self.evaluate(trainer, pl_module)

    # --- evaluation --------------------------------------------------------------------------------------

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Run the tasks on the model as it is at this step; rank 0 writes and logs the scores."""
        step = trainer.global_step
        self.done.add(step)
        if not trainer.is_global_zero:
            return
        if is_sharded(trainer.strategy):
            # Sharded weights need every rank in each forward; a rank-0-only evaluation would hang.
            log.warning("benchmarks are skipped under FSDP; score the checkpoint with `lm eval RUN_DIR`")
            return
        self.meter.switch("eval")  # paid for, but not training throughput
        started = time.monotonic()
        tokens, usd = self.meter.state.tokens, self.meter.usd()
        try:
            with generators_kept(pl_module.device):
                scores = self.run_tasks(trainer, pl_module)
        except Exception as e:  # a benchmark's data out of reach must not end a paid-for training run
            log.error("benchmarks at step %d failed; training goes on: %s: %s", step, type(e).__name__, e)
            self.meter.switch("train")
            return
        seconds = time.monotonic() - started
        index = phase_at(step - 1, tokens - self.meter.tokens_per_step, self.phases) if self.phases else None
        record = {
            "step": step,
            "tokens": tokens,
            "usd": usd,
            "phase": self.phases[index].name if index is not None and index < len(self.phases) else None,
            "seconds": seconds,
            "limit": self.cfg.limit,
            "scores": scores,
        }
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

    def run_tasks(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict[str, float]]:
        """The configured tasks on an in-memory `transformers` copy of the model, on the model's device."""
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
        return out["scores"]
