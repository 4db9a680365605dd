"""Fixed-length training windows over a token stream, and the step-addressed order they are visited in."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class TokenWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens from a flat .bin token file.

    Window i is tokens[i*seq_len : i*seq_len + seq_len + 1]: inputs are window[:-1] and targets window[1:],
    so consecutive windows share one boundary token and every token is a target exactly once.
    The file is memory-mapped on first access, so the dataset pickles to DataLoader workers as a path.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str | np.dtype = "uint16"):
        self.path = Path(path)
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be at least 1")
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            raise ValueError(f"{self.path} has {size} bytes, not a whole number of {self.dtype} tokens")
        self.n_tokens = size // self.dtype.itemsize
        if self.n_tokens < seq_len + 1:
            raise ValueError(
                f"{self.path.name} has {self.n_tokens} tokens, fewer than one window of data.seq_len+1="
                f"{seq_len + 1}; lower data.seq_len or add data (raise data.max_bytes or data.val_fraction)"
            )
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} is out of range for {len(self)} windows of {self.path.name}")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = i * self.seq_len
        return torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        # Workers re-open the file themselves; pickling the map would copy the whole split.
        return {**self.__dict__, "_tokens": None}


class StepSampler(Sampler[list[int]]):
    """Infinite batch sampler whose batches are a pure function of the optimizer step.

    There is one global stream of samples: sample g is window perm_e[g % n_windows] with e = g // n_windows
    and perm_e a permutation seeded by (seed, e). Micro-batch m (= step * accumulate + micro index) on rank r
    takes samples (m * world_size + r) * batch_size + j for j < batch_size. So a run resumed at step s sees
    the same batches as an uninterrupted run, and ranks never share a sample within an epoch.
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
    ):
        if n_windows < 1 or batch_size < 1 or accumulate < 1 or start_step < 0:
            raise ValueError(
                f"StepSampler needs n_windows, batch_size, accumulate >= 1 and start_step >= 0; got "
                f"{n_windows=}, {batch_size=}, {accumulate=}, {start_step=}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.n_windows = n_windows
        self.batch_size = batch_size
        self.seed = seed
        self.start_step = start_step
        self.accumulate = accumulate
        self.world_size = world_size
        self.rank = rank
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
        """Window indices of global micro-batch `m` on this rank."""
        first = (m * self.world_size + self.rank) * self.batch_size
        samples = np.arange(first, first + self.batch_size, dtype=np.int64)
        epochs, slots = np.divmod(samples, self.n_windows)
        windows = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):  # one epoch, or two where the batch straddles a boundary
            mask = epochs == epoch
            windows[mask] = self.permutation(int(epoch))[slots[mask]]
        return windows.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        m = self.start_step * self.accumulate
        while True:
            yield self.micro_batch(m)
            m += 1
