"""requirements.lock against pyproject.toml: `stamp` after `uv pip compile --universal` (`just lock`), `check` in CI.

The lock is uv's universal lock as a requirements file: one resolution for every platform and Python 3.10+,
with environment markers where they differ (torch's CUDA packages under `sys_platform == 'linux'`), and the
sha256 of every file on the public index each pin may take. Its header carries a digest of what it was compiled
from: pyproject.toml's `requires-python`, `dependencies`, the `dev` extra and the build requirements. `check`
recomputes it and fails, naming the fix, when pyproject.toml changed and the lock did not. Standard library
only: CI runs it before the venv exists. `.ci/lock_targets.py` checks, per platform, that it installs.

`stamp` also repeats each pin with extras without them (`plain_pins`), which the pip a Python 3.11 venv starts
with needs, and writes requirements-build.lock: the lock's setuptools pin with its hashes, installed first so
that the sdists the lock holds (lm-eval's pure-Python dependencies) and lm itself build with a hashed backend
(`--no-build-isolation`) instead of one a build environment fetches unpinned.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "requirements.lock"
BUILD_LOCK = ROOT / "requirements-build.lock"
BUILD_BACKEND = "setuptools"
EXTRA = "dev"
"""The extra the lock installs (with the base dependencies): what the README's set-up and CI install."""
STAMP = re.compile(r"^# inputs: sha256 ([0-9a-f]{64}).*\n?", re.M)


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
    r"^([A-Za-z0-9_.-]+)\[[^\]]+\](==[^\n]*\\\n(?:    --hash=sha256:\w+(?: \\)?\n)+)", re.M
)
"""A `name[extras]==version` pin (with its markers, if any) and its hash lines."""
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


def pin_block(text: str, name: str) -> str:
    """One package's `name==version` line and its hash lines, as the lock holds them."""
    m = re.search(rf"^{re.escape(name)}==[^\n]*\\\n(?:    --hash=sha256:\w+(?: \\)?\n)+", text, re.M)
    if m is None:
        raise SystemExit(f"{LOCK.name} pins no {name}: the build backend must be locked (`just lock`)")
    return m.group(0)


def stamp(lock: Path = LOCK, pyproject: Path = PYPROJECT, build_lock: Path = BUILD_LOCK) -> None:
    """Record pyproject.toml's digest in the lock's header, add plain copies of the pins with extras
    (`plain_pins`) and write the build backend's pin to requirements-build.lock."""
    text = plain_pins(STAMP.sub("", lock.read_text()).lstrip("\n"))
    line = f"# inputs: sha256 {inputs_digest(pyproject)} (pyproject.toml; `just lock` writes it, .ci/lock.py checks it)\n"
    lock.write_text(line + text)
    header = f"# {BUILD_BACKEND} from {lock.name} (written by .ci/lock.py stamp): installed before it, see its docstring\n"
    build_lock.write_text(header + pin_block(text, BUILD_BACKEND))


CUDA_ONLY = re.compile(r"^(nvidia-|cuda-|triton==|liger-kernel==)")
"""What torch's Linux wheel on the public index brings for CUDA (runtime libraries, bindings, Triton), and Liger
Kernel, which needs Triton."""
PIN_BLOCK = re.compile(r"^[A-Za-z0-9_.\[\], -]+==[^\n]*\n(?:(?:    |#)[^\n]*\n)*", re.M)
"""A pin, its hash lines and the comments after it, up to the next pin."""


def locked_torch(text: str) -> str:
    """The torch version the lock pins."""
    return re.search(r"^torch==([^\s;\\]+)", text, re.M).group(1)


def local_cpu_wheel(text: str, folders: str) -> Path | None:
    """PyTorch's CPU wheel of the lock's torch for this Python (Linux x86_64) in pip's find-links `folders`
    (space-separated, as PIP_FIND_LINKS holds them), or None: lm's CI machines keep one, users' do not."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    pattern = f"torch-{locked_torch(text)}+cpu-{tag}-{tag}-*manylinux*_x86_64.whl"
    found = [w for folder in folders.split() for w in sorted(Path(folder).glob(pattern))]
    return found[0] if found else None


def ci_lock(text: str, folders: str) -> str:
    """What CI installs: `cpu_lock` with the machine's CPU wheel where it keeps one, else the lock itself."""
    wheel = local_cpu_wheel(text, folders)
    said = f"{wheel} (this machine's CPU wheel; CUDA packages left out)" if wheel else "the lock's (PyPI)"
    print(f"torch: {said}", file=sys.stderr)
    return text if wheel is None else cpu_lock(text, wheel)


def cpu_lock(text: str, wheel: Path) -> str:
    """The lock for a CPU-only CI machine that keeps PyTorch's CPU wheel of the locked version on disk: torch's
    hash is that file's, and the CUDA packages only PyPI's torch needs are left out. For CI's speed alone (no
    5 GB of CUDA libraries per run); what users install is the lock itself, which `.ci/lock_targets.py` and the
    index-only install in docs/development.md check."""
    version = locked_torch(text)
    if not wheel.name.startswith(f"torch-{version}+cpu-"):
        raise SystemExit(f"{wheel} is not torch {version}'s CPU wheel (the lock's torch)")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()

    def keep(m: re.Match) -> str:
        block = m.group(0)
        if CUDA_ONLY.match(block):
            return ""
        if block.startswith("torch=="):
            return f"torch=={version} \\\n    --hash=sha256:{digest}\n"
        return block

    return PIN_BLOCK.sub(keep, text)


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
    build_lock = lock.with_name(BUILD_LOCK.name)
    if not build_lock.is_file() or pin_block(lock.read_text(), BUILD_BACKEND) not in build_lock.read_text():
        return f"{build_lock.name} is not {lock.name}'s {BUILD_BACKEND} pin: run `just lock`"
    return None


def main(argv: list[str]) -> int:
    if argv == ["stamp"]:
        stamp()
        return 0
    if argv == ["ci"]:
        sys.stdout.write(ci_lock(LOCK.read_text(), os.environ.get("PIP_FIND_LINKS", "")))
        return 0
    if argv == ["check"]:
        if (why := problem()) is not None:
            print(f"lock check: {why}", file=sys.stderr)
            return 1
        print(f"lock check: {LOCK.name} matches pyproject.toml")
        return 0
    print("usage: python3 .ci/lock.py check|stamp|ci", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
