"""What every verb's parser shares."""

from __future__ import annotations

import argparse

# Each verb imports what it runs inside its own function: torch, Lightning and transformers take seconds to
# import, and `lm --help`, `lm <verb> --help` or a refused argument should not wait for them
# (experiments/2026-11-24-startup).


def add_overrides(verb: argparse.ArgumentParser, example: str) -> None:
    verb.add_argument("overrides", nargs="*", help=f"Hydra overrides, e.g. {example}")
