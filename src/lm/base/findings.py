"""A preflight finding: what the doctor's table shows for one check.

It lives in the bottom wing because each component states its own preflight checks beside its code (the
memory model's in `lm.engine.activation_checkpointing`, the disk's in `lm.checkpoint.local`, ...); the doctor
(`lm.run.doctor`) keeps the registry of checks, runs them and draws the table.
"""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("ok", "warn", "error")


@dataclass
class Finding:
    """One line of the doctor's table."""

    check: str
    level: str
    what: str
    gain: str = ""
    """Expected benefit of the fix (measured in a seed where it says so, else an estimate)."""
    fix: str = ""
    """The Hydra override(s) that fix it."""
