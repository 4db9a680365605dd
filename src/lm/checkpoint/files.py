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

Every read is a read of data: `torch.load(weights_only=True)`, whose allow-list (tensors, containers, numbers,
strings, `torch.Size`, dtypes) is all an lm checkpoint holds, since `RunState`, the hyper-parameters and
Lightning's loops keep plain types. A file whose pickle names anything else (a payload's `posix.system`, an old
callback's numpy scalar) is refused (`UnsafeCheckpoint`, exit 78) with the name, never run; `LM_TRUST_CHECKPOINT`
names one checkpoint a user vouches for, read as a full pickle once (the next save writes plain types); the
name is resolved and the content hashed when it is first read, and only that file with that content is trusted. A
sharded folder's two pickles besides `meta.pt` (torch.distributed.checkpoint's index, and the non-tensor items
inside the shards, which torch's own readers unpickle in full) are checked the same way before torch reads them.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
import secrets
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from lm.base.exits import Refused
from lm.base.private_api import DCP_INDEX_TYPES, read_sharded_whole

log = logging.getLogger(__name__)

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


TRUST_ENV = "LM_TRUST_CHECKPOINT"
"""The environment variable naming one checkpoint (a file, `last.ckpt`, or a sharded folder) to read as a full
pickle: the opt-in for a file that holds more than plain types, which a user wrote and vouches for."""


class UnsafeCheckpoint(Refused):
    """A checkpoint whose pickle names a type no lm checkpoint holds: reading it could run code, so it is not
    read (exit 78). The message names the type, the file and the two ways on."""


@dataclass(frozen=True)
class Trust:
    """What `LM_TRUST_CHECKPOINT` named, pinned the first time this process read it: the file (or sharded
    folder) the name resolved to then, and the sha256 of its content (None: nothing was there to trust)."""

    path: Path
    digest: str | None


_pinned: dict[str, Trust] = {}
"""One pin per value of the variable: `last.ckpt` is resolved once, so a later save it points to, a file fetched
from a bucket, or a payload planted behind the link is never trusted in its place."""


