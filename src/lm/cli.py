"""The `lm` command: verbs around training (training itself is `python train.py`).

lm config  [overrides...]   print the composed, validated config
lm prepare [overrides...]   build the tokenizer and token shards the config trains on
lm supervise [options] -- python train.py [overrides...]
                            rerun a training command after preemptions (exit 75) and crashes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from lm.config import register_configs, to_objects


def conf_dir() -> Path:
    """The Hydra config folder: $LM_CONF, else ./conf, else the checkout this package was installed from."""
    candidates = [os.environ.get("LM_CONF"), "conf", Path(__file__).resolve().parents[2] / "conf"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "train.yaml").is_file():
            return Path(candidate).resolve()
    raise SystemExit("lm: no conf/train.yaml found; run from the project root or set LM_CONF=/path/to/conf")


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


def cmd_supervise(args: argparse.Namespace) -> None:
    from lm.supervise import supervise

    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise ValueError("nothing to supervise; usage: lm supervise [options] -- python train.py [overrides]")
    sys.exit(
        supervise(
            cmd,
            max_failures=args.max_failures,
            max_restarts=args.max_restarts,
            backoff=args.backoff,
            max_backoff=args.max_backoff,
            start_secs=args.start_secs,
        )
    )


def add_supervise(verbs) -> None:
    verb = verbs.add_parser("supervise", help="rerun a training command after preemptions and crashes")
    verb.add_argument("--max-failures", type=int, default=5, help="crashes in a row (each soon after start)")
    verb.add_argument("--max-restarts", type=int, default=1000, help="restarts in all before giving up")
    verb.add_argument("--backoff", type=float, default=5.0, help="first wait after a crash, seconds; doubles")
    verb.add_argument("--max-backoff", type=float, default=300.0, help="longest wait after a crash, seconds")
    verb.add_argument(
        "--start-secs",
        type=float,
        default=60.0,
        help="a crash sooner than this after start is a failed start",
    )
    verb.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py [overrides]")
    verb.set_defaults(fn=cmd_supervise)


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
    add_supervise(verbs)
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lm {args.verb}: {e}")


if __name__ == "__main__":
    main()
