"""No host-device synchronisation in the hot path: between logging steps, a training step never asks the
device for a value. On a GPU each such read (`.item()`, `bool(t)`, `float(t)`, `.cpu()`, ...) stalls the
host until every queued kernel has finished, so the next step's kernels are not queued in time.

A CPU has no device queue to stall, but the reads are the same Python calls: a TorchFunctionMode sees each one
and the step it happened in, on a real tiny run through lm's whole callback stack."""

import collections
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch.overrides import TorchFunctionMode

from lm.run import build
from lm.run import train as lm_train

from ..conftest import CONF, TINY

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


class WatchReads(StepMarker):
    """The probe as a run's callback (`+callbacks.watch._target_=tests.callbacks.test_sync.WatchReads`), for processes a
    test starts: each rank writes its per-step reads to `<out>/reads-<rank>.json` at teardown."""

    def __init__(self, out: str) -> None:
        super().__init__(HostReads())
        self.out = Path(out)

    def setup(self, trainer, pl_module, stage) -> None:
        self.reads.__enter__()

    def teardown(self, trainer, pl_module, stage) -> None:
        self.reads.__exit__(None, None, None)
        record = {str(step): dict(sites) for step, sites in self.reads.reads.items()}
        (self.out / f"reads-{trainer.global_rank}.json").write_text(json.dumps(record))


STEPS, EVERY = 25, 10
HOT_PATH = [
    f"trainer.max_steps={STEPS}",
    f"trainer.log_every_n_steps={EVERY}",
    "trainer.val_every_steps=100",
    "trainer.enable_progress_bar=true",  # the bar shows the loss: it must not read it every step
    "optim.fused=true",  # as on a GPU: AdamW's step count stays on the device
    "phases.phases=[]",
    "sampling=off",
    "checkpoint.every_n_steps=100",
    "data.num_workers=0",
]


def hot_reads(reads: dict[int, dict]) -> dict[int, dict]:
    """Reads at steps other than the first, the last (the final save and evaluation) and logging steps."""
    logging_steps = {s for s in range(STEPS) if (s + 1) % EVERY == 0}
    allowed = {0, STEPS - 1} | logging_steps
    return {s: dict(c) for s, c in reads.items() if s not in allowed}


def test_training_steps_between_logging_steps_never_read_the_device(tiny_cfg, monkeypatch):
    steps, every = STEPS, EVERY
    cfg = tiny_cfg(*HOT_PATH)
    reads = HostReads()
    factory = build.build_callbacks
    monkeypatch.setattr(build, "build_callbacks", lambda *a, **k: [StepMarker(reads), *factory(*a, **k)])
    with reads:
        lm_train.main(cfg)

    assert sorted(reads.reads), "the probe saw no training step"
    logging_steps = {s for s in range(steps) if (s + 1) % every == 0}
    hot = hot_reads(reads.reads)  # setup, the final save and evaluation, and the logger are allowed
    assert not hot, f"host reads of device values inside training steps: {hot}"
    # The probe does see reads: the logger converts the step's metrics at each logging step.
    assert any(s in reads.reads for s in logging_steps)


@pytest.mark.slow  # 14-22 s on 2 cores: headroom under the README command's 10 min
def test_ddp_ranks_agree_on_stops_without_reading_the_device_every_step(tmp_path, data_cache):
    """Two gloo ranks under torchrun, with every per-step agreement active (a stop signal, the throughput
    alarm past its baseline, a budget cap): no rank reads a device value between logging steps. Lightning's
    `reduce_boolean_decision` would: an all-reduce, then `bool(tensor)` at every optimizer step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"]
    args = [
        *(o for o in TINY if not o.startswith(("trainer=", "data.num_workers="))),
        *HOT_PATH,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "+trainer.extra.num_sanity_val_steps=0",
        "guards.baseline_warmup=1",  # the alarm agrees on every step after its baseline
        "guards.baseline_steps=2",
        "early_stopping=budget",  # the budget is agreed on at every step
        "early_stopping.budget_usd=1000000",
        "cost.price_per_hour=1.0",
        f"run.root={tmp_path / 'runs'}",
        f"data.cache_dir={data_cache}",
        "+callbacks.watch._target_=tests.callbacks.test_sync.WatchReads",
        f"+callbacks.watch.out={tmp_path}",
    ]
    root = CONF.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    out = subprocess.run([*cmd, *args], cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in (0, 1):
        reads = {int(s): c for s, c in json.loads((tmp_path / f"reads-{rank}.json").read_text()).items()}
        assert len(reads) > 1, f"rank {rank}: the probe saw no training step"
        hot = hot_reads(reads)
        assert not hot, f"rank {rank}: host reads of device values inside training steps: {hot}"


def test_no_number_is_logged_from_the_host_inside_a_training_step(tiny_cfg, monkeypatch):
    """Issue 54: `self.log(name, <python number>)` makes a device tensor from a host number, on a GPU a
    host-to-device copy that waits for every kernel queued so far: `train/lr`, `train/spikes` and `phase/index`
    did so at every step. A CPU has nothing to wait for, so the calls themselves are counted (with the phase
    tracker and the spike guard on)."""
    cfg = tiny_cfg(*(o for o in HOT_PATH if o != "phases.phases=[]"))
    reads = HostReads()
    factory = build.build_callbacks
    monkeypatch.setattr(build, "build_callbacks", lambda *a, **k: [StepMarker(reads), *factory(*a, **k)])
    numbers: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    log = pl.LightningModule.log

    def counting_log(module, name, value, *args, **kwargs):
        if reads.step is not None and isinstance(value, int | float):
            numbers[reads.step][name] += 1
        return log(module, name, value, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", counting_log)
    lm_train.main(cfg)
    assert sorted(numbers), "the probe saw no number logged: the logging steps log the meter's"
    hot = hot_reads(numbers)
    assert not hot, f"numbers logged from the host inside training steps: {hot}"
