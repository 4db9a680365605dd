"""PhaseTracker: what each phase of a run cost and bought, as rows of `phases.csv` and TensorBoard text
(CORE at each phase's end, with its gain and dollars per 0.01 CORE, where `evals=` scores it)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lm.base.scores import core_name, gain, usd_per_centi_core
from lm.base.tables import phases_markdown
from lm.callbacks.cost_meter import CostMeter
from lm.config import PhaseConfig
from lm.engine.module import DeviceScalar
from lm.numbers.run_plan import phase_at
from lm.store import rundir

log = logging.getLogger(__name__)


class PhaseTracker(Callback):
    """Logs `phase/index`; at each phase boundary evaluates the validation loss and closes the phase's row.

    Loss at a boundary is measured on the same validation windows as `val/loss` (the first
    `eval_batches` batches of the fixed validation split), at exactly the boundary step: a fixed set, so no
    smoothing is needed and start and end losses of a phase are comparable. The row's money and hours come
    from the CostMeter, so they include evaluation, checkpoint writes and restarts within the phase.
    """

    def __init__(self, phases: list[PhaseConfig], meter: CostMeter, run_dir: Path, eval_batches: int) -> None:
        self.phases = phases
        self.meter = meter
        self.run_dir = run_dir
        self.eval_batches = eval_batches
        self.table = meter.run.phases
        """The closed rows and the current phase's start, in the run's RunState (the meter's)."""
        self.index_scalar = DeviceScalar()  # phase/index at every step, without a host-to-device copy

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.table.rows

    @property
    def start(self) -> dict[str, Any] | None:
        """Progress when the current phase began (None before the first step of a fresh run)."""
        return self.table.start

    # --- Lightning hooks ---------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.start is None:  # a fresh run (a resumed one restored its phase start from the checkpoint)
            self.table.start = self.snapshot(trainer, pl_module)

    def at_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At each optimizer step, once the step boundary has counted it: close the phase it ended."""
        if self.start is None:
            return
        index = self.index(trainer)
        pl_module.log("phase/index", self.index_scalar(index, pl_module.device), on_step=True, on_epoch=False)
        if index > self.start["phase"] and self.start["phase"] < len(self.phases):
            end = self.snapshot(trainer, pl_module)
            self.rows.append(self.row(self.start, end, status="done"))
            log.info("phase %d (%s) done: %s", self.start["phase"] + 1, self.rows[-1]["name"], self.rows[-1])
            self.table.start = end
            self.write(trainer, partial=None)

    def at_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At train end, once the last step is saved (the step boundary calls it): the phase's partial row."""
        if self.start is None or self.start["phase"] >= len(self.phases):
            return
        if trainer.global_step > self.start["step"]:
            self.write(
                trainer, partial=self.row(self.start, self.snapshot(trainer, pl_module), status="partial")
            )

    # --- phase accounting --------------------------------------------------------------------------------

    def index(self, trainer: pl.Trainer) -> int:
        return phase_at(trainer.global_step, self.meter.state.tokens, self.phases)

    def snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Progress, money and validation loss right now."""
        self.meter.switch("eval")
        loss, by_source = evaluate(trainer, pl_module, self.eval_batches)
        self.meter.switch("train")
        m = self.meter.state
        return {
            "phase": self.index(trainer),
            "step": trainer.global_step,
            "tokens": m.tokens,
            "seconds": m.total_seconds,
            "train_seconds": m.seconds["train"],
            "loss": loss,
            "source_losses": by_source,
        }

    def row(self, start: dict[str, Any], end: dict[str, Any], status: str) -> dict[str, Any]:
        phase = self.phases[start["phase"]]
        seconds = end["seconds"] - start["seconds"]
        usd = self.meter.usd(seconds)
        drop = start["loss"] - end["loss"]
        train_seconds = end["train_seconds"] - start["train_seconds"]
        tokens = end["tokens"] - start["tokens"]
        return {
            "phase": start["phase"] + 1,
            "name": phase.name,
            "status": status,
            "start_step": start["step"],
            "end_step": end["step"],
            "steps": end["step"] - start["step"],
            "tokens": tokens,
            "wall_hours": seconds / 3600,
            "start_loss": start["loss"],
            "end_loss": end["loss"],
            "loss_drop": drop,
            "usd": usd,
            "usd_per_loss_point": usd / drop if usd is not None and drop > 0 else None,
            "tokens_per_sec": tokens / train_seconds if train_seconds > 0 else None,
            "goal_loss": phase.goal_loss,
            "goal_met": None if phase.goal_loss is None else end["loss"] <= phase.goal_loss,
            "source_losses": " ".join(f"{k}={v:.3f}" for k, v in end.get("source_losses", {}).items())
            or None,
        }

    def write(self, trainer: pl.Trainer, partial: dict[str, Any] | None) -> None:
        """Rewrite phases.csv (atomically) and put the table into TensorBoard's text tab; rank 0 only."""
        if not trainer.is_global_zero:
            return
        rows = with_core(self.rows + ([partial] if partial else []), rundir.read_evals(self.run_dir))
        rundir.write_phases(self.run_dir, rows)
        experiment = getattr(trainer.logger, "experiment", None)
        if experiment is not None and hasattr(experiment, "add_text"):
            experiment.add_text("phases", phases_markdown(rows), global_step=trainer.global_step)


def with_core(rows: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each phase row with the CORE scored at its end step (evals.jsonl; the benchmark callback runs before
    this one at a boundary), what the phase added since its start's CORE and the dollars per 0.01 CORE."""
    scored = {r["step"]: r["core"] for r in evals if r.get("core")}
    out = []
    for row in rows:
        end, start = scored.get(row["end_step"]), scored.get(row["start_step"])
        extra: dict[str, Any] = {}
        if end:
            extra = {"core_label": core_name(end), "core": end["value"], "core_stderr": end.get("stderr")}
            moved = gain(end, start)
            if moved is not None:
                delta, _ = moved
                extra |= {"core_gain": delta, "usd_per_0.01_core": usd_per_centi_core(row.get("usd"), delta)}
        out.append({**row, **extra})
    return out


def evaluate(
    trainer: pl.Trainer, pl_module: pl.LightningModule, max_batches: int
) -> tuple[float, dict[str, float]]:
    """Mean loss over the first `max_batches` validation batches, under the run's precision; and with a data
    mixture, each source's mean over its batches among them (`val/loss/<source>` at this step)."""
    datamodule = trainer.datamodule
    batches = datamodule.val_batch_list()
    windows = datamodule.val_set
    was_training = pl_module.training
    pl_module.eval()
    losses, sizes, sources = [], [], []
    with torch.no_grad(), trainer.precision_plugin.forward_context():
        # The windows val/loss uses, split across ranks alike.
        for b, idx in enumerate(batches[: max(1, max_batches)]):
            x = torch.stack([windows[i] for i in idx]).to(pl_module.device)
            losses.append(pl_module.loss(x))
            sizes.append(len(idx))
            sources.append(datamodule.val_source(b))
    pl_module.train(was_training)

    def mean(picked: list[int]) -> float:
        # Weighted by batch size, as Lightning averages `val/loss` (a last, partial batch counts less).
        weights = torch.tensor([float(sizes[i]) for i in picked], device=losses[0].device)
        value = (torch.stack([losses[i].float() for i in picked]) * weights).sum() / weights.sum()
        return float(trainer.strategy.reduce(value, reduce_op="mean"))

    every = range(len(losses))
    by_source = {s: mean([i for i in every if sources[i] == s]) for s in dict.fromkeys(sources) if s}
    return mean(list(every)), by_source  # the same numbers on every rank
