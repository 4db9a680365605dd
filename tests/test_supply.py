"""The supply line: pyproject.toml's ranges, the versions installed here, and requirements.lock.

pyproject.toml cannot resolve the compromised Lightning releases, torch's floor is the one lm's code needs, the
installed torch and Lightning are inside the ranges lm.base.private_api was tested with (`[tool.lm.tested]`),
and the lock pins, with hashes, what pyproject.toml asks for (`.ci/lock.py`, which CI runs before installing).
"""

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .helpers import load_script, sha256

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = ROOT / "requirements.lock"
lock_tool = load_script(ROOT / ".ci" / "lock.py", "lock_tool")
targets = load_script(ROOT / ".ci" / "lock_targets.py", "lock_targets")


def declared() -> dict[str, Requirement]:
    """pyproject.toml's base dependencies and dev extra, by normalised name (the lock's inputs)."""
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    return {canonical(r.name): r for r in reqs}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pins() -> dict[str, tuple[Version, bool]]:
    """The lock's `name==version` pins for this machine's environment (markers evaluated): name -> (version,
    whether a sha256 follows)."""
    found: dict[str, tuple[Version, bool]] = {}
    lines = LOCK.read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith((" ", "#", "-")) and "==" in line:
            req = Requirement(line.rstrip(" \\"))
            if req.marker is not None and not req.marker.evaluate(default_environment() | {"extra": ""}):
                continue
            hashed = i + 1 < len(lines) and lines[i + 1].strip().startswith("--hash=sha256:")
            found[canonical(req.name)] = (Version(str(req.specifier).removeprefix("==")), hashed)
    return found


def test_pyproject_cannot_resolve_a_release_with_a_known_advisory():
    deps = declared()
    for name in ("lightning", "pytorch-lightning"):
        spec = deps[name].specifier
        # 2.6.2/2.6.3 compromised (GHSA-w37p-236h-pfx3); before 2.6.6 load_from_checkpoint runs code even with
        # weights_only=True (CVE-2026-58659).
        assert not any(v in spec for v in ("2.6.2", "2.6.3", "2.6.4", "2.6.5", "2.4.0")), f"{name}{spec}"
        assert "2.6.6" in spec and "2.7.0" not in spec
    torch = deps["torch"].specifier
    assert "2.9.1" not in torch and "2.10.0" in torch  # the weights_only unpickler fix (GHSA-63cw-57p8-fm3p)
    # 2.11 and 2.12: their async sharded save fails (docs/development.md).
    assert "2.11.0" not in torch and "2.12.1" not in torch


def test_the_tested_ranges_are_what_pyproject_admits():
    """[tool.lm.tested] and the dependency ranges say the same: a version the pins admit was tested."""
    tested = PYPROJECT["tool"]["lm"]["tested"]
    for name in ("torch", "lightning"):
        assert SpecifierSet(tested[name]) == declared()[name].specifier, (name, tested[name])


def test_installed_torch_and_lightning_are_what_the_private_api_adapter_was_tested_with():
    tested = PYPROJECT["tool"]["lm"]["tested"]
    assert set(tested) == {"torch", "lightning"}
    for name, spec in tested.items():
        have = Version(version(name))
        assert have in SpecifierSet(spec, prereleases=True), (
            f"{name} {have} is installed, but lm.base.private_api was tested with {name}{spec} "
            f"([tool.lm.tested] in pyproject.toml): run tests/base/test_private_api.py and tests/checkpoint on "
            f"it, then widen the range (and the ceiling in `dependencies`) or install from requirements.lock"
        )
        allowed = declared()[name].specifier
        assert allowed.contains(have.public), f"{name} {have} is outside pyproject.toml's {name}{allowed}"


