"""The `lm` command: the verbs around training (training itself is `python train.py`).

`lm <verb> --help` gives each verb's options; docs/commands.md says what each does, with the manual's pages."""

from __future__ import annotations

import argparse
import logging
import sys

from lm.base.exits import VerbExit, readable, verb_exit_code
from lm.cli.eval_verbs import add_evals
from lm.cli.plan_verbs import add_core_map, add_plan, add_sky
from lm.cli.run_verbs import (
    add_ablate,
    add_config_verbs,
    add_doctor_and_bench,
    add_run_readers,
    add_selftest,
    add_supervise,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lm", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs_in_order = (
        add_config_verbs, add_selftest, add_doctor_and_bench, add_run_readers, add_evals, add_supervise,
        add_ablate, add_sky, add_plan, add_core_map,
    )  # fmt: skip
    for add in verbs_in_order:
        add(verbs)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except Exception as e:
        if (code := verb_exit_code(e)) is None:
            raise  # a crash keeps its traceback (exit 1)
        message = f"lm {args.verb}: {readable(e)}"
        print(message, file=sys.stderr)
        raise VerbExit(code, message) from e  # 78 a refusal (a missing input or extra too), 69, 74
