"""Checkpoint files: the one place that names them and reads them.

    <run dir>/checkpoints/step-<N>.ckpt     one optimizer step's full training state (Lightning's format), or
                                            with checkpoint.format=sharded a folder of the same name:
        .metadata                           torch.distributed.checkpoint's index, written after every shard
        __<rank>_<i>.distcp                 each rank's shards of the weights and optimizer state
        meta.pt                             the rest (step, loops, callbacks, hyper-parameters): Lightning's name
    <run dir>/checkpoints/last.ckpt         a relative symlink to the newest step file: what a rerun resumes from
    <checkpoint.remote>/step-<N>.<token>.ckpt   the bucket's copy of a step file (the token is random)

The step in a name is the only order there is: `step-10` sorts before `step-9` by name, so every listing sorts
by the parsed number. Writers (`lm.checkpoint.local`, `.callback`, `.remote`) and readers (resume, the resume
check, export and sampling) take names and the loader from here, so a file written by one is found by all.
"""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from lm.base.private_api import read_sharded_whole

SUFFIX = ".ckpt"
"""Lightning's checkpoint extension (ModelCheckpoint.FILE_EXTENSION), the same for every file here."""
LAST_STEM = "last"
"""ModelCheckpoint.CHECKPOINT_NAME_LAST: the link's name without the extension."""
LAST = f"{LAST_STEM}{SUFFIX}"
STEP_PREFIX = "step-"
STEP_TEMPLATE = f"{STEP_PREFIX}{{step}}"
"""ModelCheckpoint's `filename`: Lightning fills in the step and appends SUFFIX."""
STEP_GLOB = f"{STEP_PREFIX}*{SUFFIX}"
"""Every name that may be a step file (`STEP_FILE` says which are)."""
STEP_FILE = re.compile(rf"^{re.escape(STEP_PREFIX)}(\d+){re.escape(SUFFIX)}$")
TRAINING_KEYS = frozenset({"state_dict", "optimizer_states", "global_step", "loops"})
"""What a checkpoint needs to continue training; a file without one of them cannot be resumed."""


def step_name(step: int) -> str:
    """`step-<N>.ckpt`, the local file of optimizer step N."""
    return f"{STEP_PREFIX}{step}{SUFFIX}"


def remote_name(step: int) -> str:
    """`step-<N>.<token>.ckpt`: a fresh object name for an upload, so it never overwrites an object that a
    pointer lists (object stores have no atomic rename)."""
    return f"{STEP_PREFIX}{step}.{secrets.token_hex(4)}{SUFFIX}"


def is_step_object(name: str) -> bool:
    """Whether an object in a remote checkpoint folder is a checkpoint (an uploaded one, or the remains of an
    interrupted upload), as opposed to a pointer."""
    return name.startswith(STEP_PREFIX) and name.endswith(SUFFIX)


def checkpoint_step(path: Path) -> int | None:
    """The step in a `step-<N>.ckpt` name, else None."""
    m = STEP_FILE.match(path.name)
    return int(m.group(1)) if m else None


def step_files(ckpt_dir: Path) -> list[Path]:
    """The folder's `step-<N>.ckpt` files, newest first by step number (never by name: step-9 < step-10)."""
    steps = [p for p in ckpt_dir.glob(STEP_GLOB) if checkpoint_step(p) is not None]
    return sorted(steps, key=checkpoint_step, reverse=True)


SHARDED_META = "meta.pt"
"""A sharded checkpoint's non-tensor state (Lightning's `_METADATA_FILENAME`, which its loader reads)."""
SHARD_INDEX = ".metadata"
"""torch.distributed.checkpoint's index of every shard, written by rank 0 once every rank has written."""
TENSOR_KEYS = ("state_dict", "optimizer_states")
"""What a sharded checkpoint keeps in shards: the weights and the optimizer states (`optimizer_<i>` there)."""


def is_sharded(path: Path) -> bool:
    """Whether a step checkpoint is a folder of shards (checkpoint.format=sharded) rather than one file."""
    return path.is_dir()