def test_the_lock_pins_with_hashes_what_pyproject_asks_for():
    assert lock_tool.problem() is None, lock_tool.problem()
    locked = pins()
    assert locked and all(hashed for _, hashed in locked.values())  # every pin carries its sha256
    env = default_environment() | {"extra": "dev"}
    for name, req in declared().items():
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        assert name in locked, f"{name} is a dependency and not in requirements.lock: run `just lock`"
        assert req.specifier.contains(locked[name][0], prereleases=True), (
            f"{name}=={locked[name][0]} vs {req}"
        )
    assert locked["lightning"][0] >= Version("2.6.6")
    assert str(locked["torch"][0]) == "2.13.0"  # PyPI's: no local label, nothing only our machines hold
    assert "setuptools" in locked  # the build backend too: `pip install --no-build-isolation -e .`
    build = (ROOT / "requirements-build.lock").read_text()  # installed first, so sdists build with it
    assert lock_tool.pin_block(LOCK.read_text(), "setuptools") in build
    # Each pin with extras is repeated without them (.ci/lock.py's plain_pins), for the pip a venv starts with.
    text = LOCK.read_text()
    for name in re.findall(r"^([\w.-]+)\[[^\]]+\]==", text, re.M):
        assert re.search(rf"^{re.escape(name)}==", text, re.M), (
            f"{name}[...] has no plain pin: run `just lock`"
        )


@pytest.mark.parametrize(
    "edit",
    [
        ('"scipy>=1.10",', '"scipy>=1.11",'),  # a floor moved
        ('"pytest>=8",', '"pytest>=8", "rich>=13",'),  # a dev dependency added
        ('requires = ["setuptools>=68"]', 'requires = ["setuptools>=70"]'),  # the build backend
    ],
)
def test_a_pyproject_the_lock_was_not_compiled_from_fails_the_check(tmp_path, edit):
    text = (ROOT / "pyproject.toml").read_text()
    assert edit[0] in text
    changed = tmp_path / "pyproject.toml"
    changed.write_text(text.replace(edit[0], edit[1], 1))
    why = lock_tool.problem(LOCK, changed)
    assert why is not None and "just lock" in why
    # A comment or a ruff setting is not an input: the lock stays valid.
    changed.write_text(text.replace("[tool.ruff]", "# a note\n[tool.ruff]", 1))
    assert lock_tool.problem(LOCK, changed) is None


def test_ci_s_lock_check_passes_here_and_fails_on_an_unstamped_lock(tmp_path):
    ok = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "lock.py"), "check"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    bare = tmp_path / "requirements.lock"
    bare.write_text(lock_tool.STAMP.sub("", LOCK.read_text()))
    assert "no '# inputs: sha256' line" in lock_tool.problem(bare)


# torch 2.13.0's files on PyPI for three targets (recorded from the index's JSON simple API, 2026-11-29).
TORCH_FILES = (
    ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "60fcdcb2" + "0" * 56),
    ("torch-2.13.0-cp311-cp311-manylinux_2_28_aarch64.whl", "092790c6" + "0" * 56),
    ("torch-2.13.0-cp311-cp311-macosx_14_0_arm64.whl", "e76f9bce" + "0" * 56),
    ("torch-2.13.0-cp311-cp311-win_amd64.whl", "a0d8b11f" + "0" * 56),
)


@pytest.mark.parametrize(
    ("platform", "picked"),
    [("linux-x86_64", 0), ("linux-aarch64", 1), ("macos-arm64", 2)],
)
def test_the_target_check_picks_the_file_pip_would_take_on_each_platform(platform, picked):
    tags = targets.supported_tags(targets.PLATFORMS[platform], "3.11")
    assert targets.chosen_file(TORCH_FILES, tags) == TORCH_FILES[picked]
    # A pure-Python wheel beats the sdist; a release with only an sdist builds it; none at all is reported.
    pure = (("x-1.0.tar.gz", "s" * 64), ("x-1.0-py3-none-any.whl", "w" * 64))
    assert targets.chosen_file(pure, tags) == pure[1]
    assert targets.chosen_file(pure[:1], tags) == pure[0]
    assert targets.chosen_file((("x-1.0-cp312-cp312-win_amd64.whl", "z" * 64),), tags) is None


