"""`RunState`: everything a checkpoint resumes besides the weights, the optimizer and the LR scheduler.

One typed record, saved whole under one key (`RUN_STATE`) of the checkpoint, never in pieces under the
callbacks' keys. The step's parts (the meter, the guards, the stopper, the phase table, the samples) keep
their live state in its sections and read each other's there; `snapshot()` is a deep, plain copy taken
when a save is staged, so no save (synchronous, or written in the background while training goes on) can
hold a value from a later step.

    meter       seconds per bucket, tokens, step, restarts          (the cost ledger)
    guards      non-finite and spike counters, the spike window, the data windows skipped after rollbacks
    stopper     validation points, best loss, patience count, the stop decision
    lr_cooldown the LR cooldown a stop started: (step, length), read by the LR schedule
    phases      closed rows of phases.csv and the start of the current phase
    samples     milestone steps already sampled
    rng         torch / numpy / python (/ CUDA) generators, captured at the snapshot
    settings    the stream settings the checkpoint was trained with (checked and logged on resume)
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from lm.store.rundir import BUCKETS

RUN_STATE = "run_state"
"""The checkpoint key RunState is saved under."""


@dataclass
class MeterState:
    """The cost ledger carried across resumes."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    tokens: int = 0
    step: int = 0
    restarts: int = 0

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


@dataclass
class GuardState:
    """The non-finite and spike guards' counters, the spike detector's window, the skipped data windows."""

    skipped: int = 0
    """Non-finite steps skipped in the whole run."""
    in_a_row: int = 0
    """Non-finite steps in a row at the checkpoint's step (a save inside a streak resumes inside it)."""
    spike_losses: deque[float] = field(default_factory=deque)
    """The last accepted losses the spike threshold is the median of."""
    spike_recent: deque[int] = field(default_factory=deque)
    """Steps of the spikes within the detector's window."""
    spikes: int = 0
    skip_windows: list[tuple[int, int]] = field(default_factory=list)
    """Data windows [first, last] the sampler moves past (rollbacks after spikes)."""


@dataclass
class ValPoint:
    """One validation point of the run, as the early stopper saw it."""

    step: int
    tokens: int
    usd: float | None
    loss: float
    """Validation loss as measured."""
    smoothed: float
    """After the EMA of `early_stopping.smoothing`; what the criteria read."""


@dataclass
class StopperState:
    """The early stopper's history and decision (stop.json is written from the decision)."""

    points: list[ValPoint] = field(default_factory=list)
    best: float = math.inf
    since_best: int = 0
    decision: dict[str, Any] | None = None