def content_digest(path: Path) -> str:
    """sha256 over a file's bytes, or over a folder's file names and bytes (a sharded checkpoint)."""
    h = hashlib.sha256()
    parts = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for part in parts:
        h.update(str(part.relative_to(path)).encode() if path.is_dir() else b"")
        with open(part, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def trust() -> Trust | None:
    """The checkpoint `LM_TRUST_CHECKPOINT` names, resolved and hashed once (the opt-in); None when unset."""
    named = os.environ.get(TRUST_ENV)
    if not named:
        return None
    if named not in _pinned:
        path = Path(named).resolve()
        digest = content_digest(path) if path.exists() else None
        _pinned[named] = Trust(path, digest)
        log.warning(
            "%s names %s: that %s, as it is now (sha256 %s), is the one checkpoint read as a full pickle",
            TRUST_ENV,
            named,
            path,
            (digest or "nothing there")[:16],
        )
    return _pinned[named]


def trusted(ckpt: Path) -> bool:
    """Whether `ckpt` is the checkpoint `LM_TRUST_CHECKPOINT` pinned, content unchanged (`last.ckpt` is compared
    as the step file it pointed to when first read). Anything else is read as data."""
    pin = trust()
    if pin is None or pin.digest is None or ckpt.resolve() != pin.path:
        return False
    if content_digest(pin.path) != pin.digest:
        log.warning("%s changed since %s named it: read as data", pin.path, TRUST_ENV)
        return False
    return True


def refusal(ckpt: Path, part: Path, names: list[str]) -> UnsafeCheckpoint:
    inside = "" if part == ckpt else f" (its {part.relative_to(ckpt)})"
    return UnsafeCheckpoint(
        f"{ckpt}{inside} holds a pickle that names {', '.join(names)}, which no lm checkpoint holds: reading it "
        f"could run code, so it was not read. Delete it if you did not write it; if you did (an older lm, a "
        f"callback of your own) and trust it, read it once with {TRUST_ENV}={ckpt.resolve()} (the next save "
        f"writes plain types)"
    )


UNSAFE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
"""How torch's weights_only unpickler names what it refused ("Unsupported global: GLOBAL posix.system ...")."""


def load(path: Path | IO[bytes], *, ckpt: Path | None = None, mmap: bool = True) -> Any:
    """`torch.load` of a checkpoint file (or one pickled item of a sharded one) as data, on the CPU.

    `ckpt` is the checkpoint `path` belongs to (itself by default): what a refusal names and `LM_TRUST_CHECKPOINT`
    is compared with. A file is memory-mapped where its format allows (zip), so opening a multi-GB file reads
    only its directory and the pickled structure. Raises `UnsafeCheckpoint` for a pickle that names anything
    beyond torch's weights_only allow-list; any other failure (a truncated or corrupted file) as torch raised it.
    """
    ckpt = ckpt if ckpt is not None else Path(path)
    mmap = (
        mmap and isinstance(path, Path) and zipfile.is_zipfile(path)
    )  # a legacy or raw pickle cannot be mapped
    if trusted(ckpt):
        log.warning("reading %s as a full pickle: %s names it", ckpt, TRUST_ENV)
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        names = sorted(set(UNSAFE_GLOBAL.findall(str(e))))
        if not names:
            raise  # not a refused type: a damaged pickle
        raise refusal(ckpt, path if isinstance(path, Path) else ckpt, names) from e


def read(path: Path) -> dict[str, Any]:
    """A checkpoint's contents, on the CPU whatever device saved it, as one full (unsharded) state, read as
    data (`load`).

    A file is memory-mapped, so opening a multi-GB file reads only the zip directory and the pickled structure;
    a tensor is read when it is used. A sharded folder is assembled whole in memory (`read_sharded`).
    """
    if is_sharded(path):
        return read_sharded(path)
    return load(path)


def read_meta(path: Path) -> dict[str, Any]:
    """Everything but the tensors' values: step, hyper-parameters, loops, callbacks. Cheap for either layout
    (a sharded folder's `meta.pt`; a file's memory map), so the resume check never assembles a whole model.

    A sharded folder's index and non-tensor items are checked as data first (`read_index`), so that torch's
    readers, which unpickle them in full (this process's `read_sharded`, an FSDP2 resume's ranks through
    Lightning), only ever read what passed."""
    if is_sharded(path):
        read_index(path)
        return load(path / SHARDED_META, ckpt=path)
    return read(path)


class IndexUnpickler(pickle.Unpickler):
    """`pickle` restricted to what torch.distributed.checkpoint's index holds (`DCP_INDEX_TYPES`: its
    dataclasses, shapes, layouts, paths) and torch's dtypes; anything else is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_INDEX_TYPES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def read_index(path: Path) -> Any:
    """A sharded folder's index (torch.distributed.checkpoint's `Metadata`) read as data, with every non-tensor
    item it lists in the shards loaded as data too (`load`); `UnsafeCheckpoint` for anything else."""
    index_file = path / SHARD_INDEX
    with open(index_file, "rb") as f:
        try:
            index = pickle.load(f) if trusted(path) else IndexUnpickler(f).load()
        except pickle.UnpicklingError as e:
            if names := UNSAFE_GLOBAL.findall(str(e)):
                raise refusal(path, index_file, names) from e
            raise
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    for fqn, item in index.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = index.storage_data[MetadataIndex(fqn)]
        if info.transform_descriptors:
            raise UnsafeCheckpoint(
                f"{path}: item {fqn} is stored through transforms {list(info.transform_descriptors)}, which lm "
                f"never writes and does not check; delete the folder, or read it once with {TRUST_ENV}={path.resolve()}"
            )
        with open(path / info.relative_path, "rb") as shard:
            shard.seek(info.offset)
            load(io.BytesIO(shard.read(info.length)), ckpt=path)
    return index


def read_sharded(path: Path) -> dict[str, Any]:
    """A sharded folder as the full checkpoint a file would hold: weights by name, optimizer states keyed by
    parameter index in group order (what `Optimizer.load_state_dict` maps by), the rest from `meta.pt`.

    What `lm export`, `lm sample`, `lm eval` and a resume on one process or under DDP read; torch's own
    conversion (`dcp_to_torch_save`'s planner) rebuilds the nested state from the index, without a process
    group. An FSDP2 run resumes a folder through Lightning instead, each rank reading only its shards.
    """
    # First: the index and the non-tensor items are checked as data before torch's reader unpickles them.
    ckpt = read_meta(path)
    state = read_sharded_whole(path)  # torch's `dcp_to_torch_save`, kept in memory
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
    A file that would run code is not broken but planted (or written by something else than lm): it is refused
    (`UnsafeCheckpoint`), never set aside for an older checkpoint as a broken one is.
    """
    if is_sharded(path):
        return sharded_loadable(path)
    try:
        ckpt = read(path)
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # any way a file can be broken: EOF, bad zip, unpickling errors
        return f"{type(e).__name__}: {e}"
    missing = TRAINING_KEYS - set(ckpt)
    return f"missing {sorted(missing)}" if missing else None


def sharded_loadable(path: Path) -> str | None:
    """A sharded folder's check without reading the tensors: the index loads, every byte range it names lies
    inside an existing shard file, and `meta.pt` loads with the training keys."""
    try:
        index = read_index(path)
        meta = load(path / SHARDED_META, ckpt=path)
    except UnsafeCheckpoint:
        raise
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
