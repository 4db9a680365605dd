"""BenchmarkEvaluator: benchmarks at milestones, priced, in evals.jsonl and TensorBoard.

The loss says how much a phase improved the model; benchmarks say what that bought in the units models are
compared by (DCLM CORE, HellaSwag, ARC-Easy...). Milestones are each phase boundary, chosen steps and the
last step of an invocation. The scoring is lm.evals' one entry, as `lm eval`'s: CORE and the `@olmo` sets on
every rank's share of each task's items, the counts summed across ranks, so every rank holds the same
figure; lm-evaluation-harness tasks on rank 0 on an in-memory `transformers` copy while the other ranks wait
at the next collective. The time is charged to the `eval`
bucket, so tokens/s and MFU stay training's.

A benchmark that fails at a milestone (an out-of-memory in the scorer, a task file changed under the run, a
harness task's data out of reach) is recorded under `errors` in that milestone's evals.jsonl line, the other
tasks' scores kept, and training goes on. A failure of lm's own scoring on any rank is agreed before the
counts' reduce (`Consensus.gather`: the ranks that got there call it inside `reduce`, a rank that failed on its
way there calls it in its handler), so every rank leaves the milestone together and rank 0 records every
rank's reason.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lm.base.scores import core_metrics, is_core
from lm.callbacks.consensus import Consensus
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


class ScoringFailed(RuntimeError):
    """Another rank's scoring failed: this rank leaves the milestone's scoring with it (no reduce)."""


class BenchmarkEvaluator(MilestoneCallback):
    """Appends one record per milestone to the run's evals.jsonl and logs `eval/<task>/<metric>`.

    The milestones already evaluated are read back from evals.jsonl, not from the checkpoint: a run that
    crashed after an evaluation but before its next checkpoint does not pay for that evaluation again.
    """

    what = "milestone benchmarks"

    def __init__(
        self,
        cfg: EvalsConfig,
        phases: list[PhaseConfig],
        meter: CostMeter,
        run_dir: Path,
        consensus: Consensus,
    ) -> None:
        super().__init__(cfg, phases, meter, run_dir)
        self.plan: own.Plan | None = None
        self.consensus = consensus
        """The run's agreement across ranks: a scoring failure on any rank, before the counts' reduce."""

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
            "scores": result.scores,
        }
        if result.core is not None:
            record["core"] = result.core
        if result.errors:  # the tasks that failed, with why; the others' scores are kept
            record["errors"] = result.errors
        self.publish(trainer, record, result)

    def publish(self, trainer: pl.Trainer, record: dict, result: evaluate.Result) -> None:
        """Rank 0: one milestone's record in evals.jsonl, its scores in TensorBoard (scalars, and the text tab
        with what failed) and the log."""
        step = record["step"]
        for task, why in result.errors.items():
            log.error("benchmark %s at step %d failed; the other tasks are kept: %s", task, step, why)
        rundir.append_evals(self.run_dir, record)
        metrics = {
            f"eval/{task}/{metric}": value
            for task, values in result.scores.items()
            if not is_core(task)
            for metric, value in values.items()
            if not metric.endswith("_stderr")
        }
        if result.core is not None:
            metrics |= core_metrics(result.core)
        for logger in trainer.loggers:  # at the index of the step's last batch, as Lightning logs val/loss
            logger.log_metrics(metrics, step=step - 1)
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("benchmarks", result.markdown(), global_step=step)
        log.info("step %d benchmarks (%.1f s): %s", step, record["seconds"], metrics)

    def score(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> evaluate.Result:
        """The model as it is at this step, through lm.evals' one entry: every rank its share of lm's own
        tasks (the counts summed), rank 0 the lm-eval tasks. A failure on any rank of lm's own scoring is
        agreed before the reduce (one `gather` per rank per milestone) and recorded for each of lm's own tasks
        with every failing rank's reason; lm-eval's failures are recorded by lm.evals itself."""
        gathered: list[list] = []  # the agreement, once this rank has taken part in it

        def agree(why: str | None) -> list:
            gathered.append(self.consensus.gather(trainer, why))
            return gathered[-1]

        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            if any(agree(None)):  # every rank got here but one that failed: leave with it, no reduce
                raise ScoringFailed("another rank's scoring failed")
            return trainer.strategy.reduce(tensor.to(pl_module.device), reduce_op="sum").cpu()

        try:
            return evaluate.evaluate(
                self.subject(trainer, pl_module), self.cfg, self.plan, harness_here=trainer.is_global_zero,
                rank=trainer.global_rank, world=trainer.world_size, reduce=reduce,
                progress=Progress(PROGRESS_S, log.info if trainer.is_global_zero else lambda _: None, "benchmarks"),
            )  # fmt: skip
        except (
            Exception
        ) as e:  # an out-of-memory, a changed file: this milestone's scores are lost, not the run
            why = f"{type(e).__name__}: {e}"
            if not isinstance(e, ScoringFailed):
                log.exception(
                    "benchmarks at step %d failed on rank %d", trainer.global_step, trainer.global_rank
                )
            if not gathered and self.plan is not None and trainer.world_size > 1:
                agree(why)  # the others agree in `reduce`: every rank takes part once
            reasons = gathered[-1] if gathered else [why]
            failed = "; ".join(f"rank {rank}: {r}" for rank, r in enumerate(reasons) if r is not None) or why
            return evaluate.Result(errors={task: failed for task in self.cfg.tasks})

    def subject(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> evaluate.Subject:
        """The training model as lm.evals scores it: its run's tokenizer, end of text and, for lm-eval, a
        transformers copy in the run's dtype."""
        datamodule = trainer.datamodule
        dtype = torch.bfloat16 if pl_module.device.type == "cuda" else torch.float32
        return evaluate.of_lm(
            pl_module.model, datamodule.data_dir / TOKENIZER, datamodule.cfg.eot_token, datamodule.eot_id,
            hf_dtype=dtype,
        )  # fmt: skip
