"""Does requirements.lock install, hash-checked, on every platform users have? Resolved per target, no torch fetched.

For each target (Linux x86_64 and aarch64 with CPython 3.10-3.13, macOS arm64 with the same), two checks:

1. **Resolution.** `uv pip compile requirements.lock` for that platform and Python against the public index only
   (no pip configuration, no local wheel folder): every package the target needs must be in the lock at the
   lock's version, so nothing is left for pip to pick unpinned.
2. **Hashes.** For each package that target installs, the file pip would take there (the wheel whose tags rank
   highest for the target, else the sdist), read from PyPI's JSON API, must have its sha256 in the lock.
   Nothing is downloaded but metadata.

Run with the venv's Python (it needs `packaging` and `uv` from the lock): `.venv/bin/python .ci/lock_targets.py`.
Exit 1 names each target and file that fails; `--targets linux-x86_64:3.11` checks a subset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags, mac_platforms
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
INDEX = "https://pypi.org/simple"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")


@dataclass(frozen=True)
class Platform:
    """A platform as uv names it and the wheel platform tags pip accepts there, best first."""

    uv_name: str
    wheel_platforms: tuple[str, ...]


def _manylinux(arch: str) -> tuple[str, ...]:
    # glibc 2.28 (RHEL 8, Ubuntu 20.04 and newer; torch's own floor, manylinux_2_28) and every older glibc a
    # wheel may name, with the legacy aliases (manylinux2014 = 2.17, manylinux2010 = 2.12, manylinux1 = 2.5).
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(28, 4, -1)]
    legacy = [f"manylinux2014_{arch}"] + ([f"manylinux2010_{arch}", f"manylinux1_{arch}"] if arch == "x86_64" else [])
    return (*tags, *legacy, f"linux_{arch}")


def _macos_arm64() -> tuple[str, ...]:
    # macOS 14 (torch 2.13's floor for arm64) and every older deployment target, as pip ranks them.
    return tuple(mac_platforms(version=(14, 0), arch="arm64"))


PLATFORMS = {
    "linux-x86_64": Platform("x86_64-manylinux_2_28", _manylinux("x86_64")),
    "linux-aarch64": Platform("aarch64-manylinux_2_28", _manylinux("aarch64")),
    "macos-arm64": Platform("aarch64-apple-darwin", _macos_arm64()),
}
TARGETS = [f"{p}:{v}" for p in PLATFORMS for v in PYTHONS]

PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;\\]+)", re.M)
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def lock_hashes(text: str) -> dict[tuple[str, str], set[str]]:
    """(name, version) -> the sha256s the lock allows for that pin (a name may be pinned twice under markers)."""
    found: dict[tuple[str, str], set[str]] = {}
    key = None
    for line in text.splitlines():
        if m := PIN.match(line):
            key = (canonicalize_name(m.group(1)), m.group(2))
            found.setdefault(key, set())
        elif not line.startswith(" "):
            key = None
        if key is not None:
            found[key].update(HASH.findall(line))
    return found


def clean_env() -> dict[str, str]:
    """The environment with every pip and uv setting removed: the public index alone, as on a user's machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    return env | {"PIP_CONFIG_FILE": os.devnull, "UV_NO_CONFIG": "1"}


def resolve(platform: Platform, python: str) -> dict[str, str]:
    """name -> version that `uv pip compile` resolves from the lock for one target (public index only)."""
    cmd = [sys.executable, "-m", "uv", "pip", "compile", str(LOCK), "--python-platform", platform.uv_name]
    cmd += ["--python-version", python, "--index-url", INDEX, "--no-header", "--no-annotate", "--quiet"]
    env = clean_env() | ({"MACOSX_DEPLOYMENT_TARGET": "14.0"} if "darwin" in platform.uv_name else {})
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"uv could not resolve the lock for {platform.uv_name} / {python}:\n{out.stderr}")
    return {canonicalize_name(m.group(1)): m.group(2) for m in PIN.finditer(out.stdout)}


