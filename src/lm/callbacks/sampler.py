"""MilestoneSampler: what the model writes at milestones, greedy and sampled, in samples.jsonl and TensorBoard.

Milestones are explicit steps, every N steps, each phase boundary and the last step of an invocation. The
loss says how much a model improved; the samples say at what (the seed's "Lake Seine" at 10K steps, real
institutions at 60K). Rank 0 generates with the KV cache while the other ranks wait at the next collective.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lm import rundir
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.steps import StepWatch
from lm.config import PhaseConfig, SamplingConfig
from lm.generate import complete
from lm.parallel import is_sharded
from lm.plan import phase_at
from lm.tables import samples_markdown

log = logging.getLogger(__name__)


class MilestoneSampler(Callback):
    """Appends one record per prompt x mode x milestone to the run's samples.jsonl."""

    def __init__(
        self, cfg: SamplingConfig, phases: list[PhaseConfig], meter: CostMeter, run_dir: Path
    ) -> None:
        self.cfg = cfg
        self.phases = phases
        self.meter = meter
        self.run_dir = run_dir
        self.steps = StepWatch()
        self.done: set[int] = set()
        """Steps already sampled; in the checkpoint, so a resume never repeats or skips a milestone."""

    def is_milestone(self, step: int, tokens: int) -> bool:
        """Whether optimizer step `step` (with `tokens` trained) is a milestone other than the last step."""
        cfg = self.cfg
        if step in cfg.steps or (cfg.every_n_steps and step % cfg.every_n_steps == 0):
            return True
        if cfg.at_phase_ends and self.phases and step > 0:
            before = tokens - self.meter.tokens_per_step
            return phase_at(step, tokens, self.phases) != phase_at(step - 1, before, self.phases)
        return False

    # --- Lightning hooks ---------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.steps.ended(trainer):
            return
        step = trainer.global_step  # the meter, earlier in the list, has counted this step's tokens
        if step not in self.done and self.is_milestone(step, self.meter.state.tokens):
            self.sample(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.cfg.at_last_step and trainer.global_step > 0 and trainer.global_step not in self.done:
            self.sample(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"done": sorted(self.done)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = set(state["done"])

    # --- sampling ----------------------------------------------------------------------------------------

    def sample(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Greedy and (if temperature > 0) seeded samples of every prompt at this step; rank 0 writes them."""
        step = trainer.global_step
        self.done.add(step)
        if not trainer.is_global_zero:
            return
        if is_sharded(trainer.strategy):
            # Sharded weights need every rank in each forward; rank-0-only generation would hang.
            log.warning("milestone samples are skipped under FSDP; sample the checkpoint with `lm sample`")
            return
        self.meter.switch("eval")  # generation is paid for, but it is not training throughput
        tokens = self.meter.state.tokens
        # The phase the trained steps belong to: a sample at a boundary shows what the ending phase bought.
        index = phase_at(step - 1, tokens - self.meter.tokens_per_step, self.phases) if self.phases else None
        phase = (
            self.phases[index].name if index is not None and index < len(self.phases) else "after the plan"
        )
        modes = [("greedy", 0.0, None)]
        if self.cfg.temperature > 0:
            modes.append(("temperature", self.cfg.temperature, self.cfg.seed))
        tokenizer = trainer.datamodule.tokenizer
        records = []
        with trainer.precision_plugin.forward_context():
            for prompt in self.cfg.prompts:
                for mode, temperature, seed in modes:
                    text = complete(
                        pl_module.model,
                        tokenizer,
                        prompt,
                        self.cfg.max_new_tokens,
                        temperature=temperature,
                        top_k=self.cfg.top_k,
                        seed=seed,
                        stop_id=trainer.datamodule.eot_id,
                        fit_context=True,
                    )
                    records.append(
                        {
                            "step": step,
                            "tokens": tokens,
                            "phase": phase if self.phases else None,
                            "prompt": prompt,
                            "mode": mode,
                            "temperature": temperature,
                            "seed": seed,
                            "text": text,
                        }
                    )
        rundir.append_samples(self.run_dir, records)
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("samples", samples_markdown(records), global_step=step)
        self.meter.switch("train")
        log.info("step %d samples: %s", step, [r["text"][:60] for r in records if r["mode"] == "greedy"])
