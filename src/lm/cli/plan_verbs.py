"""`lm plan`, `lm core-map` and `lm sky`: what a budget buys, in loss, CORE and GPUs."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from lm.base.exits import Refused
from lm.cli.args import add_overrides

if TYPE_CHECKING:
    from lm.config import LMConfig
    from lm.numbers.loss_law import ChinchillaLaw


def cmd_plan(args: argparse.Namespace) -> None:
    from lm.config import compose, conf_dir, to_objects
    from lm.numbers.cost import load_catalog
    from lm.store.atomic import write_atomic
    from lm.tools import budget, corpus_size, sibling

    cfg = to_objects(compose(args.overrides))
    if args.scale_out:
        from lm.numbers.scale_out import scale_out_table

        gpus = [g for g in budget.pick_gpus(load_catalog(conf_dir()), args.gpu) if g.memory_gb]
        name = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("model=")), "the model")
        table = scale_out_table(
            name, cfg.model, [(g.name, g.memory_gb) for g in gpus], seq_len=cfg.data.seq_len
        )
        print(table)
        return
    goal = budget.Goal(
        usd=args.usd,
        target_loss=args.target_loss,
        hours=args.hours,
        pricing=args.pricing,
        target_core=args.target_core,
        confidence=args.confidence,
    )
    core = plan_core_map(args)
    gpus = budget.pick_gpus(load_catalog(conf_dir()), args.gpu)
    law, interval = plan_law(args, cfg)
    corpus = (
        corpus_size.CorpusSize(args.corpus_tokens, estimated=False, how="given with --corpus-tokens")
        if args.corpus_tokens
        else corpus_size.corpus_size(cfg.data)
    )
    print(f"corpus: {corpus}")
    plan_with = functools.partial(
        budget.make_plans,
        presets=budget.load_presets(conf_dir(), cfg.data),
        gpus=gpus,
        seq_len=cfg.data.seq_len,
        tokens_per_step=args.tokens_per_step,
        corpus=corpus.tokens,
        interruptions_per_hour=args.interruptions_per_hour,
        bench_dir=Path(cfg.bench.out_dir),
        tokens_per_sec=args.tokens_per_sec,
        price_per_hour=args.price_per_hour,
        law=law,
        interval=interval,
        ramp_steps=cfg.data.batch_ramp_steps,
        ramp_start=cfg.data.batch_ramp_start,
        core=core,
    )
    plans = plan_with(goal)
    missed_core = not plans and goal.target_core is not None and goal.confidence > 0.5
    even_odds = plan_with(replace(goal, confidence=0.5)) if missed_core else None  # what the map can promise
    budget.check_goal(goal, plans, gpus, law, core, even_odds)
    print(budget.render(plans, args.top, corpus, core))
    command = "lm plan " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["plan"] else "lm plan"
    files = sibling.plan_files(plans[0], args.name, command, corpus, law, cfg.data.seq_len, args.sibling)
    for path in files:  # every file refused before any is written
        budget.check_overwrite(Path(args.out_dir) / path)
    for path, (text, said) in files.items():
        write_atomic(Path(args.out_dir) / path, text)
        print(f"wrote {Path(args.out_dir) / path}{said}")


def plan_core_map(args: argparse.Namespace):
    """The loss-to-CORE map `lm plan` reads: --core-map's (its version, which --core-version may only repeat)
    or the public prior of --core-version (v1 by default)."""
    from lm.numbers.core_map import public_prior, read_map

    if not args.core_map:
        return public_prior(args.core_version or "v1")
    core = read_map(args.core_map)
    if args.core_version and args.core_version != core.version:
        raise Refused(
            f"--core-version {args.core_version} but {args.core_map} maps CORE {core.version}: drop "
            f"--core-version, or calibrate a {args.core_version} map (lm core-map ... --version {args.core_version})"
        )
    return core


def plan_law(args: argparse.Namespace, cfg: LMConfig) -> tuple[ChinchillaLaw, float | None]:
    """The law `lm plan` predicts with: calibrated now (--calibrate), read from --law, or the published fit."""
    from lm.numbers import loss_law
    from lm.tools import calibrate

    if args.calibrate:
        law_file = Path(args.law or Path(cfg.run.root) / "calibration" / "calibration.json")
        record = calibrate.calibrate(
            args.overrides,
            law_file.parent,
            calibrate.parse_shapes(args.calibrate_shapes),
            [int(s) for s in args.calibrate_steps.split(",")],
            cfg.data,
        )
        calibrate.write_calibration(law_file, record)
        print(calibrate.describe(record))
        print(f"wrote {law_file}: later plans use it with --law {law_file}")
        return calibrate.load_law(law_file)
    if args.law:
        return calibrate.load_law(Path(args.law))
    return loss_law.BESIROGLU, None


def add_plan(verbs) -> None:
    p = verbs.add_parser("plan", help="rank model x GPU plans for a budget; write the best as an experiment")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--usd", type=float, help="dollars to spend")
    goal.add_argument("--target-loss", type=float, help="the loss to reach, as cheaply as possible")
    goal.add_argument("--hours", type=float, help="wall-clock hours to train")
    goal.add_argument(
        "--target-core", type=float, help="the CORE to reach (e.g. 0.2565, GPT-2), as cheaply as possible"
    )
    goal.add_argument(
        "--scale-out",
        action="store_true",
        help="past one GPU: GPUs needed per catalog GPU, host memory and save stall per checkpoint format",
    )
    p.add_argument("--gpu", nargs="+", help="catalog GPUs to consider (conf/gpu/; default: all but cpu)")
    p.add_argument(
        "--pricing", choices=["on_demand", "spot"], default="on_demand", help="price --usd buys at"
    )
    p.add_argument(
        "--corpus-tokens",
        type=int,
        help="training tokens of the corpus (default: its manifest; estimated when not prepared)",
    )
    p.add_argument("--tokens-per-step", type=int, default=131_072, help="global batch in tokens (131,072)")
    p.add_argument("--interruptions-per-hour", type=float, default=0.1, help="spot interruption rate (0.1)")
    p.add_argument("--tokens-per-sec", type=float, help="a measured throughput instead of peak x MFU")
    p.add_argument("--price-per-hour", type=float, help="$/h instead of the catalog's prices")
    p.add_argument("--top", type=int, default=10, help="plans to show (10)")
    p.add_argument("--name", default="planned", help="experiment name (default: planned)")
    p.add_argument("--out-dir", default="conf/experiment", help="where the experiment file goes")
    p.add_argument(
        "--sibling",
        action="store_true",
        help="also write <name>_sibling.yaml, the plan at half the width and the same tokens per parameter "
        "(~6%% of its cost), and name its run as the plan's forecast reference",
    )
    p.add_argument(
        "--confidence", type=float, default=0.9, help="P(CORE >= --target-core) a plan must reach (0.9)"
    )
    p.add_argument(
        "--core-map", help="a core_map.json of `lm core-map` (default: the public prior, uncalibrated)"
    )
    p.add_argument(
        "--core-version", choices=["v1", "v2"], help="CORE's baseline table (default v1, or --core-map's)"
    )
    p.add_argument("--calibrate", action="store_true", help="fit the loss law to short runs on this corpus")
    p.add_argument("--calibrate-shapes", default="2x64,2x128,4x128", help="n_layer x d_model of those runs")
    p.add_argument("--calibrate-steps", default="100,300", help="training steps of each shape")
    p.add_argument(
        "--law",
        help="calibration file to read (or, with --calibrate, to write; default: "
        "<run.root>/calibration/calibration.json)",
    )
    add_overrides(p, "data=text data.paths='corpus/*.txt'")
    p.set_defaults(fn=cmd_plan)


def cmd_core_map(args: argparse.Namespace) -> None:
    from lm.store.atomic import write_atomic
    from lm.tools import calibrate

    record = calibrate.core_map_record([Path(d) for d in args.runs], args.version)
    print(calibrate.describe_core_map(record))
    write_atomic(Path(args.out), json.dumps(record, indent=2) + "\n")
    print(
        f"wrote {args.out}: plan with it: lm plan --core-map {args.out} ...; in a run: early_stopping.core_map"
    )


def add_core_map(verbs) -> None:
    verb = verbs.add_parser(
        "core-map", help="calibrate the loss-to-CORE map on your runs (evals=core at their ends)"
    )
    verb.add_argument("runs", nargs="+", help="finished run directories with CORE in evals.jsonl")
    verb.add_argument("--version", choices=["v1", "v2"], default="v1", help="CORE's baseline table (v1)")
    verb.add_argument("--out", default="runs/calibration/core_map.json", help="where the map goes")
    verb.set_defaults(fn=cmd_core_map)


def cmd_sky(args: argparse.Namespace) -> None:
    from lm.config import compose, conf_dir, to_objects
    from lm.numbers.cost import ASSUMED_MFU, load_catalog
    from lm.store.atomic import write_atomic
    from lm.tools.sky import rank_gpus, render_task

    overrides = args.overrides or ["+experiment=plan_1b"]
    cfg = to_objects(compose(overrides))
    every = cfg.activation_checkpointing.every
    mfu = ASSUMED_MFU if args.mfu is None else args.mfu
    catalog, bench = load_catalog(conf_dir()), Path(cfg.bench.out_dir)  # a GPU lm bench measured: its MFU
    ranked = rank_gpus(
        cfg.model, cfg.data, every, catalog, args.pricing, mfu, bench if bench.is_dir() else None
    )
    text = render_task(overrides, ranked, mfu)
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            sys.exit(f"lm sky: {out} is stale; regenerate it: lm sky --out {out} {' '.join(overrides)}")
        print(f"{out} is up to date")
        return
    write_atomic(out, text)
    for c in ranked:
        per_b = f"${c.usd_per_billion_tokens:.2f}/B tokens" if c.usd_per_billion_tokens else "unpriced"
        print(f"{c.gpu.name:<13} {per_b:<18} {c.why_not or 'candidate: ' + str(c.sky_name)}")
    print(f"wrote {out}: sky jobs launch -n lm {out} --env CKPT_BUCKET=<bucket>")


def add_sky(verbs) -> None:
    sky = verbs.add_parser("sky", help="rank GPUs by $/token for a config; write the SkyPilot task")
    sky.add_argument("--out", default="sky/train.yaml", help="the task file (default: sky/train.yaml)")
    sky.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="assumed model FLOPs utilisation (default: the doctor's, lm.numbers.cost.ASSUMED_MFU)",
    )
    sky.add_argument("--pricing", choices=["spot", "on_demand"], default="spot", help="price to rank by")
    sky.add_argument("--check", action="store_true", help="only check that --out is up to date")
    sky.add_argument("overrides", nargs="*", help="Hydra overrides (default: +experiment=plan_1b)")
    sky.set_defaults(fn=cmd_sky)
