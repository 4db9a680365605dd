"""lm <-> Hugging Face Llama: the weight map against transformers' own model, `lm export`, `model.init_from`."""

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.cli import main as lm
from lm.config import register_configs, to_objects
from lm.data import LMDataModule
from lm.data.stdlib import stdlib_documents
from lm.data.tokenizer import EOT, EOT_ID, train_tokenizer
from lm.engine.module import eager_cross_entropy
from lm.interop.hf import (
    Loaded,
    from_hf_state_dict,
    hf_config,
    load_init_from,
    load_run,
    model_config_from_hf,
    to_hf_model,
)
from lm.model import ModelConfig, Transformer
from lm.run.train import main
from lm.store import rundir
from lm.tools.export import LOCAL, MAX_SHARD_SIZE, export, model_card, run_license, write_folder

from ..conftest import CONF, TINY

VARIANTS = {
    "gqa": dict(n_head=4, n_kv_head=2),
    "tied": dict(tie_embeddings=True),
    "untied": dict(tie_embeddings=False),
    "padded_vocab": dict(vocab_size=300, vocab_multiple=128),
    "rope_theta_norm_eps": dict(rope_theta=500000.0, norm_eps=1e-6),
}


def tiny_lm(**overrides) -> Transformer:
    """A tiny lm decoder with every weight random, RMSNorm gains included (init leaves them at 1, where a
    swapped norm would hide)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=320, n_layer=2, d_model=64, n_head=4, max_seq_len=32, vocab_multiple=64)
    model = Transformer(ModelConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def max_logit_diff(model: Transformer, hf, vocab: int | None = None) -> float:
    ids = torch.randint(
        0, model.cfg.vocab_size, (2, model.cfg.max_seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours = model(ids)[..., :vocab]
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    return float((ours - theirs).abs().max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logits_match_transformers_llama(variant):
    model = tiny_lm(**VARIANTS[variant])
    hf = to_hf_model(model, eos_id=0)
    assert max_logit_diff(model, hf, vocab=model.cfg.vocab_size) < 1e-4
    # ...and back: the HF weights rebuild the same lm model.
    again = Transformer(model_config_from_hf(hf.config, vocab_multiple=model.cfg.vocab_multiple))
    again.load_state_dict(from_hf_state_dict(hf.state_dict(), again.cfg))
    ids = torch.arange(16)[None]
    assert torch.equal(again.eval()(ids), model(ids))


def test_truncate_cuts_the_padded_rows_and_keeps_the_real_logits():
    model = tiny_lm(vocab_size=300, vocab_multiple=128)  # 384 rows, 300 real
    hf = to_hf_model(model, eos_id=0)  # truncate: the default
    assert hf.config.vocab_size == 300 and hf.lm_head.weight.shape[0] == 300
    assert max_logit_diff(model, hf, vocab=300) < 1e-4
    assert not hf.generation_config.suppress_tokens  # no padding left to suppress
    keep = to_hf_model(model, eos_id=0, vocab="keep")
    assert keep.generation_config.suppress_tokens == list(range(300, 384))


def test_padding_ids_take_no_probability_in_lm():
    """lm's logits are -inf at the padding ids, so its softmax (and loss) is over the real vocabulary: the
    log-softmax equals that of the logits cut to the real ids, which was 2.6e-4 of the mass off before."""
    model = tiny_lm(vocab_size=300, vocab_multiple=128)
    with torch.no_grad():
        model.lm_head.weight[300:] = 1.0  # padding rows that would take most of the mass if unmasked
        logits = model(torch.arange(16)[None])
    assert torch.isneginf(logits[..., 300:]).all() and torch.isfinite(logits[..., :300]).all()
    assert torch.allclose(logits.log_softmax(-1)[..., :300], logits[..., :300].log_softmax(-1))
    # No gradient reaches a padding row through the masked logits (they stay as initialised).
    model.train()
    loss = eager_cross_entropy(model(torch.arange(16)[None]).flatten(0, 1), torch.arange(1, 17))
    loss.backward()
    assert not model.lm_head.weight.grad[300:].any() and model.lm_head.weight.grad[:300].any()


def test_the_run_keeps_one_tokenizer_and_refuses_another_on_resume(tmp_path):
    first, other = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text('{"version": "1.0", "model": "a"}')
    other.write_text('{"version": "1.0", "model": "b"}')
    run_dir = tmp_path / "run"
    rundir.keep_tokenizer(run_dir, first, "<|endoftext|>", 0, resumed=False)
    rundir.keep_tokenizer(run_dir, first, "<|endoftext|>", 0, resumed=True)  # a resume with the same one
    assert (run_dir / rundir.TOKENIZER).read_bytes() == first.read_bytes()
    assert rundir.read_tokenizer(run_dir)["eot_id"] == 0
    with pytest.raises(Refused, match="data.tokenizer=.*run/tokenizer.json"):
        rundir.keep_tokenizer(run_dir, other, "<|endoftext|>", 0, resumed=True)
    # A fresh start in the directory (nothing to resume) trains with, and keeps, its new tokenizer.
    rundir.keep_tokenizer(run_dir, other, "<|endoftext|>", 3, resumed=False)
    assert rundir.read_tokenizer(run_dir)["eot_id"] == 3
    (run_dir / rundir.TOKENIZER).write_text("edited")
    with pytest.raises(Refused, match="sha256 differs"):
        rundir.read_tokenizer(run_dir)


RUN = [
    *TINY,
    "data.num_workers=0",
    "trainer.max_steps=4",
    "trainer.val_every_steps=2",
    "trainer.limit_val_batches=1",
    "+trainer.extra.num_sanity_val_steps=0",
    "checkpoint.every_n_steps=2",
    "sampling=off",
    "model.vocab_multiple=96",  # 512 tokenizer ids padded to 576 rows: the padding is exported too
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_cache) -> Path:
    """One tiny real run (4 steps) that the tests below export, sample and continue."""
    runs = tmp_path_factory.mktemp("runs")
    main(compose_run(runs, data_cache, "run.name=tiny"))
    return runs / "tiny"


def compose_run(runs: Path, cache: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(
            "train", overrides=[*RUN, f"run.root={runs}", f"data.cache_dir={cache}", *overrides]
        )


@pytest.mark.slow
def test_export_of_a_run_loads_with_auto_classes_offline(run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "tiny export"  # a space: the printed command must still paste into a shell
    lm(["export", str(run), "--out", str(out)])
    assert f"vllm serve {shlex.quote(str(out))}\n" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary sibling was renamed, nothing left beside it
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
    assert config.get("pad_token_id") is None and config["eos_token_id"] == config["bos_token_id"] == 0
    loaded = load_run(run)
    padded, real = (
        loaded.model_cfg.padded_vocab_size,
        Tokenizer.from_file(str(loaded.tokenizer_path)).get_vocab_size(),
    )
    assert config["vocab_size"] == real < padded  # the real vocabulary: lm's softmax, HF's softmax
    generation = json.loads((out / "generation_config.json").read_text())
    assert not generation.get("suppress_tokens") and generation["eos_token_id"] == 0
    card = (out / "README.md").read_text()
    assert (
        "validation loss" in card and "dollars" in card and "tokens trained" in card and "n_layer: 2" in card
    )
    assert "| validation bits per byte | " in card and str(run.parent) not in card and LOCAL in card

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == loaded.eot_id
    # The same ids as lm's tokenizer, for unicode and an end-of-text inside the text.
    text = "naïve café — 東京 🚀\n" + loaded.eot_token + "def f(x):\n\treturn x ** 2"
    ours = Tokenizer.from_file(str(loaded.tokenizer_path)).encode(text).ids
    assert tokenizer(text)["input_ids"] == ours and loaded.eot_id in ours
    ids = torch.tensor([ours])
    with torch.no_grad():
        assert (model(ids).logits - loaded.model(ids)[..., :real]).abs().max() < 1e-4
        # The validation loss is the same number (HF shifts the labels itself).
        ours_loss = eager_cross_entropy(loaded.model(ids[:, :-1]).flatten(0, 1), ids[0, 1:])
        assert abs(float(model(ids, labels=ids).loss) - float(ours_loss)) < 1e-5
        # Greedy generation of the exported model is `lm sample`'s continuation.
        prompt = "def fibonacci(n):"
        new = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=12, do_sample=False)
    capsys_text = sample(capsys, run, prompt, 12)
    assert len(capsys_text) > len(prompt)
    assert capsys_text == prompt + tokenizer.decode(
        new[0, len(tokenizer(prompt)["input_ids"]) :], skip_special_tokens=True
    )


def sample(capsys, path: Path, prompt: str, tokens: int) -> str:
    """What `lm sample PATH PROMPT --max-new-tokens N` prints."""
    capsys.readouterr()
    lm(["sample", str(path), prompt, "--max-new-tokens", str(tokens)])
    return capsys.readouterr().out.rstrip("\n")


@pytest.mark.slow
def test_a_copied_run_directory_samples_and_exports_without_the_data_cache(
    run, data_cache, tmp_path, monkeypatch, capsys
):
    copy = tmp_path / "elsewhere" / "tiny"
    shutil.copytree(run, copy, symlinks=True)
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    config = copy / "config.yaml"  # the copy's config names a data cache this machine does not have
    config.write_text(config.read_text().replace(str(data_cache), str(empty)))
    monkeypatch.setenv("LM_CACHE", str(empty))
    text = sample(capsys, copy, "def main():", 8)
    assert text == sample(capsys, run, "def main():", 8) and text.startswith("def main():")
    lm(["export", str(copy / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "hf"), "--dtype", "bf16"])
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert not any(empty.iterdir())  # nothing was prepared again


@pytest.mark.slow
def test_init_from_an_export_starts_at_the_checkpoints_loss(run, data_cache, tmp_path):
    """The first step of a run started from an export of `run` has the loss `run`'s checkpoint gives on that
    batch (what resuming the checkpoint would log for it): the weights and the tokenizer came across whole."""
    export(run, tmp_path / "hf")
    runs = tmp_path / "runs"
    init = compose_run(runs, data_cache, "run.name=init", f"model.init_from={tmp_path / 'hf'}",
                       "trainer.max_steps=1", "trainer.log_every_n_steps=1")  # fmt: skip
    main(init)
    kept = rundir.read_tokenizer(runs / "init")
    assert kept["sha256"] == hashlib.sha256((tmp_path / "hf" / "tokenizer.json").read_bytes()).hexdigest()
    first = rundir.read_scalars(runs / "init")["train/loss"]
    assert first.steps[0] == 0

    data = LMDataModule(to_objects(init).data)  # no trainer: the loader starts at step 0, as the run did
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        logits = load_run(run).model(batch[:, :-1])
        expected = eager_cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert abs(first.values[0] - float(expected)) < 1e-5


def source_folder(folder: Path, model_cfg: ModelConfig, **fields) -> Path:
    """A Hugging Face Llama folder (config.json and a tokenizer) of `model_cfg`, with config fields changed."""
    hf_config(model_cfg, eos_id=0).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    words = Tokenizer(WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="a"))
    words.save(str(folder / "tokenizer.json"))
    return folder


def test_init_from_another_architecture_is_refused_naming_the_field(tiny_cfg, tmp_path):
    model = tiny_lm(vocab_size=512, n_layer=2, d_model=64, n_head=4, max_seq_len=64)
    to_hf_model(model, eos_id=0).save_pretrained(tmp_path / "hf")
    with pytest.raises(Refused, match="holds no tokenizer.json; set data.tokenizer"):
        to_objects(tiny_cfg(f"model.init_from={tmp_path / 'hf'}"))
    words = Tokenizer(WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="a"))
    words.save(str(tmp_path / "hf" / "tokenizer.json"))
    with pytest.raises(Refused, match=r"model.n_layer=3 but its num_hidden_layers=2") as refused:
        main(tiny_cfg(f"model.init_from={tmp_path / 'hf'}", "model.n_layer=3"))
    assert exit_code(refused.value) == EXIT_CONFIG
    assert not (tmp_path / "runs" / "smoke").exists()  # no run directory, no lock: refused at preflight


def small_bpe(folder: Path) -> Path:
    """lm's own byte-level BPE (400 ids) at `folder/tokenizer.json`, trained in a second on a sample of the
    bundled corpus."""
    texts = [d.text for d in stdlib_documents(max_bytes=300_000).documents]
    train_tokenizer(texts, 400).save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return small_bpe(tmp_path_factory.mktemp("tok"))


def opened(model: Transformer, tokenizer_json: Path, run_dir: Path) -> Loaded:
    """`model` as `load_run` opens a run (no training): what `lm export` writes from."""
    return Loaded(model, model.cfg, run_dir, run_dir / "last.ckpt", 0, tokenizer_json, EOT, EOT_ID)


@contextmanager
def transformers_warnings():
    """The records of WARNING and above that transformers logs inside the block (its logger does not
    propagate to the root, so pytest's caplog never sees them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # as a user sees it, whatever TRANSFORMERS_VERBOSITY says here
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_the_exported_tokenizer_gives_llamas_inputs_and_pads_with_end_of_text(bpe, tmp_path, monkeypatch):
    """transformers 4.x's fast tokenizer returns token_type_ids unless told its model's inputs, and its
    generate refuses them; with no pad token, batched inference and fine-tuning stop at the first padding.
    The tokenizer pads on the left as it loads: a decoder-only model continues from the last position, so
    right padding puts pad tokens between a prompt and its continuation (transformers warns that right-padding
    was detected and the short prompt's output changes)."""
    model = tiny_lm(vocab_size=400, vocab_multiple=64)
    write_folder(opened(model, bpe, tmp_path / "run"), tmp_path / "hf", torch.float32, "keep", MAX_SHARD_SIZE)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["model_input_names"] == ["input_ids", "attention_mask"] and config["pad_token"] == EOT
    assert config["padding_side"] == "left"
    assert json.loads((tmp_path / "hf" / "config.json").read_text()).get("pad_token_id") is None
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["pad_token_id"] == EOT_ID

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")  # as the README loads it: no padding_side
    assert set(tokenizer("def f():")) == {"input_ids", "attention_mask"} and tokenizer.pad_token_id == EOT_ID
    prompts = ["def f():", "import os\nimport sys\n"]
    with transformers_warnings() as warned:
        new = hf.generate(
            **tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=4, do_sample=False
        )
    assert not warned, [r.getMessage() for r in warned]  # "right-padding was detected" before padding_side
    mask = tokenizer(prompts, padding=True)["attention_mask"]
    assert mask[0][0] == 0 and mask[0][-1] == 1  # the short one was padded, on the left
    alone = hf.generate(**tokenizer(prompts[:1], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert torch.equal(new[0, -4:], alone[0, -4:])  # padding changes nothing of the continuation


def test_the_model_card_names_no_local_path_and_states_the_license(bpe, tiny_cfg, tmp_path):
    cfg = tiny_cfg("run.license=apache-2.0", f"model.init_from={tmp_path / 'base'}")
    run_dir = tmp_path / "runs" / "smoke"
    rundir.write_config(run_dir, cfg)
    written = (run_dir / "config.yaml").read_text()
    # run.root, data.cache_dir, model.init_from: where this machine keeps them
    assert str(tmp_path) in written
    model = tiny_lm(vocab_size=400, vocab_multiple=64)
    card = model_card(
        opened(model, bpe, run_dir), "float32", "keep", run_license(rundir.read_config(run_dir))
    )
    assert str(tmp_path) not in card and "/" + tmp_path.parts[1] not in card
    assert f"root: {LOCAL}" in card and f"cache_dir: {LOCAL}" in card and "name: smoke" in card
    assert card.startswith('---\nlicense: "apache-2.0"\n') and "License: apache-2.0." in card
    unlicensed = model_card(opened(model, bpe, run_dir), "float32", "keep")
    front_matter = unlicensed.split("\n---\n")[0]
    assert "license" not in front_matter and "License: not stated (set `run.license`" in unlicensed


TRANSFORMERS_4 = "transformers>=4.56,<5"
"""The transformers that vLLM and much of the ecosystem still pin."""
GENERATE = """
import json, sys, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt = sys.argv[1:]
model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
one = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=8, do_sample=False)
batch = tokenizer(["x", prompt], return_tensors="pt", padding=True)  # padded on the left as loaded
two = model.generate(**batch, max_new_tokens=8, do_sample=False)
x = model.generate(**tokenizer("x", return_tensors="pt"), max_new_tokens=8, do_sample=False)
print(json.dumps({"version": transformers.__version__, "side": tokenizer.padding_side, "one": one[0].tolist(),
                  "two": two[1].tolist(), "short": two[0].tolist(), "x": x[0].tolist()}))
"""


@pytest.fixture(scope="module")
def python_with_transformers_4(tmp_path_factory) -> Path:
    """A Python with transformers 4.x: a venv over this environment's packages (torch, safetensors: a .pth
    puts them after its own) with transformers 4.x and the tokenizers and huggingface-hub it pins installed
    in it, ahead of this environment's 5.x on sys.path. ~1 minute; skipped when pip can reach no registry."""
    venv = tmp_path_factory.mktemp("transformers4") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "zz-outer-environment.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    try:
        subprocess.run(
            [python, "-m", "pip", "install", "-q", TRANSFORMERS_4],
            capture_output=True, text=True, check=True, timeout=1200,
        )  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"pip could not install {TRANSFORMERS_4} (no package registry?): {str(e.stderr)[-500:]}")
    return python


@pytest.mark.slow
def test_transformers_4_generates_from_the_export_unmodified(run, tmp_path, python_with_transformers_4):
    """`generate(**tokenizer(text, return_tensors="pt"))` (which 4.x refused: `token_type_ids`) and padded
    batches (left, as 4.x reads the tokenizer's config) give the tokens transformers 5 gives."""
    export(run, tmp_path / "hf")
    prompt = "def fibonacci(n):"
    done = subprocess.run(
        [python_with_transformers_4, "-c", GENERATE, str(tmp_path / "hf"), prompt],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs["version"].startswith("4.") and theirs["side"] == "left"
    assert theirs["short"][-8:] == theirs["x"][-8:]  # the padded prompt continues as it does alone
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=8, do_sample=False)
    assert theirs["one"] == ours[0].tolist() and theirs["two"][-len(theirs["one"]) :] == theirs["one"]


UNEXPRESSIBLE = {
    "hidden_act": ({"hidden_act": "gelu"}, "its hidden_act='gelu' but lm's decoder has hidden_act='silu'"),
    "attention_bias": (
        {"attention_bias": True},
        "its attention_bias=True but lm's decoder has attention_bias=False",
    ),
    "mlp_bias": ({"mlp_bias": True}, "its mlp_bias=True but lm's decoder has mlp_bias=False"),
    "rope_scaling": (
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        "its rope_type='linear' but lm's decoder has rope_type='default'",
    ),
    "head_dim": ({"head_dim": 32}, "its head_dim=32 but lm's decoder has head_dim=16"),
    "sliding_window": (
        {"sliding_window": 32},
        "its sliding_window=32 but lm's decoder has sliding_window=None",
    ),
    "tie_word_embeddings": (
        {"tie_word_embeddings": True},
        "model.tie_embeddings=False but its tie_word_embeddings=True",
    ),
    "rms_norm_eps": ({"rms_norm_eps": 1e-6}, "model.norm_eps=1e-05 but its rms_norm_eps=1e-06"),
    "vocab_size": ({"vocab_size": 500}, "data.vocab_size=512 but its vocab_size=500"),
    "model_type": (
        {"model_type": "mistral"},
        "its model_type='mistral' but lm's decoder has model_type='llama'",
    ),
}


@pytest.mark.parametrize("field", UNEXPRESSIBLE)
def test_init_from_a_model_lm_cannot_express_is_refused_before_the_run_directory(field, tiny_cfg, tmp_path):
    """A Llama config field lm would build otherwise (a GELU MLP was loaded into lm's SiLU one and trained,
    exit 0) is refused (78) at preflight, naming the field and both values; nothing is left on disk."""
    changes, message = UNEXPRESSIBLE[field]
    model_cfg = to_objects(tiny_cfg()).model
    folder = source_folder(tmp_path / "hf", model_cfg, **changes)
    with pytest.raises(Refused, match=re.escape(message)) as refused:
        main(tiny_cfg(f"model.init_from={folder}"))
    assert exit_code(refused.value) == EXIT_CONFIG and "doctor refuses" in str(refused.value)
    assert not (tmp_path / "runs" / "smoke").exists()  # no run directory, no .lock


def test_init_from_without_the_export_extra_is_refused_at_preflight(tiny_cfg, tmp_path, data_cache):
    """`python train.py model.init_from=...` where transformers cannot be imported: 78 naming the pip line,
    and no run directory, lock or hydra/<time>/ (it was exit 1, which `lm supervise` retries, leaving both)."""
    folder = source_folder(tmp_path / "hf", to_objects(tiny_cfg()).model)
    root = tmp_path / "runs"
    args = [*TINY, f"run.root={root}", f"data.cache_dir={data_cache}", f"model.init_from={folder}"]
    # Hidden once Lightning is imported: torchmetrics imports transformers whenever its metadata is installed.
    hide = "import runpy, sys, lm.run.train; sys.modules['transformers'] = None; "
    code = hide + "sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', run_name='__main__')"
    result = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=CONF.parent, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert (
        "transformers is not installed; install the export extra: pip install -e '.[export]'" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not root.exists() or not any(root.iterdir())  # no run directory, .lock or hydra/<time>/


def batch_losses(batch: torch.Tensor, lm_model: Transformer, hf_model) -> tuple[float, float]:
    """(lm's loss, transformers' loss) of one (B, T+1) batch: what LMModule computes, and HF's `labels=` loss."""
    with torch.no_grad():
        ours = eager_cross_entropy(lm_model.eval()(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        theirs = hf_model(batch, labels=batch).loss
    return float(ours), float(theirs)


def first_batch_and_loss(runs: Path, name: str, cfg) -> tuple[torch.Tensor, float]:
    """A finished run's first batch (the loader at step 0) and the train/loss it logged for it."""
    first = rundir.read_scalars(runs / name)["train/loss"]
    assert first.steps[0] == 0
    return next(iter(LMDataModule(to_objects(cfg).data).train_dataloader())), first.values[0]


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [4000, 4096])
def test_one_vocabulary_rule_for_loss_export_and_init_from(vocab, data_cache, tmp_path):
    """lm's loss, transformers' loss on the export and the first loss of `model.init_from` agree, for a
    vocabulary that is (4,096) and is not (4,000) a multiple of lm's padding (64): lm's padding ids had taken
    probability (+0.0073 nats from a 4,000-id Llama, +0.0081 from lm's own truncated export)."""
    runs = tmp_path / "runs"
    vocab_args = [
        f"data.vocab_size={vocab}",
        "model.vocab_multiple=64",
        "trainer.max_steps=1",
        "trainer.log_every_n_steps=1",
    ]
    # A Llama of exactly `vocab` ids as transformers initialises one, with an lm tokenizer of that size.
    cfg = to_objects(compose_run(runs, data_cache, *vocab_args))
    data = LMDataModule(cfg.data)
    data.prepare_data()
    assert data.vocab_size == vocab
    torch.manual_seed(0)
    config = hf_config(cfg.model, eos_id=data.eot_id, vocab_size=vocab)
    source = AutoModelForCausalLM.from_config(config).eval()
    source.save_pretrained(tmp_path / "source")
    shutil.copy(data.data_dir / "tokenizer.json", tmp_path / "source" / "tokenizer.json")

    a = compose_run(runs, data_cache, *vocab_args, "run.name=a", f"model.init_from={tmp_path / 'source'}")
    main(a)
    batch, first = first_batch_and_loss(runs, "a", a)
    lm_source = Transformer(to_objects(a).model)
    load_init_from(lm_source)
    ours, theirs = batch_losses(batch, lm_source, source)
    assert abs(first - theirs) < 2e-6 and abs(ours - theirs) < 2e-6

    export(runs / "a", tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert exported.config.vocab_size == vocab
    trained = load_run(runs / "a").model
    ours, theirs = batch_losses(batch, trained, exported)
    assert abs(ours - theirs) < 2e-6

    b = compose_run(runs, data_cache, *vocab_args, "run.name=b", f"model.init_from={tmp_path / 'export'}")
    main(b)
    batch, first = first_batch_and_loss(runs, "b", b)
    ours, theirs = batch_losses(batch, trained, exported)
    assert abs(first - ours) < 2e-6 and abs(first - theirs) < 2e-6
