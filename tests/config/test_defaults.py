"""One source of each default: the dataclasses of lm.config hold every default, and a conf/ file holds only what
differs from them. A key that repeats the schema's value, or that no schema field has, fails here by name."""

from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from lm.config import LMConfig

from ..conftest import CONF

# Experiments are deltas over the composed defaults (they may set a key back to the schema's value on purpose);
# hydra/ configures Hydra itself, whose schema is not ours.
NOT_SCHEMA = {"experiment", "hydra"}
ROOT_ONLY_KEYS = {"defaults", "hydra"}  # train.yaml's composition and Hydra's settings, not LMConfig fields

GROUP_FILES = sorted(
    p
    for group in CONF.iterdir()
    if group.is_dir() and group.name not in NOT_SCHEMA
    for p in group.glob("*.yaml")
)
FILES = [CONF / "train.yaml", *GROUP_FILES]


def package(path: Path) -> str:
    """Where the file's keys land in the tree: '' (the root) for train.yaml and `# @package _global_` files."""
    if path.parent == CONF or "# @package _global_" in path.read_text():
        return ""
    return path.parent.name


def section(node: DictConfig, dotted: str) -> DictConfig:
    return OmegaConf.select(node, dotted) if dotted else node


def own_keys(path: Path) -> dict[str, Any]:
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    return {k: v for k, v in raw.items() if k not in ROOT_ONLY_KEYS}


def base(path: Path) -> DictConfig:
    """What the file's keys are merged onto: the schema's section, then the options its own defaults list
    names in the same group (`trainer/cpu` starts from `trainer/default`)."""
    node = section(OmegaConf.structured(LMConfig), package(path))
    siblings = [] if path.parent == CONF else OmegaConf.load(path).get("defaults") or []
    for entry in siblings:
        if isinstance(entry, str) and entry != "_self_":
            parent = path.parent / f"{entry}.yaml"
            node = OmegaConf.merge(base(parent), own_keys(parent))
    return node


def is_schema(node: Any) -> bool:
    return isinstance(node, DictConfig) and is_dataclass(OmegaConf.get_type(node))


def same(a: Any, b: Any) -> bool:
    """Equal as YAML values (120 == 120.0), but a bool never equals a number."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def problems(yaml: dict[str, Any], under: DictConfig, prefix: str, where: str) -> list[str]:
    """Keys of `yaml` that no field of the schema node `under` has, or that repeat its value."""
    out = []
    for key, value in yaml.items():
        name = f"{prefix}{key}"
        if key not in under:
            out.append(f"{where}: `{name}` is no field of the schema (lm.config); remove it or add the field")
            continue
        child = under._get_node(key)
        if is_schema(child) and isinstance(value, dict):
            out += problems(value, child, f"{name}.", where)
        elif same(value, OmegaConf.to_container(under, resolve=False)[key]):
            out.append(
                f"{where}: `{name}: {value!r}` repeats the default; delete the line (lm.config holds it)"
            )
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_no_conf_key_repeats_or_invents_a_default(path):
    pkg = package(path)
    found = problems(own_keys(path), base(path), f"{pkg}." if pkg else "", str(path.relative_to(CONF.parent)))
    assert not found, "\n".join(found)


def test_the_check_flags_a_repeat_and_an_unknown_key():
    """The check itself can fail: a repeated default and a misspelt key are both named."""
    trainer = section(OmegaConf.structured(LMConfig), "trainer")
    found = problems({"max_steps": 300, "max_stepz": 5, "val_every_steps": 7}, trainer, "trainer.", "x.yaml")
    assert found == [
        "x.yaml: `trainer.max_steps: 300` repeats the default; delete the line (lm.config holds it)",
        "x.yaml: `trainer.max_stepz` is no field of the schema (lm.config); remove it or add the field",
    ]
