"""The verbs around one run: its config and data, preflight and benchmarks of speed, readers of its files,
sampling and export, supervision, the selftest and ablations."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from lm.base.exits import EXIT_CONFIG, Refused
from lm.cli.args import add_overrides


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


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from lm.config import compose, to_objects
    from lm.data.shards import sample_tokenizer

    cfg = to_objects(compose(args.overrides)).data
    out = Path(args.out)
    sha = sample_tokenizer(cfg, out)
    print(f"wrote {out} (vocabulary {cfg.vocab_size}, sha256 {sha})")
    print(f"use it: lm prepare data.tokenizer={out} ...  and  python train.py data.tokenizer={out} ...")


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


def cmd_report(args: argparse.Namespace) -> None:
    from lm.run.report import write_report

    print(f"wrote {write_report(args.run_dir)}")


def cmd_sweep_summary(args: argparse.Namespace) -> None:
    from lm.run.sweep import write_summary

    path, rows = write_summary(args.sweep_dir)
    print(path.read_text(), end="")
    print(f"wrote {path} and {path.with_suffix('.csv')} ({len(rows)} jobs)")


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
