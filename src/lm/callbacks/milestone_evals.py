"""BenchmarkEvaluator: benchmarks at milestones, priced, in evals.jsonl and TensorBoard.

The loss says how much a phase improved the model; benchmarks say what that bought in the units models are
compared by (DCLM CORE, HellaSwag, ARC-Easy...). Milestones are each phase boundary, chosen steps and the
last step of an invocation. CORE and the `@olmo` sets are scored by lm itself (lm.interop.offline): every
rank scores its share of each task's items on its own copy of the model and the counts are summed across
ranks, so every rank holds the same figure. lm-evaluation-harness tasks run on rank 0 on an in-memory
`transformers` copy while the other ranks wait at the next collective. The time is charged to the `eval`
bucket, so tokens/s and MFU stay training's.

A benchmark that fails at a milestone (an out-of-memory in the scorer, a task file changed under the run, a
harness task's data out of reach) is recorded under `errors` in that milestone's evals.jsonl line, the other
tasks' scores kept, and training goes on. CORE's failure on any rank is agreed before the counts' reduce
(`Consensus.gather`), so every rank reaches the same collectives and rank 0 records every rank's reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import astuple
from pathlib import Path

import lightning.pytorch as pl
import torch
from tokenizers import Tokenizer

from lm.base.tables import evals_markdown
from lm.callbacks.consensus import Consensus
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestones import MilestoneCallback
from lm.config import EvalsConfig, PhaseConfig
from lm.data.manifest import TOKENIZER
from lm.engine.parallel import is_sharded
from lm.interop import hf, offline
from lm.interop.evaluation import generators_kept, score, task_manager
from lm.interop.scorer import Scorer
from lm.store import rundir

log = logging.getLogger(__name__)


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
        self.consensus = consensus
        """The run's agreement across ranks: a CORE failure on any rank, before the counts' reduce."""
        self.own = [t for t in cfg.tasks if offline.is_offline(t)]
        self.harness = [t for t in cfg.tasks if not offline.is_offline(t)]
        self.plan: offline.Plan | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # An unknown task, a missing or changed CORE file: refused before the first step, not at a milestone,
        # and on every rank alike (a refusal on rank 0 alone would leave the others in the first collective).
        if self.own:
            cfg = self.cfg
            self.plan = offline.resolve(self.own, cfg.data_dir, partial=cfg.partial, fill_olmo=cfg.fill_olmo)
        if self.harness:
            task_manager(self.harness, self.cfg.include_path)

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
        scores: dict[str, dict[str, float]] = {}
        errors: dict[str, str] = {}
        core = None
        with generators_kept(pl_module.device):
            if self.plan is not None:  # every rank: each scores its share, the counts are summed
                scores, core, errors = self.score_own(trainer, pl_module)
            if self.harness and trainer.is_global_zero:
                try:
                    more, failed = self.run_tasks(trainer, pl_module)
                    scores, errors = scores | more, errors | failed
                except Exception as e:  # a benchmark's data out of reach must not end a paid-for run
                    log.exception("lm-evaluation-harness tasks at step %d failed", step)
                    errors |= {task: f"{type(e).__name__}: {e}" for task in self.harness}
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
        self.publish(trainer, record)

    def publish(self, trainer: pl.Trainer, record: dict) -> None:
        """Rank 0: one milestone's record in evals.jsonl, its scores in TensorBoard (scalars and the text tab,
        with what failed) and the log."""
        step, scores, core, errors = (
            record["step"],
            record["scores"],
            record.get("core"),
            record.get("errors", {}),
        )
        for task, why in errors.items():
            log.error("benchmark %s at step %d failed; the other tasks are kept: %s", task, step, why)
        rundir.append_evals(self.run_dir, record)
        metrics = {
            f"eval/{task}/{metric}": value
            for task, values in scores.items()
            if task != "core" and not task.startswith("core:")
            for metric, value in values.items()
            if not metric.endswith("_stderr")
        }
        if core is not None:
            metrics["eval/core"] = core["value"]
            metrics |= {f"eval/core/{label}": value for label, value in core["tasks"].items()}
        for logger in trainer.loggers:  # at the index of the step's last batch, as Lightning logs val/loss
            logger.log_metrics(metrics, step=step - 1)
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            text = (offline.core_markdown(core) + "\n\n" if core else "") + evals_markdown(
                {t: m for t, m in scores.items() if t != "core" and not t.startswith("core:")}
            )
            text += "".join(f"\n\nfailed: {task}: `{why}`" for task, why in errors.items())
            experiment.add_text("benchmarks", text, global_step=step)
        log.info("step %d benchmarks (%.1f s): %s", step, record["seconds"], metrics)

    def score_own(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[dict, dict | None, dict[str, str]]:
        """CORE and the @olmo tasks on this rank's share of the items, summed over every rank: (scores, the
        CORE record, task -> why it failed). A failure on any rank is agreed first (one round, every rank):
        then no rank reduces and every task is recorded as failed with each failing rank's reason."""
        try:
            counts = self.count_share(trainer, pl_module)
            why = None
        except Exception as e:  # an out-of-memory, a changed file: this milestone's CORE is lost, not the run
            log.exception("CORE at step %d failed on rank %d", trainer.global_step, trainer.global_rank)
            counts, why = {}, f"{type(e).__name__}: {e}"
        reasons = self.consensus.gather(trainer, why)
        failed = "; ".join(f"rank {rank}: {r}" for rank, r in enumerate(reasons) if r is not None)
        if failed:
            return {}, None, {task: failed for task in self.own}
        if trainer.world_size > 1:
            local = torch.tensor([astuple(counts[d.label]) for d in self.plan.tasks], dtype=torch.float64)
            summed = trainer.strategy.reduce(local.to(pl_module.device), reduce_op="sum").cpu()
            counts = {
                d.label: offline.Counts(*(round(x) for x in row))
                for d, row in zip(self.plan.tasks, summed.tolist())
            }
        return *offline.summary(self.plan, counts, self.cfg.limit), {}

    def count_share(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, offline.Counts]:
        """This rank's counts over its share of each task's items (every `world`-th one), not yet summed."""
        datamodule = trainer.datamodule
        tokenizer = Tokenizer.from_file(str(datamodule.data_dir / TOKENIZER))
        scorer = Scorer(pl_module.model, tokenizer, datamodule.eot_id, rows=self.cfg.batch_size)
        counts, _ = offline.score_tasks(
            scorer,
            self.plan.tasks,
            limit=self.cfg.limit,
            rank=trainer.global_rank,
            world=trainer.world_size,
        )
        return counts

    def run_tasks(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
        """The lm-evaluation-harness tasks on an in-memory `transformers` copy of the model, on the model's
        device: (task -> metric -> value, task -> why it failed)."""
        datamodule = trainer.datamodule
        dtype = torch.bfloat16 if pl_module.device.type == "cuda" else torch.float32
        model = hf.to_hf_model(pl_module.model, eos_id=datamodule.eot_id, dtype=dtype).to(pl_module.device)
        tokenizer = hf.hf_tokenizer(datamodule.data_dir / TOKENIZER, datamodule.cfg.eot_token)
        cfg = self.cfg
        out = score(
            model,
            tokenizer,
            self.harness,
            limit=cfg.limit,
            include_path=cfg.include_path,
            batch_size=cfg.batch_size,
        )
        return out["scores"], out["errors"]
