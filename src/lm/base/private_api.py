"""Every private name of torch and Lightning that lm reaches, in one place, each with why no public one serves.

Nothing else in src/lm names a private attribute of a framework; tests/base/test_private_api.py tests what
each one does (a release that renames or changes it fails there, not in a resume), and tests/test_supply.py
fails when torch or Lightning is outside the versions `[tool.lm.tested]` in pyproject.toml says these were
tested with. Three Lightning names at most: each is a reason to leave Lightning's front door.

| name | owner | why |
|---|---|---|
| `_TrainingEpochLoop._broadcast_sigterm_tensor` | Lightning | under torch.distributed Lightning broadcasts rank 0's SIGTERM flag and reads it with `.item()` before every micro-batch: a host-device sync per batch, with no switch to turn it off; lm's step boundary agrees on stop signals itself, one step late and without a sync |
| `fit_loop._combined_loader`, `_shutdown_workers_and_reset_iterator` | Lightning | the DataLoader workers of a run that fails while Lightning handles another error are never shut down (they ignore SIGTERM on purpose), and multiprocessing's exit handler then waits for ever |
| `LRScheduler._last_lr` | torch | a resume that changes the LR (a new phase's `optim.lr`) sets each group's LR; `get_last_lr()` reports `_last_lr`, which only `step()` sets |
| `GradScaler._scale` | torch | fp16's loss scale as a device tensor (`get_scale()` reads it on the host: a sync per step) |
| `torch.optim._muon` | torch | Muon's Newton-Schulz iteration and LR adjustment, shared with torch's own `Muon` (lm's steps it on FSDP2 shards) |
| `state_dict_loader._load_state_dict`, `_EmptyStateDictLoadPlanner` | torch | a sharded checkpoint read whole on one process: what torch's own `dcp_to_torch_save` does, in memory |
| `_StorageInfo`, `_get_layout`, `_MEM_FORMAT_ENCODING` (as names) | torch | what a DCP index pickles: torch reads it with a full `pickle.load`, lm with only these allowed (`DCP_INDEX_TYPES`), so a planted index cannot run code |
| `Muon._init_group` | torch | the Polar Express Muon steps torch's Muon with other coefficients, gathering each group's tensors as torch's own step does |
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _adjust_lr, _zeropower_via_newtonschulz

DCP_INDEX_TYPES = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
    }
)
"""(module, name) of every type torch.distributed.checkpoint's index (`.metadata`) pickles besides dtypes: its
dataclasses, the layout and memory-format codes, shapes, the checkpoint's path. lm.checkpoint.files reads the
index allowing only these; a release that pickles another type is refused by name until it is added here."""


MUON_QUINTIC = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
"""torch's Muon quintic Newton-Schulz coefficients."""
muon_adjust_lr = _adjust_lr
"""torch's Muon LR adjustment (`adjust_lr_fn`: original or match_rms_adamw) for a matrix's shape."""
newton_schulz = _zeropower_via_newtonschulz
"""torch's Muon orthogonalisation: (update, coefficients, steps, eps) -> the orthogonalised update."""


def skip_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop Lightning's per-micro-batch broadcast of rank 0's SIGTERM flag (and its `.item()` host sync).
    Call only where every rank does and a stop signal is agreed on otherwise (StopSignals)."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = _no_broadcast


def _no_broadcast() -> None:
    """Stands in for Lightning's SIGTERM broadcast."""


def shutdown_data_workers(trainer: pl.Trainer) -> None:
    """Shut the DataLoader workers of the fit and validation loops down now (a no-op once Lightning's
    teardown did)."""
    for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop):
        if loop._combined_loader is not None:
            for loader in loop._combined_loader.flattened:
                _shutdown_workers_and_reset_iterator(loader)


def muon_tensors(
    optimizer: torch.optim.Muon, group: dict[str, Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(parameters with a gradient, their gradients, their momentum buffers) of one Muon group, as torch's
    Muon gathers them (buffers created on first use)."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    bufs: list[torch.Tensor] = []
    optimizer._init_group(group, params, grads, bufs)
    return params, grads, bufs


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """Make `scheduler.get_last_lr()` report `lrs` (the groups' LRs set by hand)."""
    scheduler._last_lr = list(lrs)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """fp16's current loss scale as the device tensor the scaler multiplies by (None before the first step)."""
    return scaler._scale


def read_sharded_whole(path: Path) -> dict[str, Any]:
    """The tensors of a torch.distributed.checkpoint folder as one nested dict, read in this process without
    a process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_state_dict(state, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
