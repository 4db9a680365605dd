"""`lm export`: a run's checkpoint as a Hugging Face Llama folder that transformers loads unmodified.

    <out>/  config.json  generation_config.json  model*.safetensors  tokenizer.json  tokenizer_config.json
            README.md (the model card: the run's headline numbers, benchmark scores, config)

Everything is written by transformers' own `save_pretrained` (model, generation config, tokenizer), into a
temporary sibling folder renamed to `<out>` at the end: an interrupted export leaves no half-written model
behind a name that loads. From there: `vllm serve <out>`, llama.cpp's `convert_hf_to_gguf.py <out>`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lm.engine.hf import VOCAB, Loaded, hf_tokenizer, load_run, to_hf_model
from lm.run.report import headline
from lm.store import rundir
from lm.store.atomic import write_atomic

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_SHARD_SIZE = "4GB"
"""Safetensors files above this are split (a 1B model in fp32 is two files, in bf16 one)."""


def export(
    path: str | Path,
    out: str | Path,
    *,
    dtype: str = "fp32",
    vocab: str = VOCAB[0],
    max_shard_size: str | int = MAX_SHARD_SIZE,
) -> Path:
    """Export the run directory or checkpoint `path` to the folder `out` (which must not exist yet)."""
    out = Path(out)
    if dtype not in DTYPES or vocab not in VOCAB:
        raise ValueError(f"dtype {dtype!r} / vocab {vocab!r}: use one of {list(DTYPES)} / {list(VOCAB)}")
    if out.exists():
        raise ValueError(f"{out} exists; remove it or choose another --out")
    run = load_run(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        write_folder(run, tmp, DTYPES[dtype], vocab, max_shard_size)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_folder(
    run: Loaded, folder: Path, dtype: torch.dtype, vocab: str, max_shard_size: str | int
) -> None:
    """Model, generation config, tokenizer and model card into `folder`."""
    hf = to_hf_model(run.model, eos_id=run.eot_id, vocab=vocab, dtype=dtype)
    hf.save_pretrained(folder, max_shard_size=max_shard_size)
    hf_tokenizer(run.tokenizer_path, run.eot_token, run.model_cfg.max_seq_len).save_pretrained(folder)
    portable_tokenizer_class(folder / "tokenizer_config.json")
    write_atomic(folder / "README.md", model_card(run, str(dtype).removeprefix("torch."), vocab))
    for path in folder.iterdir():  # safetensors shards come out 0600: a server running as another user
        path.chmod(path.stat().st_mode | 0o044)  # (a container's vLLM) could not read them


def portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class `PreTrainedTokenizerFast`, which transformers 4.x and 5.x both load:
    transformers 5 writes its new name `TokenizersBackend`, unknown to the 4.x that vLLM and others pin."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_atomic(path, json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def model_card(run: Loaded, dtype: str, vocab: str) -> str:
    """README.md of the export: where it comes from, what it cost, how it scores, how it was configured."""
    cfg = rundir.read_config(run.run_dir)
    ledger = rundir.read_ledger(run.run_dir)
    numbers = headline(cfg, rundir.read_scalars(run.run_dir), ledger)
    if ledger and ledger.get("tokens"):  # the scalar is logged every log_every_n_steps; the ledger always
        numbers.setdefault("tokens trained", f"{ledger['tokens']:,} (step {ledger['step']})")
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [llama, lm]",
        "---",
        f"# {run.run_dir.name}",
        "",
        f"A Llama-architecture decoder trained from scratch with `lm`, exported from `{run.ckpt.name}` at step "
        f"{run.step} ({dtype}, padded vocabulary rows: {vocab}). End of text `{run.eot_token}` (id "
        f"{run.eot_id}) is both eos and bos; there is no pad token.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in numbers.items()),
        "",
        *scores_section(rundir.read_record(run.run_dir / "eval.json")),
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
        OmegaConf.to_yaml(cfg).rstrip()
        if cfg is not None
        else "# config.yaml is missing from the run directory",
        "```",
    ]
    return "\n".join(lines) + "\n"


def scores_section(record: dict | None) -> list[str]:
    """The run's `lm eval` scores (eval.json: task -> metric -> value), if it was evaluated."""
    if not record or not record.get("scores"):
        return []
    limit = f", at most {record['limit']} examples per task" if record.get("limit") else ""
    lines = [
        f"## Benchmarks (lm-evaluation-harness{limit})",
        "",
        "| task | metric | value |",
        "|---|---|---|",
    ]
    for task, metrics in record["scores"].items():
        lines += [f"| {task} | {m} | {v:.4f} |" for m, v in metrics.items() if not m.endswith("_stderr")]
    return [*lines, ""]