@cache
def project_files(name: str) -> tuple[tuple[str, str, str], ...]:
    """(version, filename, sha256) of every file of one project, from the index's JSON simple API (PEP 691,
    what pip itself reads): metadata only, nothing large is fetched."""
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:  # noqa: S310 (a fixed https address)
        files = json.load(r)["files"]
    found = []
    for f in files:
        version = file_version(f["filename"])
        if version is not None and "sha256" in f["hashes"]:
            found.append((version, f["filename"], f["hashes"]["sha256"]))
    return tuple(found)


def file_version(filename: str) -> str | None:
    """The release a wheel or sdist belongs to, or None for a file pip would not install."""
    try:
        if filename.endswith(".whl"):
            return str(parse_wheel_filename(filename)[1])
        if filename.endswith((".tar.gz", ".zip")):
            return str(parse_sdist_filename(filename)[1])
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return None


def release_files(name: str, version: str) -> tuple[tuple[str, str], ...]:
    """(filename, sha256) of each file of one release."""
    want = Version(version)
    return tuple((f, sha) for v, f, sha in project_files(name) if Version(v) == want)


def supported_tags(platform: Platform, python: str) -> list[Tag]:
    """The wheel tags pip accepts on the target, best first (as packaging.tags.sys_tags orders them)."""
    version = tuple(int(p) for p in python.split("."))
    abi = f"cp{version[0]}{version[1]}"
    tags = list(cpython_tags(version, [abi, "abi3", "none"], platform.wheel_platforms))
    return tags + list(compatible_tags(version, abi, platform.wheel_platforms))


def chosen_file(files: tuple[tuple[str, str], ...], tags: list[Tag]) -> tuple[str, str] | None:
    """The file pip takes: the wheel whose best tag ranks highest for the target, else the sdist, else None."""
    rank = {tag: i for i, tag in enumerate(tags)}
    best: tuple[int, tuple[str, str]] | None = None
    for filename, sha in files:
        if not filename.endswith(".whl"):
            continue
        wheel_tags = parse_wheel_filename(filename)[3]
        score = min((rank[t] for t in wheel_tags if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, (filename, sha))
    if best is not None:
        return best[1]
    sdists = [f for f in files if f[0].endswith((".tar.gz", ".zip"))]
    return sdists[0] if sdists else None


def check_target(target: str, hashes: dict[tuple[str, str], set[str]]) -> tuple[list[str], list[str]]:
    """The problems found for one target, and the sdists it would build (a note, not a failure)."""
    platform_name, python = target.split(":")
    platform = PLATFORMS[platform_name]
    tags = supported_tags(platform, python)
    problems, sdists = [], []
    for name, version in sorted(resolve(platform, python).items()):
        if (name, version) not in hashes:
            problems.append(f"{target}: {name}=={version} is needed there and not pinned in the lock")
            continue
        pick = chosen_file(release_files(name, version), tags)
        if pick is None:
            problems.append(f"{target}: {name}=={version} has no file on PyPI that installs there")
        elif pick[1] not in hashes[(name, version)]:
            problems.append(f"{target}: {pick[0]} (sha256 {pick[1][:16]}...) has no hash in the lock")
        elif not pick[0].endswith(".whl"):
            sdists.append(pick[0])
    return problems, sdists


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="*", default=TARGETS, help="platform:python, e.g. linux-x86_64:3.11")
    args = parser.parse_args(argv)
    hashes = lock_hashes(LOCK.read_text())
    failed = False
    for target in args.targets:
        if target.split(":")[0] not in PLATFORMS:
            parser.error(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
        problems, sdists = check_target(target, hashes)
        print(f"{target}: {'FAIL' if problems else 'ok'}" + (f" (builds {', '.join(sdists)})" if sdists else ""))
        for p in problems:
            print(f"  {p}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
