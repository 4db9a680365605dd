"""requirements.lock against pyproject.toml: `stamp` after `pip-compile` (`just lock`), `check` in CI.

The lock is pip-compile's, with sha256 hashes, for the CPU set-up and CI (Python 3.11, Linux x86_64). Its
header carries a digest of what it was compiled from: pyproject.toml's `requires-python`, `dependencies`, the
`dev` extra and the build requirements. `check` recomputes it and fails, naming the fix, when pyproject.toml
changed and the lock did not. Standard library only: CI runs it before the venv exists.

`stamp` also writes torch's pin without the CPU wheel's local label (`torch==2.13.0`, its hash still the CPU
wheel's): pip on lm's machines takes that wheel by its hash, and a GPU box whose CUDA torch 2.13.0 is already
installed keeps it (pip checks no hash of an installed package that satisfies a pin). And it repeats each pin
with extras without them (`plain_pins`), which the pip a Python 3.11 venv starts with needs.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "requirements.lock"
EXTRA = "dev"
"""The extra the lock installs (with the base dependencies): what the README's set-up and CI install."""
STAMP = re.compile(r"^# inputs: sha256 ([0-9a-f]{64}).*\n?", re.M)
LOCAL_LABEL = re.compile(r"^(torch==[0-9.]+)\+\w+", re.M)


def inputs_digest(pyproject: Path = PYPROJECT) -> str:
    """sha256 of what the lock resolves: requires-python, dependencies, the dev extra, build requirements."""
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    inputs = {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        EXTRA: project.get("optional-dependencies", {}).get(EXTRA, []),
        "build-system": data.get("build-system", {}).get("requires", []),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def stamped_digest(lock: Path = LOCK) -> str | None:
    """The digest the lock's header records, or None."""
    m = STAMP.search(lock.read_text()) if lock.is_file() else None
    return m.group(1) if m else None


PIN_WITH_EXTRAS = re.compile(
    r"^([A-Za-z0-9_.-]+)\[[^\]]+\](==\S+ \\\n(?:    --hash=sha256:\w+(?: \\)?\n)+)", re.M
)
"""A `name[extras]==version` pin and its hash lines."""
PLAIN_COPY = "    # the pin above without its extras, for pip's hash-checking mode (.ci/lock.py)\n"


def plain_pins(text: str) -> str:
    """Add `name==version` (same hashes) after each `name[extras]==version` that has no such line: pip before
    23.3 takes another package's plain `name` requirement for an unpinned one under --require-hashes."""
    plain = {m.group(1).lower() for m in re.finditer(r"^([A-Za-z0-9_.-]+)==", text, re.M)}

    def copy(m: re.Match) -> str:
        if m.group(1).lower() in plain:
            return m.group(0)
        return f"{m.group(0)}{m.group(1)}{m.group(2)}{PLAIN_COPY}"

    return PIN_WITH_EXTRAS.sub(copy, text)


def stamp(lock: Path = LOCK, pyproject: Path = PYPROJECT) -> None:
    """Record pyproject.toml's digest in the lock's header, drop torch's local label and add plain copies of
    the pins with extras (`plain_pins`)."""
    text = STAMP.sub("", lock.read_text()).lstrip("\n")
    text = plain_pins(LOCAL_LABEL.sub(r"\1", text))
    line = f"# inputs: sha256 {inputs_digest(pyproject)} (pyproject.toml; `just lock` writes it, .ci/lock.py checks it)\n"
    lock.write_text(line + text)


def problem(lock: Path = LOCK, pyproject: Path = PYPROJECT) -> str | None:
    """None when the lock was compiled from pyproject.toml as it is, else what is wrong and the fix."""
    if not lock.is_file():
        return f"{lock.name} is missing: run `just lock`"
    have = stamped_digest(lock)
    if have is None:
        return (
            f"{lock.name} has no '# inputs: sha256' line: run `just lock` (it compiles and stamps the lock)"
        )
    if have != inputs_digest(pyproject):
        return (
            f"{lock.name} was compiled from another pyproject.toml (its dependencies, the {EXTRA} extra or the "
            f"build requirements changed since): run `just lock` and commit both files"
        )
    return None


def main(argv: list[str]) -> int:
    if argv == ["stamp"]:
        stamp()
        return 0
    if argv == ["check"]:
        if (why := problem()) is not None:
            print(f"lock check: {why}", file=sys.stderr)
            return 1
        print(f"lock check: {LOCK.name} matches pyproject.toml")
        return 0
    print("usage: python3 .ci/lock.py check|stamp", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
