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

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = ROOT / "requirements.lock"
lock_tool = load_script(ROOT / ".ci" / "lock.py", "lock_tool")


def declared() -> dict[str, Requirement]:
    """pyproject.toml's base dependencies and dev extra, by normalised name (the lock's inputs)."""
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    return {canonical(r.name): r for r in reqs}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pins() -> dict[str, tuple[Version, bool]]:
    """The lock's `name==version` pins: name -> (version, whether a sha256 follows)."""
    found: dict[str, tuple[Version, bool]] = {}
    lines = LOCK.read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith((" ", "#", "-")) and "==" in line:
            name, _, rest = line.partition("==")
            hashed = i + 1 < len(lines) and lines[i + 1].strip().startswith("--hash=sha256:")
            found[canonical(name.split("[")[0])] = (Version(rest.split()[0].rstrip("\\")), hashed)
    return found


def test_pyproject_cannot_resolve_a_compromised_lightning_and_needs_the_torch_with_muon():
    deps = declared()
    for name in ("lightning", "pytorch-lightning"):
        spec = deps[name].specifier
        assert not any(v in spec for v in ("2.6.2", "2.6.3", "2.4.0", "2.6.1")), f"{name}{spec}"
        assert "2.6.4" in spec and "2.7.0" not in spec
    torch = deps["torch"].specifier
    assert "2.8.99" not in torch and "2.9.0" in torch  # torch.optim.Muon and torch.optim._muon arrive in 2.9


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
    assert locked["lightning"][0] not in (Version("2.6.2"), Version("2.6.3"))
    assert str(locked["torch"][0]) == "2.13.0"  # no local label: a GPU box's CUDA 2.13.0 satisfies it
    assert "setuptools" in locked  # the build backend too: `pip install --no-build-isolation -e .`
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