@dataclass
class PhaseState:
    """phases.csv's closed rows and the progress when the current phase began (None before the first step)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    start: dict[str, Any] | None = None


@dataclass
class RunState:
    """See the module docstring. Sections are replaced by `load` in place of the record's fields, so a part of
    the step reads them through the record (`state.meter.tokens`), never through a copy it kept."""

    meter: MeterState = field(default_factory=MeterState)
    guards: GuardState = field(default_factory=GuardState)
    stopper: StopperState = field(default_factory=StopperState)
    lr_cooldown: tuple[int, int] | None = None
    phases: PhaseState = field(default_factory=PhaseState)
    samples: set[int] = field(default_factory=set)
    rng: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def snapshot(self, rng: dict[str, Any] | None = None, settings: dict[str, Any] | None = None) -> dict:
        """A deep copy of the record as plain values (dicts, lists, numbers, strings, tensors), with the RNG
        and settings of this moment: what the checkpoint being staged holds, whatever happens next."""
        record = {
            f.name: plain(copy.deepcopy(getattr(self, f.name))) for f in fields(self) if f.name != "rng"
        }
        record["rng"] = copy.deepcopy(
            self.rng
        )  # kept as the generators return it (python's is nested tuples)
        if rng is not None:
            record["rng"] = copy.deepcopy(rng)
        if settings is not None:
            record["settings"] = plain(copy.deepcopy(settings))
        return record

    def load(self, record: dict[str, Any]) -> None:
        """Take a snapshot's values (sections a checkpoint lacks keep their defaults). Sections are updated in
        place, so a part of the step that holds one (the meter its `MeterState`) sees the restored values."""
        new = restored(copy.deepcopy(record))
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(new, f.name)
            if hasattr(mine, "__dataclass_fields__"):
                vars(mine).clear()
                vars(mine).update(vars(theirs))
            elif isinstance(mine, set):
                mine.clear()
                mine.update(theirs)
            else:
                setattr(self, f.name, theirs)


def restored(record: dict[str, Any]) -> RunState:
    """A RunState from a snapshot's plain values."""
    g, s, p = record.get("guards", {}), record.get("stopper", {}), record.get("phases", {})
    cooldown = record.get("lr_cooldown")
    m = record.get("meter", {})
    return RunState(
        meter=MeterState(
            seconds={**dict.fromkeys(BUCKETS, 0.0), **m.get("seconds", {})},
            tokens=m.get("tokens", 0),
            step=m.get("step", 0),
            restarts=m.get("restarts", 0),
        ),
        guards=GuardState(
            skipped=g.get("skipped", 0),
            in_a_row=g.get("in_a_row", 0),
            spike_losses=deque(g.get("spike_losses", [])),
            spike_recent=deque(g.get("spike_recent", [])),
            spikes=g.get("spikes", 0),
            skip_windows=[(int(a), int(b)) for a, b in g.get("skip_windows", [])],
        ),
        stopper=StopperState(
            points=[ValPoint(**point) for point in s.get("points", [])],
            best=s.get("best", math.inf),
            since_best=s.get("since_best", 0),
            decision=s.get("decision"),
        ),
        lr_cooldown=(int(cooldown[0]), int(cooldown[1])) if cooldown is not None else None,
        phases=PhaseState(rows=list(p.get("rows", [])), start=p.get("start")),
        samples=set(record.get("samples", [])),
        rng=record.get("rng"),
        settings=dict(record.get("settings", {})),
    )


def plain(value: Any) -> Any:
    """`value` as dicts, lists and scalars (dataclasses, deques, sets and tuples turned into them); sets
    sorted, so a snapshot is the same whatever order they were filled in."""
    if hasattr(value, "__dataclass_fields__"):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, set):
        return sorted(plain(v) for v in value)
    if isinstance(value, list | tuple | deque):
        return [plain(v) for v in value]
    return value


def from_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The RunState record of a checkpoint; one written before RunState existed (its state spread over the
    callbacks' keys, `lr_cooldown` and `resume_settings`) is gathered into one; None when it has neither."""
    if RUN_STATE in checkpoint:
        return checkpoint[RUN_STATE]
    callbacks = checkpoint.get("callbacks") or {}
    if not callbacks and "lr_cooldown" not in checkpoint:
        return None

    def kept(name: str) -> dict[str, Any]:
        return next((v for k, v in callbacks.items() if k.split("{")[0] == name), {})

    nonfinite, spike, stopper = kept("NonFiniteGuard"), kept("SpikeGuard"), kept("EarlyStopper")
    detector = spike.get("detector", {})
    phases = kept("PhaseTracker")
    return {
        "meter": kept("CostMeter") or {},
        "guards": {
            "skipped": nonfinite.get("skipped", 0),
            "in_a_row": nonfinite.get("in_a_row", 0),
            "spike_losses": detector.get("losses", []),
            "spike_recent": detector.get("recent", []),
            "spikes": detector.get("spikes", 0),
            "skip_windows": spike.get("skip_windows", []),
        },
        "stopper": {k: stopper[k] for k in ("points", "best", "since_best", "decision") if k in stopper},
        "lr_cooldown": checkpoint.get("lr_cooldown"),
        "phases": {"rows": phases.get("rows", []), "start": phases.get("start")},
        "samples": kept("MilestoneSampler").get("done", []),
        "rng": kept("SpotGuard").get("rng"),
        "settings": checkpoint.get("resume_settings", {}),
    }


def rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from, as tensors and plain values (so checkpoints still load
    with `weights_only=True`)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
