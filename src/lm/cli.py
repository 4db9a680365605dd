"""The `lm` command: verbs around training (training itself is `python train.py`).

lm config  [overrides...]   print the composed, validated config
lm prepare [overrides...]   build the tokenizer and token shards the config trains on
lm report  RUN_DIR          write report.md and plots for a run
lm sample  CKPT [PROMPT]    continue a prompt with a checkpoint (no prompt: read prompts from stdin)
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


def cmd_sample(args: argparse.Namespace) -> None:
    import torch

    from lm.generate import complete, load_for_sampling

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_for_sampling(args.ckpt, device)
    dtype = torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else None
    prompts = [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in sys.stdin)
    for prompt in prompts:
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            text = complete(
                model,
                tokenizer,
                prompt,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                seed=args.seed,
            )
        print(prompt + text, flush=True)


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
    sample = verbs.add_parser("sample", help="continue a prompt with a checkpoint (KV-cached generation)")
    sample.add_argument("ckpt", help="runs/<run.name>/checkpoints/last.ckpt")
    sample.add_argument("prompt", nargs="?", help="text to continue; omitted: one prompt per line of stdin")
    sample.add_argument("--max-new-tokens", type=int, default=128)
    sample.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    sample.add_argument("--top-k", type=int, default=50)
    sample.add_argument("--seed", type=int, default=0, help="seed of temperature sampling")
    sample.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    sample.set_defaults(fn=cmd_sample)
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lm {args.verb}: {e}")


if __name__ == "__main__":
    main()
