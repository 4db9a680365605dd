"""The Custom Scalars layout, read back from the event file by TensorBoard's own reader: loss first, then
throughput and MFU; the cost cards and the loss-against-dollars chart only for a priced run."""

import re

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2, metadata
from tensorboard.util import tensor_util

from lm.store.tensorboard_layout import LOSS_BY_CENTS, write_layout


def written(tmp_path, priced: bool, mixture: bool = False) -> tuple[layout_pb2.Layout, EventAccumulator]:
    logger = TensorBoardLogger(save_dir=tmp_path, name="tb", version="")
    write_layout(logger, priced=priced, mixture=mixture)
    logger.experiment.add_scalar("train/loss", 5.0, 1)
    if priced:  # as the cost meter logs it: at step = whole cents spent ($0.237)
        logger.experiment.add_scalar(LOSS_BY_CENTS, 4.5, global_step=round(0.237 * 100))
    logger.experiment.flush()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={TENSORS: 0})
    events.Reload()
    (config,) = events.Tensors(metadata.CONFIG_SUMMARY_TAG)
    return layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item()), events


def charts(layout: layout_pb2.Layout) -> dict[str, list[str]]:
    return {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}


def shown(layout: layout_pb2.Layout, tag: str) -> list[str]:
    """The charts whose regular expressions match `tag`."""
    return [title for title, tags in charts(layout).items() if any(re.search(t, tag) for t in tags)]


@pytest.mark.parametrize("priced", [False, True])
def test_the_layout_opens_on_loss_then_throughput(tmp_path, priced):
    layout, _ = written(tmp_path, priced)
    titles = [cat.title for cat in layout.category]
    assert titles[:2] == ["loss", "throughput and MFU"]
    first = layout.category[0].chart[0]
    assert first.title == "train and validation loss, against steps"
    assert [bool(re.search(t, tag)) for tag in ("train/loss", "val/loss") for t in first.multiline.tag].count(
        True
    ) == 2
    for tag in ("perf/tokens_per_sec", "perf/mfu"):
        assert shown(layout, tag), tag
    assert shown(layout, "val/loss/web") == []  # no empty card where no source is logged


def test_a_mixture_shows_each_source(tmp_path):
    layout, _ = written(tmp_path, priced=False, mixture=True)
    assert shown(layout, "val/loss/web") == ["validation loss by source"]


def test_an_unpriced_run_shows_no_cost(tmp_path):
    layout, _ = written(tmp_path, priced=False)
    for tag in ("cost/usd", "cost/usd_per_billion_tokens", "cost/usd_train", LOSS_BY_CENTS):
        assert shown(layout, tag) == [], tag


def test_a_priced_run_shows_cost_and_loss_against_dollars(tmp_path):
    layout, events = written(tmp_path, priced=True)
    assert layout.category[-1].title == "cost"
    assert shown(layout, "cost/usd") == ["dollars spent"]
    assert shown(layout, "cost/usd_checkpoint") == ["dollars by bucket"]
    assert shown(layout, LOSS_BY_CENTS) == ["validation loss, against dollars (step axis = cents spent)"]
    (point,) = events.Scalars(LOSS_BY_CENTS)
    assert (point.step, point.value) == (24, 4.5)  # $0.237 -> 24 cents
