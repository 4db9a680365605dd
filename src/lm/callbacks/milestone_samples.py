"""MilestoneSampler: what the model writes at milestones, greedy and sampled, in samples.jsonl and TensorBoard.

Milestones are explicit steps, every N steps, each phase boundary and the last step of an invocation. The
loss says how much a model improved; the samples say at what (the seed's "Lake Seine" at 10K steps, real
institutions at 60K). Rank 0 generates with the KV cache while the other ranks wait at the next collective.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl

from lm.base.tables import samples_markdown
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestones import MilestoneCallback
from lm.config import PhaseConfig, SamplingConfig
from lm.interop.generate import complete
from lm.store import rundir

log = logging.getLogger(__name__)


class MilestoneSampler(MilestoneCallback):
    """Appends one record per prompt x mode x milestone to the run's samples.jsonl.

    The steps already sampled (`done`) are RunState's `samples`, saved with every checkpoint, so a resume
    never repeats or skips a milestone."""

    what = "milestone samples"

    def __init__(
        self, cfg: SamplingConfig, phases: list[PhaseConfig], meter: CostMeter, run_dir: Path
    ) -> None:
        super().__init__(cfg, phases, meter, run_dir)
        self.done = meter.run.samples

    # --- sampling ----------------------------------------------------------------------------------------

    def at_milestone(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Greedy and (if temperature > 0) seeded samples of every prompt at this step; rank 0 writes them."""
        if not self.claim(trainer, "milestone samples", "sample the checkpoint with `lm sample`"):
            return
        step = trainer.global_step
        self.meter.switch("eval")  # generation is paid for, but it is not training throughput
        tokens = self.meter.state.tokens
        # The phase the trained steps belong to: a sample at a boundary shows what the ending phase bought.
        phase = self.phase_name(step, tokens)
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
                            "phase": phase,
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
