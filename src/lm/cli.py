"""The `lm` command: verbs around training (training itself is `python train.py`).

lm config  [overrides...]   print the composed, validated config
lm prepare [overrides...]   build the tokenizer and token shards the config trains on
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from lm.config import conf_dir, register_configs, to_objects


def compose_config(overrides: list[str]) -> DictConfig:
    """conf/train.yaml with command-line style overrides, as `python train.py` would compose it."""
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("train", overrides=overrides)


def cmd_config(args: argparse.Namespace) -> None:
    cfg = compose_config(args.overrides)
    to_objects(cfg)  # run the cross-field checks too
    print(OmegaConf.to_yaml(cfg, resolve=True), end="")


def cmd_prepare(args: argparse.Namespace) -> None:
    from lm.data import load_manifest, prepare

    data_dir = prepare(to_objects(compose_config(args.overrides)).data)
    manifest = load_manifest(data_dir)
    print(f"prepared {data_dir}")
    print(json.dumps({k: manifest[k] for k in ("source", "vocab_size", "splits") if k in manifest}, indent=2))


def cmd_report(args: argparse.Namespace) -> None:
    from lm.report import write_report

    print(f"wrote {write_report(args.run_dir)}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="lm", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name, fn, help_ in [
        ("config", cmd_config, "print the composed, validated config"),
        ("prepare", cmd_prepare, "build the tokenizer and token shards for the configured data"),
    ]:
        verb = verbs.add_parser(name, help=help_)
        verb.add_argument(
            "overrides", nargs="*", help="Hydra overrides, e.g. +experiment=phase1 data.vocab_size=8192"
        )
        verb.set_defaults(fn=fn)
    report = verbs.add_parser("report", help="write report.md and plots for a run directory")
    report.add_argument("run_dir", help="runs/<run.name>")
    report.set_defaults(fn=cmd_report)
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lm {args.verb}: {e}")


if __name__ == "__main__":
    main()
