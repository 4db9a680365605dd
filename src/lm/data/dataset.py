"""Fixed-length training windows over a token stream, and the step-addressed order they are visited in."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from lm.base.exits import Refused
from lm.numbers.batch_ramp import BatchRamp


class TokenWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens from one or more .bin token shards read as one stream.

    Window i is stream[i*seq_len : i*seq_len + seq_len + 1]: inputs are window[:-1] and targets window[1:],
    so consecutive windows share one boundary token and every token is a target exactly once. The stream is
    the shards concatenated in the given (manifest) order. A window may straddle two shards: every shard ends
    with end-of-text, so that crossing is a document boundary like any other and no tokens are wasted.
    Shards are memory-mapped on first access, so the dataset pickles to DataLoader workers as paths.
    With `vocab_size`, a window holding an id at or above it is refused as it is read (a corrupt shard that
    `data.verify=size` let through), never left to index past the embedding.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        seq_len: int,
        dtype: str | np.dtype = "uint16",
        vocab_size: int | None = None,
    ):
        self.paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self.vocab_size = vocab_size
        if seq_len < 1:
            raise Refused(f"data.seq_len={seq_len} must be at least 1")
        sizes = []
        for path in self.paths:
            size = os.path.getsize(path)
            if size % self.dtype.itemsize:
                raise Refused(f"{path} has {size} bytes, not a whole number of {self.dtype} tokens")
            sizes.append(size // self.dtype.itemsize)
        # starts[k] is the stream offset of shard k; starts[-1] the stream length.
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.n_tokens = int(self.starts[-1])
        name = self.paths[0].name if len(self.paths) == 1 else f"{len(self.paths)} shards"
        if self.n_tokens < seq_len + 1:
            raise Refused(
                f"{name} has {self.n_tokens} tokens, fewer than one window of data.seq_len+1="
                f"{seq_len + 1}; lower data.seq_len or add data (raise data.max_bytes or data.val_fraction)"
            )
        self.name = name
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def _read(self, start: int, stop: int) -> np.ndarray:
        """stream[start:stop], gathered from as many shards as it spans (usually one)."""
        if self._maps is None:
            sizes = np.diff(self.starts)  # an empty shard cannot be mapped, and is never read
            self._maps = [
                np.memmap(p, self.dtype, mode="r") if n else None for p, n in zip(self.paths, sizes)
            ]
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            end = min(stop, int(self.starts[k + 1]))
            if end > start:
                base = int(self.starts[k])
                parts.append(self._maps[k][start - base : end - base])
            start, k = end, k + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} is out of range for {len(self)} windows of {self.name}")
        start = i * self.seq_len
        window = self._read(start, start + self.seq_len + 1)
        if self.vocab_size is not None and window.max() >= self.vocab_size:
            self.refuse_ids(start, window)
        return torch.from_numpy(window.astype(np.int64))

    def refuse_ids(self, start: int, window: np.ndarray) -> None:
        """Name the shard holding the first id outside the vocabulary, and the fix."""
        offset = start + int(np.argmax(window >= self.vocab_size))
        path = self.paths[int(np.searchsorted(self.starts, offset, side="right")) - 1]
        raise Refused(
            f"{path} holds token id {int(window.max())} at or above the vocabulary size {self.vocab_size} the "
            f"data was prepared with: the shard is corrupt, or was tokenized with a larger vocabulary. Delete "
            f"{path.parent} and rerun `lm prepare` with this config's data.vocab_size (data.verify=full checks "
            f"every shard before training)"
        )

    def __getstate__(self) -> dict:
        # Workers re-open the files themselves; pickling the maps would copy the whole split.
        return {**self.__dict__, "_maps": None}


class StepSampler(Sampler[list[int]]):
    """Infinite batch sampler whose batches are a pure function of the optimizer step.

    There is one global stream of samples: sample g is window perm_e[g % n_windows] with e = g // n_windows
    and perm_e a permutation seeded by (seed, e). Micro-batch m (= step * accumulate + micro index) on rank r
    takes samples (m * world_size + r) * batch_size + j for j < batch_size. So a run resumed at step s sees
    the same batches as an uninterrupted run, and ranks never share a sample within an epoch.

    `skips` are data windows [first, last] (optimizer steps, inclusive) that a rollback after loss spikes
    skipped: from step `first` on, the stream is `last - first + 1` steps further on, so the batches that
    caused the spikes are never trained on again and the order stays a pure function of (seed, step, skips).

    With a batch-size `ramp`, step s has `ramp.batch_at(s)` rows per micro-batch, and its samples start where
    the steps before it (and the skipped windows' steps) ended: `stream_offset(s)` x world x accumulate. With
    the ramp off that is exactly the indexing above.
    """

    def __init__(
        self,
        n_windows: int,
        batch_size: int,
        seed: int = 0,
        start_step: int = 0,
        accumulate: int = 1,
        world_size: int = 1,
        rank: int = 0,
        skips: Sequence[Sequence[int]] = (),
        ramp: BatchRamp | None = None,
    ):
        if n_windows < 1 or batch_size < 1 or accumulate < 1 or start_step < 0:
            raise ValueError(
                f"StepSampler needs n_windows, batch_size, accumulate >= 1 and start_step >= 0; got "
                f"{n_windows=}, {batch_size=}, {accumulate=}, {start_step=}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if any(not 0 <= first <= last for first, last in skips):
            raise ValueError(
                f"skipped data windows must be [first, last] steps with 0 <= first <= last; got {skips}"
            )
        self.n_windows = n_windows
        self.batch_size = batch_size
        self.seed = seed
        self.start_step = start_step
        self.accumulate = accumulate
        self.world_size = world_size
        self.rank = rank
        self.skips = sorted((int(first), int(last)) for first, last in skips)
        self.ramp = ramp if ramp is not None else BatchRamp(batch_size)
        if self.ramp.batch_size != batch_size:
            raise ValueError(f"the ramp's full batch {self.ramp.batch_size} is not batch_size {batch_size}")
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """Window order of `epoch`; the current one is cached since samples advance through it in order."""
        if epoch != self._epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm = perm.astype(np.int32 if self.n_windows < 2**31 else np.int64)
            self._epoch = epoch
        return self._perm

    def micro_batch(self, m: int) -> list[int]:
        """Window indices of global micro-batch `m` on this rank (full-batch indexing)."""
        return self.samples((m * self.world_size + self.rank) * self.batch_size, self.batch_size)

    def samples(self, first: int, n: int) -> list[int]:
        """Window indices of stream samples first..first+n-1."""
        samples = np.arange(first, first + n, dtype=np.int64)
        epochs, slots = np.divmod(samples, self.n_windows)
        windows = np.empty(n, dtype=np.int64)
        for epoch in np.unique(epochs):  # one epoch, or two where the batch straddles a boundary
            mask = epochs == epoch
            windows[mask] = self.permutation(int(epoch))[slots[mask]]
        return windows.tolist()

    def stream_step(self, step: int) -> int:
        """The step of the data stream that optimizer step `step` trains on (`step` itself without skips)."""
        return step + sum(last - first + 1 for first, last in self.skips if first <= step)

    def stream_offset(self, step: int) -> int:
        """Rows one micro-batch slot of one rank took before optimizer step `step`, skipped windows included
        (`stream_step(step) x batch_size` without a ramp)."""
        before = self.ramp.samples_before
        skipped = sum(before(last + 1) - before(first) for first, last in self.skips if first <= step)
        return before(step) + skipped

    def step_batches(self, step: int) -> Iterator[list[int]]:
        """This rank's micro-batches of optimizer step `step`."""
        rows = self.ramp.batch_at(step)
        base = self.stream_offset(step) * self.world_size * self.accumulate
        for i in range(self.accumulate):
            yield self.samples(base + (i * self.world_size + self.rank) * rows, rows)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield from self.step_batches(step)
            step += 1


def val_batches(n_windows: int, batch_size: int, world_size: int = 1, rank: int = 0) -> list[list[int]]:
    """Validation windows in order, as this rank's batches.

    Global batch k is windows [k·W·B, (k+1)·W·B) and rank r takes its r-th slice of B, so W ranks with batch B
    validate exactly the windows one process with batch W·B does, and `val/loss` (a mean over ranks of
    equal-sized batches) is the same number. With several ranks only whole global batches are used: every
    rank must run the same number of forwards (a sharded model's all-gathers must pair up).
    """
    if world_size == 1:
        return [list(range(s, min(s + batch_size, n_windows))) for s in range(0, n_windows, batch_size)]
    step = world_size * batch_size
    if n_windows < step:
        raise Refused(
            f"the validation split has {n_windows} windows, fewer than one global batch of {world_size} "
            f"ranks x data.batch_size={batch_size}; raise data.val_fraction or lower data.batch_size"
        )
    return [
        list(range(s + rank * batch_size, s + (rank + 1) * batch_size))
        for s in range(0, n_windows - step + 1, step)
    ]