def read(path: Path) -> dict[str, Any]:
    """A checkpoint's contents, on the CPU whatever device saved it, as one full (unsharded) state.

    A file is memory-mapped, so opening a multi-GB file reads only the zip directory and the pickled structure;
    a tensor is read when it is used. A sharded folder is assembled whole in memory (`read_sharded`). Not
    `weights_only`: Lightning's checkpoints pickle plain Python state (loops, callbacks, hyper-parameters),
    and these files are the run's own.
    """
    if is_sharded(path):
        return read_sharded(path)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def read_meta(path: Path) -> dict[str, Any]:
    """Everything but the tensors' values: step, hyper-parameters, loops, callbacks. Cheap for either layout
    (a sharded folder's `meta.pt`; a file's memory map), so the resume check never assembles a whole model."""
    if is_sharded(path):
        return torch.load(path / SHARDED_META, map_location="cpu", weights_only=False)
    return read(path)


def read_sharded(path: Path) -> dict[str, Any]:
    """A sharded folder as the full checkpoint a file would hold: weights by name, optimizer states keyed by
    parameter index in group order (what `Optimizer.load_state_dict` maps by), the rest from `meta.pt`.

    What `lm export`, `lm sample`, `lm eval` and a resume on one process or under DDP read; torch's own
    conversion (`dcp_to_torch_save`'s planner) rebuilds the nested state from the index, without a process
    group. An FSDP2 run resumes a folder through Lightning instead, each rank reading only its shards.
    """
    state = read_sharded_whole(path)  # torch's `dcp_to_torch_save`, kept in memory
    ckpt = read_meta(path)
    ckpt["state_dict"] = state["state_dict"]
    n = len([k for k in state if k.startswith("optimizer_")])
    ckpt["optimizer_states"] = [by_parameter_index(state[f"optimizer_{i}"]) for i in range(n)]
    return ckpt


def by_parameter_index(optim: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (torch's distributed state dicts) keyed by index instead:
    0, 1, ... through the groups in order, as `Optimizer.state_dict` numbers them."""
    groups = [dict(g) for g in optim["param_groups"]]
    index: dict[str, int] = {}
    for g in groups:
        g["params"] = [index.setdefault(name, len(index)) for name in g["params"]]
    return {"state": {index[k]: v for k, v in optim["state"].items()}, "param_groups": groups}


def loadable(path: Path) -> str | None:
    """None if `path` holds a complete training checkpoint, else why not.

    A truncated or half-written file fails here because a zip's directory sits at its end; a sharded folder
    needs its index, its `meta.pt` and every shard the index names at its full length (`sharded_loadable`).
    """
    if is_sharded(path):
        return sharded_loadable(path)
    try:
        ckpt = read(path)
    except Exception as e:  # any way a file can be broken: EOF, bad zip, unpickling errors
        return f"{type(e).__name__}: {e}"
    missing = TRAINING_KEYS - set(ckpt)
    return f"missing {sorted(missing)}" if missing else None


def sharded_loadable(path: Path) -> str | None:
    """A sharded folder's check without reading the tensors: the index loads, every byte range it names lies
    inside an existing shard file, and `meta.pt` loads with the training keys."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        index = FileSystemReader(path).read_metadata()
        meta = read_meta(path)
    except Exception as e:  # no index (a write that never finished), a truncated pickle
        return f"{type(e).__name__}: {e}"
    ends: dict[str, int] = {}
    for info in index.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = path / name
        size = shard.stat().st_size if shard.is_file() else -1
        if size < end:
            return f"shard {name} is {'missing' if size < 0 else f'truncated ({size} of {end} bytes)'}"
    stored = {key.split(".", 1)[0] for key in index.state_dict_metadata}
    missing = (TRAINING_KEYS - set(TENSOR_KEYS) - set(meta)) | ({"state_dict", "optimizer_0"} - stored)
    return f"missing {sorted(missing)}" if missing else None


def remove(path: Path) -> None:
    """Delete a step checkpoint of either layout (a file, or a folder of shards)."""
    if is_sharded(path) and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
