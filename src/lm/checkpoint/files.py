"""Checkpoint files: the one place that names them and reads them.

    <run dir>/checkpoints/step-<N>.ckpt     one optimizer step's full training state (Lightning's format)
    <run dir>/checkpoints/last.ckpt         a relative symlink to the newest step file: what a rerun resumes from
    <checkpoint.remote>/step-<N>.<token>.ckpt   the bucket's copy of a step file (the token is random)

The step in a name is the only order there is: `step-10` sorts before `step-9` by name, so every listing sorts
by the parsed number. Writers (`lm.checkpoint.local`, `.callback`, `.remote`) and readers (resume, the resume
check, export and sampling) take names and the loader from here, so a file written by one is found by all.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import torch

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


def read(path: Path) -> dict[str, Any]:
    """A checkpoint's contents, on the CPU whatever device saved it.

    Memory-mapped, so opening a multi-GB file reads only the zip directory and the pickled structure; a
    tensor is read when it is used. Not `weights_only`: Lightning's checkpoints pickle plain Python state
    (loops, callbacks, hyper-parameters), and these files are the run's own.
    """
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def loadable(path: Path) -> str | None:
    """None if `path` holds a complete training checkpoint, else why not.

    A truncated or half-written file fails here because a zip's directory sits at its end.
    """
    try:
        ckpt = read(path)
    except Exception as e:  # any way a file can be broken: EOF, bad zip, unpickling errors
        return f"{type(e).__name__}: {e}"
    missing = TRAINING_KEYS - set(ckpt)
    return f"missing {sorted(missing)}" if missing else None
