"""The run's TensorBoard layout: its Custom Scalars tab opens on the run's story, loss first, then throughput and
MFU, the step's health, the forecast and phases, and the dollars only when the run is priced (an unpriced run's
`cost/*` are all 0: cards that say nothing).

TensorBoard cannot draw one scalar against another, so loss against dollars is its own tag, `LOSS_BY_CENTS`:
the validation loss at a step that counts whole cents spent, for the cost meter (which knows the dollars) to log.
"""

import functools
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment

from lm.store.atomic import keep

LOSS_BY_CENTS = "val/loss_by_cents"
"""Validation loss logged at step = cents spent: TensorBoard's step axis read as dollars x 100."""

Layout = dict[str, dict[str, list[Any]]]


def multiline(*tags: str) -> list[Any]:
    """One chart of every scalar whose tag matches one of the regular expressions."""
    return ["Multiline", list(tags)]


def layout(priced: bool, mixture: bool = False) -> Layout:
    """The Custom Scalars layout, categories in the order they are shown: {category: {chart title: chart}}.
    `mixture`: a chart of each source's validation loss (`val/loss/<name>`), which only a mixture logs."""
    loss = {"train and validation loss, against steps": multiline(r"^train/loss$", r"^val/loss$")}
    if mixture:
        loss["validation loss by source"] = multiline(r"^val/loss/")
    loss["validation bits per byte"] = multiline(r"^val/bpb$")
    if priced:
        loss["validation loss, against dollars (step axis = cents spent)"] = multiline(f"^{LOSS_BY_CENTS}$")
    story: Layout = {
        "loss": loss,
        "throughput and MFU": {
            "tokens per second": multiline(r"^perf/tokens_per_sec$"),
            "MFU": multiline(r"^perf/mfu$"),
            "peak memory, GB": multiline(r"^perf/peak_mem_gb$"),
        },
        "the step's health": {
            "gradient norm": multiline(r"^train/grad_norm$"),
            "learning rate": multiline(r"^train/lr$"),
            "skipped steps and spikes": multiline(r"^train/skipped_steps$", r"^train/spikes$"),
        },
        "forecast, stopping and phases": {
            "forecast final loss": multiline(r"^forecast/loss_"),
            "smoothed validation loss (stopper)": multiline(r"^stop/"),
            "phase and tokens": multiline(r"^phase/index$", r"^train/tokens$"),
            "benchmarks": multiline(r"^eval/"),
        },
    }
    if priced:
        story["cost"] = {
            "dollars spent": multiline(r"^cost/usd$"),
            "dollars per billion tokens": multiline(r"^cost/usd_per_billion_tokens$"),
            "dollars per loss point": multiline(
                r"^cost/usd_per_loss_point$", r"^forecast/usd_per_loss_point"
            ),
            "dollars by bucket": multiline(r"^cost/usd_(startup|train|eval|checkpoint|restart)$"),
        }
    return story


def write_layout(logger: TensorBoardLogger, priced: bool, mixture: bool = False) -> None:
    """Write the layout into the run's event file (rank 0: other ranks' loggers write nothing). A resumed run
    writes it again; TensorBoard shows the newest."""
    logger.experiment.add_custom_scalars(layout(priced, mixture))


def log_loss_by_cost(logger: TensorBoardLogger, loss: float, usd: float) -> None:
    """Log a validation loss against the dollars spent so far (`LOSS_BY_CENTS`, step = whole cents)."""
    logger.experiment.add_scalar(LOSS_BY_CENTS, loss, global_step=round(usd * 100))


class RunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, whose writes under a run directory that defers its failures
    (`lm.store.atomic.defer`, while the run trains) keep an error instead of raising it: TensorBoard's writer
    thread dies on a removed folder or a full disk and re-raises in the next write on rank 0 alone (in
    Lightning's logging of the step), so every rank stops together at the step boundary instead."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        return KeptWrites(TensorBoardLogger.experiment.fget(self), self.log_dir)


class KeptWrites:
    """A SummaryWriter whose methods keep a failed write (`lm.store.atomic.keep`)."""

    def __init__(self, writer: Any, where: str) -> None:
        self._writer, self._where = writer, where

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._writer, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def kept(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except OSError as e:
                keep(self._where, e)
                return None

        return kept
