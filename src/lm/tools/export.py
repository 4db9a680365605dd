"""`lm export`: a run's checkpoint as a Hugging Face Llama folder that transformers loads unmodified, or
(`--format gguf`) as one GGUF file that llama.cpp loads (`lm.tools.export_gguf`).

    <out>/  config.json  generation_config.json  model*.safetensors  tokenizer.json  tokenizer_config.json
            README.md (the model card: the run's headline numbers, benchmark scores, config, license)

Everything is written by transformers' own `save_pretrained` (model, generation config, tokenizer), into a
temporary sibling renamed to `<out>` at the end: an interrupted export leaves no half-written model behind
a name that loads. From there: `vllm serve <out>`, the Hub; the GGUF file: `llama-cli -m <out>`, Ollama.
The model card is meant to be published with the weights: the config it quotes has its local absolute
paths replaced (`LOCAL`), and the license is `run.license` or `--license`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lm.base.exits import Refused
from lm.base.scores import core_markdown, core_name, is_core
from lm.interop.hf import VOCAB, Loaded, check_portable, hf_tokenizer, load_run, to_hf_model
from lm.run.report import headline
from lm.store import rundir
from lm.store.atomic import write_atomic
from lm.tools.export_gguf import GGUF_DTYPES, check_gguf_portable, write_gguf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORMATS = {"hf": DTYPES, "gguf": GGUF_DTYPES}
"""--format -> the --dtype values it takes."""
MAX_SHARD_SIZE = "4GB"
"""Safetensors files above this are split (a 1B model in fp32 is two files, in bf16 one)."""
log = logging.getLogger(__name__)
LOCAL = "<local path>"
"""What the model card's config shows instead of an absolute path of the training machine."""
ABSOLUTE = re.compile(r"^(/|~|file:|[A-Za-z]:[\\/])")


def export(
    path: str | Path,
    out: str | Path,
    *,
    format: str = "hf",
    dtype: str = "fp32",
    vocab: str = VOCAB[0],
    max_shard_size: str | int = MAX_SHARD_SIZE,
    license: str | None = None,
) -> Path:
    """Export the run directory or checkpoint `path` to `out` (which must not exist yet): a Hugging Face
    folder, or a GGUF file with `format="gguf"`. `license` overrides the run's `run.license`."""
    out = Path(out)
    if format not in FORMATS:
        raise Refused(f"format {format!r}: use one of {list(FORMATS)}")
    if dtype not in FORMATS[format] or vocab not in VOCAB:
        raise Refused(
            f"dtype {dtype!r} / vocab {vocab!r}: --format {format} takes --dtype {list(FORMATS[format])}, "
            f"--vocab {list(VOCAB)}"
        )
    if out.exists():
        raise Refused(f"{out} exists; remove it or choose another --out")
    run = load_run(path)
    (check_gguf_portable if format == "gguf" else check_portable)(run.model_cfg)  # before anything is written
    license = license or run_license(rundir.read_config(run.run_dir))
    if not license:
        log.warning("no license: the export states none; set run.license=<id> or lm export --license <id>")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if format == "gguf":
            write_gguf(run, tmp, dtype=dtype, vocab=vocab, license=license)
        else:
            write_folder(run, tmp, DTYPES[dtype], vocab, max_shard_size, license)
        tmp.rename(out)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    return out


def run_license(cfg: DictConfig | None) -> str | None:
    """The run's `run.license` (None when unset, or in a config.yaml written before the key existed)."""
    return None if cfg is None else OmegaConf.select(cfg, "run.license", default=None)


def write_folder(
    run: Loaded,
    folder: Path,
    dtype: torch.dtype,
    vocab: str,
    max_shard_size: str | int,
    license: str | None = None,
) -> None:
    """Model, generation config, tokenizer and model card into `folder`."""
    hf = to_hf_model(run.model, eos_id=run.eot_id, vocab=vocab, dtype=dtype)
    hf.save_pretrained(folder, max_shard_size=max_shard_size)
    hf_tokenizer(run.tokenizer_path, run.eot_token, run.model_cfg.max_seq_len).save_pretrained(folder)
    portable_tokenizer_class(folder / "tokenizer_config.json")
    card = model_card(run, str(dtype).removeprefix("torch."), vocab, license)
    write_atomic(folder / "README.md", card)
    for path in folder.iterdir():  # safetensors shards come out 0600: a server running as another user
        path.chmod(path.stat().st_mode | 0o044)  # (a container's vLLM) could not read them


def portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class `PreTrainedTokenizerFast`, which transformers 4.x and 5.x both load:
    transformers 5 writes its new name `TokenizersBackend`, unknown to the 4.x that vLLM and others pin."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_atomic(path, json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def model_card(run: Loaded, dtype: str, vocab: str, license: str | None = None) -> str:
    """README.md of the export: where it comes from, what it cost, how it scores, how it was configured;
    nothing of the training machine (its absolute paths are replaced by `LOCAL`)."""
    cfg = rundir.read_config(run.run_dir)
    ledger = rundir.read_ledger(run.run_dir)
    scalars = rundir.read_scalars(run.run_dir)
    numbers = headline(cfg, scalars, ledger)
    if ledger and ledger.get("tokens"):  # the scalar is logged every log_every_n_steps; the ledger always
        numbers.setdefault("tokens trained", f"{ledger['tokens']:,} (step {ledger['step']})")
    if "val/bpb" in scalars:  # the tokenizer-independent number, comparable across vocabularies
        bpb = scalars["val/bpb"]
        numbers["validation bits per byte"] = f"{bpb.values[-1]:.4f} (step {bpb.steps[-1] + 1})"
    lines = [
        "---",
        *([f"license: {json.dumps(license)}"] if license else []),
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"tags: [{'qwen3' if run.model_cfg.qk_norm else 'llama'}, lm]",
        "---",
        f"# {run.run_dir.name}",
        "",
        f"A {'Qwen3' if run.model_cfg.qk_norm else 'Llama'}-architecture decoder trained from scratch with `lm`, exported from `{run.ckpt.name}` at step "
        f"{run.step} ({dtype}, padded vocabulary rows: {vocab}). End of text `{run.eot_token}` (id "
        f"{run.eot_id}) is eos, bos and the tokenizer's pad token (the only special token).",
        "",
        f"License: {license}."
        if license
        else "License: not stated (set `run.license` or `lm export --license`).",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in numbers.items()),
        "",
        *scores_section(run_scores(run)),
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>")',
        "```",
        "",
        "## Training config",
        "",
        "```yaml",
        OmegaConf.to_yaml(OmegaConf.create(portable(OmegaConf.to_container(cfg)))).rstrip()
        if cfg is not None
        else "# config.yaml is missing from the run directory",
        "```",
    ]
    return "\n".join(lines) + "\n"


def portable(value: Any) -> Any:
    """A config container with every absolute local path (`/...`, `~/...`, `file:...`, `C:\\...`) replaced
    by `LOCAL`: where the run lived on its machine says nothing about the model and may name a user."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    return LOCAL if isinstance(value, str) and ABSOLUTE.match(value) else value


def run_scores(run: Loaded) -> dict | None:
    """The benchmark scores to show: the run's `lm eval` (eval.json), else its last milestone evaluation
    (evals.jsonl) at or before the exported step."""
    record = rundir.read_record(run.run_dir / rundir.EVAL)
    if record and record.get("scores"):
        return record
    milestones = [r for r in rundir.read_evals(run.run_dir) if r["step"] <= run.step and r.get("scores")]
    return milestones[-1] if milestones else None


def scores_section(record: dict | None) -> list[str]:
    """The run's benchmark scores (task -> metric -> value), if it was evaluated."""
    if not record or not record.get("scores"):
        return []
    limit = f", at most {record['limit']} examples per task" if record.get("limit") else ""
    step = f", step {record['step']}" if record.get("step") is not None else ""
    lines = []
    if record.get("core"):  # its own section: the figure with every task it covers and what it left out
        core = record["core"]
        lines += [
            f"## {core_name(core)} (DCLM CORE, scored by lm{limit}{step})",
            "",
            core_markdown(core),
            "",
            "Each task's accuracy centred on its random baseline, `(acc - b) / (1 - b)`; CORE is their mean, "
            "+- its standard error (each task's binomial error, combined). v1 is the baseline table of "
            "nanochat's leaderboard (GPT-2 = 0.2565), v2 DCLM's after its 2025-09-05 correction."
            + (
                ""
                if core["label"] == "CORE"
                else " Not all 22 tasks: not comparable with a full CORE figure."
            ),
            "",
        ]
    scores = {t: m for t, m in record["scores"].items() if not is_core(t)}
    if scores:
        lines += [f"## Benchmarks ({limit.removeprefix(', ') or 'every example'}{step})", ""]
        lines += ["| task | metric | value |", "|---|---|---|"]
        for task, metrics in scores.items():
            lines += [f"| {task} | {m} | {v:.4f} |" for m, v in metrics.items() if not m.endswith("_stderr")]
        lines.append("")
    return lines
