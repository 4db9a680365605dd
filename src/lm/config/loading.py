"""Composition: the config folder, the schemas registered with Hydra, `conf/train.yaml` composed with
overrides, and the composed tree turned into the typed `LMConfig` (every check run)."""

from __future__ import annotations

import os
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lm.base.exits import Refused
from lm.config.root import LMConfig


def init_tokenizer(init_from: str) -> str:
    """The tokenizer of `model.init_from`: its folder's tokenizer.json, or the Hub name itself (the model's
    ids are its tokenizer's ids)."""
    folder = Path(init_from).expanduser()
    if not folder.is_dir():
        return init_from
    if not (folder / "tokenizer.json").is_file():
        raise Refused(
            f"model.init_from={init_from} holds no tokenizer.json; set data.tokenizer to the tokenizer its "
            "weights were trained with (a tokenizer.json or a Hugging Face name)"
        )
    return str(folder / "tokenizer.json")


def conf_dir() -> Path:
    """The Hydra config folder: $LM_CONF, else ./conf, else the checkout this package was installed from."""
    candidates = [os.environ.get("LM_CONF"), "conf", Path(__file__).resolve().parents[3] / "conf"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "train.yaml").is_file():
            return Path(candidate).resolve()
    raise FileNotFoundError(
        "no conf/train.yaml found; run from the project root or set LM_CONF=/path/to/conf"
    )


def register_configs() -> None:
    """Make the schemas visible to Hydra (idempotent)."""
    ConfigStore.instance().store(name="lm_schema", node=LMConfig)


RENAMED = {"spot": "guards"}
"""Config keys that were renamed (old -> new): an override of the old one is refused, naming the new one."""


def refuse_renamed(overrides: list[str]) -> None:
    """Refuse an override of a renamed key (`spot.max_nonfinite=1`), naming the new spelling."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        head, _, rest = key.partition(".")
        if head in RENAMED:
            new = RENAMED[head] + (f".{rest}" if rest else "")
            value = override.split("=", 1)[1] if "=" in override else ""
            raise Refused(
                f"`{override}`: the `{head}` group is now `{RENAMED[head]}` (the guard settings: stop signals, "
                f"the throughput alarm, NaN and spike guards); write `{new}={value}` instead"
            )


def compose(overrides: list[str]) -> DictConfig:
    """conf/train.yaml with command-line style overrides, as `python train.py` would compose it."""
    refuse_renamed(overrides)
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def to_objects(cfg: DictConfig) -> LMConfig:
    """Resolve the composed config into dataclasses, running every `__post_init__` check.

    Compose-time typing catches unknown keys and wrong types; this catches values that are individually
    well-typed but wrong together (d_model not divisible by n_head, an unknown precision).

    `data.tokenizer` left unset with `model.init_from` becomes the folder's tokenizer: every command that
    composes these overrides (train, `lm prepare`, `lm doctor`) then sees the same data. That look at the disk
    is made here, after the schemas' checks, so that building the schemas reads no file.
    """
    try:
        node = OmegaConf.to_object(cfg)  # builds each dataclass, so every __post_init__ check runs here
    except OmegaConfBaseException as e:  # a `???` left unset, an interpolation that does not resolve
        raise Refused(f"the config does not resolve: {e}".replace("\n", "; ")) from e
    if not isinstance(node, LMConfig):
        raise TypeError("conf/train.yaml must list `lm_schema` first in its defaults so the tree is typed")
    if node.model.init_from is not None and node.data.tokenizer is None:
        node.data.tokenizer = init_tokenizer(node.model.init_from)
    return node