def test_the_target_check_fails_on_a_platform_whose_file_has_no_hash_in_the_lock(monkeypatch):
    """The check CI runs per target, with the resolver's answer and the index's file list given: a lock that
    carries only the x86_64 wheel's hash (as the CPU-wheel lock carried only that file's) fails on aarch64."""
    lock = "torch==2.13.0 \\\n    --hash=sha256:" + TORCH_FILES[0][1] + "\n"
    monkeypatch.setattr(targets, "resolve", lambda platform, python: {"torch": "2.13.0"})
    monkeypatch.setattr(targets, "release_files", lambda name, version: TORCH_FILES)
    hashes = targets.lock_hashes(lock)
    assert targets.check_target("linux-x86_64:3.11", hashes) == ([], [])
    problems, _ = targets.check_target("linux-aarch64:3.11", hashes)
    assert problems and "manylinux_2_28_aarch64.whl" in problems[0] and "no hash in the lock" in problems[0]
    monkeypatch.setattr(targets, "resolve", lambda platform, python: {"torch": "2.13.0", "triton": "3.7.1"})
    problems, _ = targets.check_target("linux-x86_64:3.11", hashes)
    assert problems == ["linux-x86_64:3.11: triton==3.7.1 is needed there and not pinned in the lock"]


def test_the_lock_names_every_target_platforms_torch_file():
    """Each of torch 2.13.0's wheels for the targets users have is hashed in the lock (Linux x86_64 and aarch64,
    macOS arm64, CPython 3.10-3.13): the lock is not one machine's."""
    torch_hashes = targets.lock_hashes(LOCK.read_text())[("torch", "2.13.0")]
    for prefix in TORCH_FILES[:3]:
        assert any(h.startswith(prefix[1][:8]) for h in torch_hashes), prefix[0]
    assert len(torch_hashes) >= 3 * 4


def test_ci_s_cpu_lock_swaps_torch_for_the_cpu_wheel_and_drops_only_cuda_packages(tmp_path):
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    text = LOCK.read_text()
    cpu = lock_tool.cpu_lock(text, wheel)
    kept = {canonical(m) for m in re.findall(r"^([A-Za-z0-9_.-]+)[\[=]", cpu, re.M)}
    dropped = {canonical(m) for m in re.findall(r"^([A-Za-z0-9_.-]+)[\[=]", text, re.M)} - kept
    assert dropped and all(
        n.startswith(("nvidia-", "cuda-")) or n in ("triton", "liger-kernel") for n in dropped
    )
    assert re.search(
        r"^torch==2\.13\.0 \\\n    --hash=sha256:" + sha256(b"not really a wheel") + "\n", cpu, re.M
    )
    with pytest.raises(SystemExit, match="not torch 2.13.0's CPU wheel"):
        lock_tool.cpu_lock(text, tmp_path / "torch-2.12.0+cpu-cp311-cp311-linux_x86_64.whl")


def test_ci_takes_the_cpu_wheel_only_where_the_machine_keeps_the_locked_ones(tmp_path):
    """`.ci/lock.py ci`: the lock with this Python's CPU wheel of the locked torch swapped in, else the lock."""
    text = LOCK.read_text()
    assert lock_tool.ci_lock(text, "") == text and lock_tool.ci_lock(text, str(tmp_path)) == text
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    (tmp_path / f"torch-2.12.0+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").write_bytes(b"another torch")
    (tmp_path / "torch-2.13.0+cpu-cp39-cp39-manylinux_2_28_x86_64.whl").write_bytes(b"another Python")
    assert lock_tool.local_cpu_wheel(text, f"/nonexistent {tmp_path}") is None
    wheel = tmp_path / f"torch-2.13.0+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"the locked one")
    assert lock_tool.local_cpu_wheel(text, f"/nonexistent {tmp_path}") == wheel
    assert lock_tool.ci_lock(text, str(tmp_path)) == lock_tool.cpu_lock(text, wheel)
