"""No host-device synchronisation in the hot path: between logging steps, a training step never asks the
device for a value. On a GPU each such read (`.item()`, `bool(t)`, `float(t)`, `.cpu()`, ...) stalls the
host until every queued kernel has finished, so the next step's kernels are not queued in time.

A CPU has no device queue to stall, but the reads are the same Python calls: a TorchFunctionMode sees each one
and the step it happened in, on a real tiny run through lm's whole callback stack."""

import collections
import traceback

import lightning.pytorch as pl
from torch.overrides import TorchFunctionMode

from lm import train as lm_train

# Tensor methods that copy a value to the host (on a GPU: wait for the device).
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero"}


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values per training step, with the line of lm or Lightning that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.step: int | None = None  # None outside training steps (setup, validation)
        self.reads: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        staged = bool(args) and getattr(args[0], "host_staging", False)  # a host copy, read on purpose
        if self.step is not None and name in READS and not staged:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
            self.reads[self.step][f"{name} at {caller.filename}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


class StepMarker(pl.Callback):
    def __init__(self, reads: HostReads) -> None:
        self.reads = reads

    def on_train_batch_start(self, trainer, *args) -> None:
        self.reads.step = trainer.global_step

    def on_validation_start(self, trainer, *args) -> None:
        self.reads.step = None

    def on_validation_end(self, trainer, *args) -> None:
        self.reads.step = trainer.global_step


def test_training_steps_between_logging_steps_never_read_the_device(tiny_cfg, monkeypatch):
    steps, every = 25, 10
    cfg = tiny_cfg(
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={every}",
        "trainer.val_every_steps=100",
        "trainer.enable_progress_bar=true",  # the bar shows the loss: it must not read it every step
        "optim.fused=true",  # as on a GPU: AdamW's step count stays on the device
        "phases.phases=[]",
        "sampling=off",
        "checkpoint.every_n_steps=100",
        "data.num_workers=0",
    )
    reads = HostReads()
    factory = lm_train.run_callbacks
    monkeypatch.setattr(lm_train, "run_callbacks", lambda *a, **k: [StepMarker(reads), *factory(*a, **k)])
    with reads:
        lm_train.main(cfg)

    assert sorted(reads.reads), "the probe saw no training step"
    logging_steps = {s for s in range(steps) if (s + 1) % every == 0}
    allowed = {0, steps - 1} | logging_steps  # setup, the final save and evaluation, and the logger
    hot = {s: dict(c) for s, c in reads.reads.items() if s not in allowed}
    assert not hot, f"host reads of device values inside training steps: {hot}"
    # The probe does see reads: the logger converts the step's metrics at each logging step.
    assert any(s in reads.reads for s in logging_steps)
