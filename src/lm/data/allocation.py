"""Which source each training sample of a mixture comes from: pure arithmetic on weights, caps and phases.

No tensors, files or trainer here: the answer is a function of the sources' sizes, weights and caps, the
phases and the samples per step, so every rank and every resumed process computes the same one, and the
doctor computes it from the manifests alone.

Interleave. Within a stretch of constant weights w, source k "ticks" at position p when
floor((p+1)·w_k + ½) > floor(p·w_k + ½): a Bresenham line of slope w_k, so among any P consecutive positions it
ticks P·w_k ± 1 times. Reading the ticks in (position, source) order gives one stream: sample t is the t-th tick,
and it is that source's j-th sample with j its ticks before. Both are closed forms of t, so which window a sample
is stays a pure function of (seed, sample index, weights): StepSampler's step-and-rank indexing of samples is
kept unchanged, and with it exact resume and world-size changes. Over any run of n consecutive samples a
source's share is within about K/n of its weight (K sources), far tighter than drawing sources at random.

Segments. Weights are piecewise constant over optimizer steps: a phase with its own weights (PhaseConfig.mixture)
or a source reaching its max_epochs cap under `data.on_exhausted=renormalise` starts a new segment, which
continues every source's count where the previous one left it. Under `stop` the allocation ends at the step
that would take a source past its cap. The Allocation is the whole run's list of segments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lm.base.exits import Refused
from lm.config import MixtureSource, PhaseConfig


class Interleave:
    """Which source each sample of a constant-weight stretch belongs to, and its index within that source."""

    def __init__(self, weights: Sequence[float]):
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()

    def ticks_before(self, p: np.ndarray) -> np.ndarray:
        """(..., K) ticks of each source at positions before `p`."""
        return np.floor(p[..., None] * self.weights + 0.5).astype(np.int64)

    def span(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Samples first..first+n-1: their sources (n,), their indices within their sources (n,), and each
        source's samples before `first` (K,)."""
        k = len(self.weights)
        # Ticks before position p lie within K/2 of p, so positions lo..first+n+K+1 hold all n samples.
        lo = max(0, first - k - 1)
        before = self.ticks_before(np.arange(lo, first + n + k + 2))  # (P, K)
        pos, source = np.nonzero(before[1:] - before[:-1])  # every tick of the range, in stream order
        skip = first - int(before[0].sum())
        index = before[pos, source]
        counts = before[0] + np.bincount(source[:skip], minlength=k)
        return source[skip : skip + n], index[skip : skip + n], counts

    def locate(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of samples first..first+n-1."""
        source, index, _ = self.span(first, n)
        return source, index

    def counts(self, n: int) -> np.ndarray:
        """(K,) samples of each source among the first n."""
        return self.span(n, 0)[2]


@dataclass(frozen=True)
class Segment:
    """Stream steps from `start` on drawn with one interleave, every source's count continuing from `base`."""

    start: int
    interleave: Interleave
    base: np.ndarray

    def counts_after(self, steps: int, per_step: int) -> np.ndarray:
        """Samples of each source drawn once `steps` steps of this segment have run."""
        return self.base + self.interleave.counts(steps * per_step)


class Allocation:
    """The mixture over a whole run: its segments, and the step where it stops (a source's cap, `stop`).

    A pure function of the sources (windows, weights, caps), the phases, `data.on_exhausted` and the samples
    per step (global batch), so every rank and every resumed process builds the same one.
    """

    def __init__(
        self,
        sources: Sequence[MixtureSource],
        windows: Sequence[int],
        per_step: int,
        on_exhausted: str = "stop",
        phases: Sequence[PhaseConfig] = (),
        seq_len: int = 1,
    ):
        self.names = [s.name for s in sources]
        self.windows = np.asarray(windows, dtype=np.int64)
        self.per_step = per_step
        self.caps = [
            None if s.max_epochs is None else math.floor(s.max_epochs * n) for s, n in zip(sources, windows)
        ]
        self.segments: list[Segment] = []
        self.stop_step: int | None = None
        """First stream step that would take a source past its cap under `stop`; None: never."""
        self.stopped_by: str | None = None
        """The source whose cap sets stop_step (None when every source with weight was used up)."""
        self.exhausted: dict[str, int] = {}
        """Source name -> the stream step from which its cap keeps it out of the mixture."""
        base = np.array([s.weight for s in sources], dtype=np.float64)
        counts = np.zeros(len(sources), dtype=np.int64)
        for start, end, weights in periods(base, self.names, phases, per_step * seq_len):
            counts = self.add_period(start, end, weights, counts, on_exhausted)
            if self.stop_step is not None:
                break
        if not self.segments:
            raise Refused(
                f"data.mixture source '{self.stopped_by}' meets its max_epochs cap before the first step ends: "
                f"raise its max_epochs or lower its weight"
            )
        self.starts = np.array([s.start for s in self.segments], dtype=np.int64)

    def add_period(
        self, start: int, end: int | None, weights: np.ndarray, counts: np.ndarray, on_exhausted: str
    ) -> np.ndarray:
        """Segments for stream steps [start, end) with `weights`, split where a source meets its cap."""
        while True:
            w = weights.copy()
            w[[self.names.index(n) for n in self.exhausted]] = 0
            if not w.sum() > 0:  # every source with weight here is used up
                self.stop_step = start
                return counts
            segment = Segment(start, Interleave(w), counts)
            hit = self.first_cap(segment, end)
            if hit is None or hit[0] > start:
                self.segments.append(segment)
            if hit is None:
                return segment.counts_after(end - start, self.per_step) if end is not None else counts
            step, k = hit
            counts = segment.counts_after(step - start, self.per_step)
            if on_exhausted == "stop":
                self.stop_step, self.stopped_by = step, self.names[k]
                return counts
            self.exhausted[self.names[k]] = step
            start = step

    def first_cap(self, segment: Segment, end: int | None) -> tuple[int, int] | None:
        """(step, source) of the first step of `segment` before `end` that would take a source past its cap."""
        weights = segment.interleave.weights
        hits = [
            (step, k)
            for k, cap in enumerate(self.caps)
            if cap is not None
            and weights[k] > 0
            and (step := self.cap_step(segment, k, cap, end)) is not None
        ]
        return min(hits, default=None)

    def cap_step(self, segment: Segment, k: int, cap: int, end: int | None) -> int | None:
        """The first step of `segment` (before `end`) after which source k would have drawn more than `cap`."""

        def over(step: int) -> bool:
            return segment.counts_after(step + 1 - segment.start, self.per_step)[k] > cap

        # By `hi` the source has certainly drawn more than its cap (its ticks stay within 1 of the line).
        lo = segment.start
        hi = lo + math.ceil((cap + 2) / (segment.interleave.weights[k] * self.per_step)) + 1
        if end is not None:
            if end <= lo or not over(end - 1):
                return None
            hi = end - 1
        while lo < hi:  # binary search: counts only grow with the step
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if over(mid) else (mid + 1, hi)
        return lo

    def segment_at(self, step: int) -> Segment:
        """The segment holding stream step `step`."""
        return self.segments[max(0, int(np.searchsorted(self.starts, step, side="right")) - 1)]

    def locate(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of global samples first..first+n-1 (across segments if need be)."""
        sources, indices, end = [], [], first + n
        while first < end or not sources:
            k = max(0, int(np.searchsorted(self.starts, first // self.per_step, side="right")) - 1)
            segment = self.segments[k]
            stop = end if k + 1 == len(self.segments) else min(end, int(self.starts[k + 1]) * self.per_step)
            source, index = segment.interleave.locate(first - segment.start * self.per_step, stop - first)
            sources.append(source)
            indices.append(index + segment.base[source])
            first = stop
        return np.concatenate(sources), np.concatenate(indices)

    def counts_at(self, step: int) -> np.ndarray:
        """Samples of each source drawn before stream step `step`."""
        segment = self.segment_at(step)
        return segment.counts_after(step - segment.start, self.per_step)

    def capped_at(self, name: str, steps: int) -> int | None:
        """The step before `steps` at which source `name` meets its cap (stopping the run or leaving the mix)."""
        step = self.stop_step if self.stopped_by == name else self.exhausted.get(name)
        return step if step is not None and step < steps else None


def periods(
    base: np.ndarray, names: list[str], phases: Sequence[PhaseConfig], tokens_per_step: int
) -> list[tuple[int, int | None, np.ndarray]]:
    """(first step, end step or None, weights) of each phase; a phase ending at a token count ends at the
    step those tokens take. One period of the base weights without phases."""
    out, start = [], 0
    for i, phase in enumerate(phases):
        weights = base.copy()
        for name, weight in (phase.mixture or {}).items():
            weights[names.index(name)] = weight
        if (weights < 0).any() or not weights.sum() > 0:
            raise Refused(
                f"phase '{phase.name}' gives the mixture weights {dict(zip(names, weights.tolist()))}: they "
                f"must be >= 0 with a positive total"
            )
        end = phase.end_step if phase.end_step is not None else math.ceil(phase.end_tokens / tokens_per_step)
        last = i == len(phases) - 1
        out.append((start, None if last else max(end, start), weights))
        start = max(end, start)
    return out or [(0, None, base)]
