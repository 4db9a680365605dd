"""CORE's two conventions (lm.evals.conventions): nanochat's shuffle, draw and common-prefix/suffix scoring,
DCLM's (llm-foundry's) stripping, set-drawn examples, jeopardy by category and separate encodings. The
expected values are computed here by re-implementing each project's documented algorithm independently (nanochat
`scripts/base_eval.py` + `nanochat/core_eval.py`; llm-foundry `eval/datasets/utils.py`), on the real task
files in ../shared/evals/core (never copied into the repository).
"""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from lm import cli
from lm.base.exits import EXIT_CONFIG, Refused
from lm.config import EvalsConfig
from lm.data.tokenizer import train_tokenizer
from lm.evals import conventions, core, own
from lm.evals.conventions import DCLM, NANOCHAT
from lm.evals.core import LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, TaskData
from lm.evals.scorer import Scorer
from lm.model import ModelConfig, Transformer

from .test_core import CORE_DIR, bigram_model, needs_core, run  # noqa: F401  (run: the module's trained run)


def nanochat_reference(items: list[dict], limit: int | None, index: int, shots: int) -> list[dict]:
    """nanochat base_eval's few-shot examples of item `index`, written out as it is: shuffle the task with
    Random(1337), cut to the limit, then Random(1234 + index).sample of the other indices."""
    data = list(items)
    random.Random(1337).shuffle(data)
    if limit:
        data = data[:limit]
    available = [i for i in range(len(data)) if i != index]
    return [data[i] for i in random.Random(1234 + index).sample(available, shots)], data[index]


@needs_core
@pytest.mark.parametrize(("label", "limit"), [("arc_easy", None), ("arc_easy", 100), ("jeopardy", 40)])
def test_the_nanochat_draw_is_nanochats_own(label, limit):
    """The same shuffled order and the same few-shot examples, in order, for the first items."""
    data = core.load_task(CORE_DIR, label)
    (part,) = conventions.prepare(data, NANOCHAT, limit)
    assert len(part.chosen) == (limit or len(data.items))
    questions = conventions.questions(conventions.Part(part.data, part.chosen[:5]), NANOCHAT)
    for q in questions:
        examples, item = nanochat_reference(data.items, limit, q.index, data.shots)
        assert part.data.items[q.index] == item
        context = q.pairs[0][0]
        key = "query" if data.kind == MULTIPLE_CHOICE else "context"
        at = [context.index(ex[key].strip()) for ex in examples]  # every example, in nanochat's order
        assert at == sorted(at) and context.rstrip().endswith(item[key].strip() + data.delimiter.rstrip())


def foundry_draw(n: int, shots: int, index: int, rng: random.Random) -> list[int]:
    """llm-foundry's `get_fewshot_sample_idxs`, written out: a set of `shots` sampled from all n; the item
    itself replaced by fresh `choice`s; iterated as a set."""
    shots = min(n - 1, shots)
    picked = set(rng.sample(range(0, n), shots))
    if index in picked:
        picked.remove(index)
        if len(picked) >= n - 1:
            return list(picked)
        extra = rng.choice(range(0, n))
        while extra in picked or extra == index:
            extra = rng.choice(range(0, n))
        picked.add(extra)
    return list(picked)


@pytest.mark.parametrize(("n", "shots"), [(12, 10), (11, 10), (3, 10), (500, 10), (230, 3)])
def test_the_dclm_draw_is_llm_foundrys(n, shots):
    rng = random.Random(1234)  # one per dataset, consumed item by item in order
    expected = [foundry_draw(n, shots, i, rng) for i in range(n)]
    drawn = conventions.dclm_draws(n, shots)
    assert drawn == expected
    assert all(i not in d and len(d) == min(shots, n - 1) for i, d in enumerate(drawn))


def test_dclm_strips_every_string_field_and_renders_as_llm_foundry():
    items = [{"query": f" q{i} ", "choices": [" a", "b "], "gold": i % 2, "category": "c"} for i in range(3)]
    data = TaskData("arc_easy", MULTIPLE_CHOICE, 2, "\nAnswer: ", items, 25.0)
    (part,) = conventions.prepare(data, DCLM, None)
    assert part.data.items[0]["query"] == "q0" and part.data.items[0]["choices"] == [" a", "b "]  # lists kept
    draws = conventions.dclm_draws(3, 2)
    q = conventions.render_dclm(part.data, 0, draws[0])
    shots = [part.data.items[j] for j in draws[0]]
    before = "\n".join(f"{s['query']}\nAnswer: {s['choices'][s['gold']]}" for s in shots)
    assert q.pairs == [(before + "\nq0\nAnswer:", " a"), (before + "\nq0\nAnswer:", "b ")]
    assert q.cut == len(before)
    schema = TaskData("winograd", SCHEMA, 0, " ", [{"context_options": ["x", "q"], "continuation": " y ", "gold": 1}], 50.0)  # fmt: skip
    (part,) = conventions.prepare(schema, DCLM, None)
    q = conventions.render_dclm(part.data, 0, [])
    assert q.pairs == [("x", "y"), ("q", "y")]  # zero-shot: the bare option, the continuation stripped


@needs_core
def test_dclm_scores_jeopardy_by_category_drawing_within_each():
    data = core.load_task(CORE_DIR, "jeopardy")
    parts = conventions.prepare(data, DCLM, 100)
    names = sorted({item["category"] for item in data.items})
    assert [p.data.label for p in parts] == [f"jeopardy/{c}" for c in names] and len(names) == 5
    assert sum(len(p.chosen) for p in parts) == 100  # the limit counts items of the task, not per category
    for p in parts:
        assert {item["category"] for item in p.data.items} == {p.data.label.split("/")[1]}
    merged = own.merge_categories(
        {"jeopardy/a": own.Counts(n=10, right=5), "jeopardy/b": own.Counts(n=30, right=3)}
    )
    assert merged["jeopardy"].n == 40 and merged["jeopardy"].right / 40 == pytest.approx((0.5 + 0.1) / 2)


def test_common_prefix_scoring_equals_whole_continuation_scoring_without_a_shared_prefix():
    """Choices that share no first token: nanochat's common prefix is the context, so it scores exactly
    the tokens lm-evaluation-harness's split scores (and DCLM's, encoding the continuation alone)."""
    model, tokenizer = bigram_model()
    questions = [
        core.Question("copa", 0, MULTIPLE_CHOICE, [("q x ", "a b"), ("q x ", "d c"), ("q x ", "y")], 0),
        core.Question("winograd", 0, SCHEMA, [("x", " a b"), ("q", " a b")], 1),
    ]
    scorer = Scorer(model, tokenizer, 0)
    whole = scorer.score([q.pairs for q in questions])
    for convention in (NANOCHAT, DCLM):
        requests = conventions.tokens(questions, convention, tokenizer, 0)
        for mine, theirs in zip(scorer.score_tokens(requests), whole):
            assert [s.tokens for s in mine] == [s.tokens for s in theirs]
            assert [s.logprob for s in mine] == pytest.approx([s.logprob for s in theirs], abs=1e-5)


def test_common_prefix_leaves_shared_leading_tokens_of_the_choices_unscored():
    model, tokenizer = bigram_model()
    q = core.Question("copa", 0, MULTIPLE_CHOICE, [("q", " a b"), ("q", " a c"), ("q", " a")], 0)
    (requests,) = conventions.tokens([q], NANOCHAT, tokenizer, 0)
    assert [start for _, start in requests] == [3, 3, 3]  # after [eot, q, a]: "a" is shared
    scored = Scorer(model, tokenizer, 0).score_tokens([requests])[0]
    assert [s.tokens for s in scored] == [1, 1, 0]
    assert scored[2].mean_loss != scored[2].mean_loss  # NaN: nothing scored, as nanochat's mean of nothing
    (dclm,) = conventions.tokens([q], DCLM, tokenizer, 0)
    assert [len(seq) - start for seq, start in dclm] == [2, 2, 1]  # DCLM scores each whole continuation


def test_packed_convention_requests_equal_one_forward_each():
    """nanochat's spans (a choice's scored tokens may start inside the shared text) through the packer."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=16, n_layer=2, d_model=32, n_head=4, max_seq_len=24)).eval()
    rng = random.Random(0)
    questions = []
    for _ in range(20):
        ctx = [0, *rng.choices(range(1, 16), k=rng.randint(1, 30))]
        questions.append(
            [
                (ctx + rng.choices(range(1, 16), k=rng.randint(1, 4)), len(ctx) - rng.randint(0, 1))
                for _ in range(3)
            ]
        )
    scored = Scorer(model, None, 0, rows=3).score_tokens(questions)
    for requests, results in zip(questions, scored):
        for (seq, start), result in zip(requests, results):
            cut = max(0, len(seq) - 24)
            seq, start = seq[cut:], max(1, start - cut)
            logprobs = F.log_softmax(model(torch.tensor([seq[:-1]])).float(), dim=-1)[0, start - 1 :]
            want = logprobs.gather(1, torch.tensor(seq[start:])[:, None]).sum().item()
            assert result.logprob == pytest.approx(want, abs=1e-4) and result.tokens == len(seq) - start


@pytest.mark.parametrize("convention", [NANOCHAT, DCLM])
@pytest.mark.parametrize(
    ("label", "kind", "items", "right"),
    [
        ("copa", MULTIPLE_CHOICE, [{"query": "q", "choices": ["a", "d"], "gold": 0}], 1),
        ("copa", MULTIPLE_CHOICE, [{"query": "q", "choices": ["d", "a b c"], "gold": 1}], 1),
        ("winograd", SCHEMA, [{"context_options": ["x", "q"], "continuation": "a b", "gold": 1}], 1),
        ("winograd", SCHEMA, [{"context_options": ["x", "q"], "continuation": "y", "gold": 1}], 0),
        (
            "lambada_openai",
            LANGUAGE_MODELING,
            [{"context": "q", "continuation": "a b c"}, {"context": "q ", "continuation": "a c"}],
            1,
        ),
    ],
)
def test_each_task_type_gets_the_known_answer_under_each_convention(convention, label, kind, items, right):
    model, tokenizer = bigram_model()
    data = TaskData(label, kind, 0, " ", items, 25.0)
    counts, _ = own.score_tasks(Scorer(model, tokenizer, 0), [data], convention=convention)
    assert (counts[label].n, counts[label].right) == (len(items), right)


def test_an_unknown_convention_is_refused_naming_both():
    with pytest.raises(Refused, match="nanochat, dclm"):
        EvalsConfig(tasks=["core"], convention="lm")
    assert EvalsConfig().convention == NANOCHAT


@needs_core
def test_lm_eval_convention_flag_names_the_figure(run, capsys):  # noqa: F811
    args = [
        "eval",
        str(run),
        "--tasks",
        "core:copa,core:jeopardy",
        "--data-dir",
        str(CORE_DIR),
        "--limit",
        "10",
    ]
    cli.main([*args, "--convention", "dclm"])
    assert "CORE-2 v1 dclm" in capsys.readouterr().out
    record = json.loads((run / "eval.json").read_text())["core"]
    assert record["convention"] == "dclm" and record["items"]["jeopardy"] == 10
    cli.main(args)
    assert json.loads((run / "eval.json").read_text())["core"]["convention"] == "nanochat"
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--convention", "lm"])
    assert e.value.code == EXIT_CONFIG and "--convention" in capsys.readouterr().err


@pytest.mark.parametrize("convention", [NANOCHAT, DCLM])
def test_two_ranks_sum_to_one_process_jeopardy_categories_included(convention):
    """Each rank scores every other item of each part (DCLM: of each jeopardy category); the counts summed
    across ranks, then the categories merged, equal one process scoring everything."""
    model, tokenizer = bigram_model()
    rows = [("q", "a b", "x"), ("q", "a c", "x"), ("a", "b", "y"), ("x", "y", "y"), ("x", "b", "z")] * 3
    items = [{"context": c, "continuation": k, "category": cat} for c, k, cat in rows]
    data = TaskData("jeopardy", LANGUAGE_MODELING, 2, " ", items, 0.0)
    scorer = Scorer(model, tokenizer, 0)
    alone, _ = own.score_tasks(scorer, [data], convention=convention)
    seen = {}

    def keep(local):
        seen["rank1"] = local
        return local

    own.score_tasks(scorer, [data], convention=convention, rank=1, world=2, reduce=keep)
    both, _ = own.score_tasks(
        scorer, [data], convention=convention, rank=0, world=2, reduce=lambda t: t + seen["rank1"]
    )
    assert both["jeopardy"].n == alone["jeopardy"].n == 15
    assert both["jeopardy"].right == pytest.approx(alone["jeopardy"].right)
    if convention == DCLM:  # the mean of the three categories' accuracies, not of the items
        # a bigram model: q->a b right, q->a c wrong (x); a->b, x->y right (y); x->b wrong (z)
        per = {"x": 3 / 6, "y": 6 / 6, "z": 0 / 3}
        assert alone["jeopardy"].right / 15 == pytest.approx(sum(per.values()) / 3)  # 0.5; by items 9/15


def nanochat_scores(model: Transformer, tokenizer, item: dict, shots: list[dict], kind: str, delim: str):
    """nanochat's `evaluate_example`, written out: its templates, each prompt encoded whole after the start
    token, the span from the common prefix (suffix; the stripped prompt without its continuation), a prompt
    past the window cropped to its last `max_seq_len` tokens, one unpadded forward each; (mean losses, or
    the greedy flag for language modelling)."""
    if kind == MULTIPLE_CHOICE:
        before = "".join(f"{e['query']}{delim}{e['choices'][e['gold']]}\n\n" for e in shots)
        prompts = [f"{before}{item['query']}{delim}{c}" for c in item["choices"]]
    elif kind == SCHEMA:
        before = "".join(f"{e['context_options'][e['gold']]}{delim}{e['continuation']}\n\n" for e in shots)
        prompts = [f"{before}{o}{delim}{item['continuation']}" for o in item["context_options"]]
    else:
        before = "".join(f"{e['context'].strip()}{delim}{e['continuation']}\n\n" for e in shots)
        without = f"{before}{item['context'].strip()}{delim}"
        prompts = [without.strip(), without + item["continuation"]]
    seqs = [[0, *tokenizer.encode(p, add_special_tokens=False).ids] for p in prompts]
    if kind == LANGUAGE_MODELING:
        spans = [(len(seqs[0]), len(seqs[1]))]
        seqs = seqs[1:]
    else:
        common = 0
        pairs = seqs if kind == MULTIPLE_CHOICE else [s[::-1] for s in seqs]
        while all(len(s) > common for s in pairs) and len({s[common] for s in pairs}) == 1:
            common += 1
        spans = [(common, len(s)) if kind == MULTIPLE_CHOICE else (len(s) - common, len(s)) for s in seqs]
    out, window = [], model.cfg.max_seq_len
    for seq, (start, end) in zip(seqs, spans):
        crop = max(0, len(seq) - window)
        seq, start, end = seq[crop:], start - crop, end - crop
        logits = model(torch.tensor([seq])).float()[0]
        losses = F.cross_entropy(logits[:-1], torch.tensor(seq[1:]), reduction="none")
        if kind == LANGUAGE_MODELING:
            return [bool((logits[start - 1 : end - 1].argmax(-1) == torch.tensor(seq[start:end])).all())]
        out.append(losses[start - 1 : end - 1].mean().item())
    return out


@needs_core
@pytest.mark.parametrize("label", ["copa", "arc_easy", "winograd", "lambada_openai"])
def test_nanochat_scoring_is_nanochats_item_by_item(label):
    """lm's packed scorer on nanochat's requests against nanochat's per-item forward written out: the same
    mean losses (1e-4) and greedy flags on the first 12 items of its shuffled task, contexts past the window
    included (10-shot arc_easy in a 128-token model)."""
    data = core.load_task(CORE_DIR, label)
    (part,) = conventions.prepare(data, NANOCHAT, 12)
    texts = [json.dumps(item) for item in part.data.items] * 4
    tokenizer = train_tokenizer(texts, 400)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, n_layer=2, d_model=32, n_head=4, max_seq_len=128)).eval()
    questions = conventions.questions(part, NANOCHAT)
    scored = Scorer(model, tokenizer, 0, rows=4).score_tokens(
        conventions.tokens(questions, NANOCHAT, tokenizer, 0)
    )
    items = part.data.items
    assert label != "arc_easy" or any(s.truncated for q in scored for s in q)  # the window's edge exercised
    for q, mine in zip(questions, scored):
        shots = [items[j] for j in core.fewshot_indices(len(items), q.index, data.shots)]
        theirs = nanochat_scores(model, tokenizer, items[q.index], shots, data.kind, data.delimiter)
        if data.kind == LANGUAGE_MODELING:
            assert [s.greedy for s in mine] == theirs
        else:
            assert [s.mean_loss for s in mine] == pytest.approx(theirs, abs=1e-4)


def foundry_example(e: dict, kind: str, delim: str) -> str:
    """One few-shot example as llm-foundry's `construct_context(..., add_answer=True)` builds it."""
    if kind == MULTIPLE_CHOICE:
        return f"{e['query']}{delim}{e['choices'][e['gold']]}"
    if kind == SCHEMA:
        return f"{e['context_options'][e['gold']]}{delim}{e['continuation']}"
    return f"{e['context']}{delim}{e['continuation']}"


def foundry_scores(
    model: Transformer, tokenizer, items: list[dict], index: int, shots, kind: str, delim: str
):
    """llm-foundry's dataset and metric for one item, written out: stripped string fields, examples joined by
    one newline, the preamble, the item's context and the continuation (with its prefix space) encoded apart,
    the context trimmed on the left to fit `max_seq_len`, the whole continuation scored (after lm's start
    token, lm's one departure)."""
    items = [{k: v.strip() if isinstance(v, str) else v for k, v in x.items()} for x in items]
    item, text = items[index], ""
    for j in shots:
        text += ("\n" if text else "") + foundry_example(items[j], kind, delim)
    lead = "\n" if text else ""
    if kind == SCHEMA:
        contexts = [f"{lead}{o}{delim.rstrip()}" if text else o for o in item["context_options"]]
        continuations = [item["continuation"]] * len(contexts)
    elif kind == MULTIPLE_CHOICE:
        contexts = [f"{lead}{item['query']}{delim}".rstrip()] * len(item["choices"])
        continuations = item["choices"]
    else:
        contexts, continuations = [f"{lead}{item['context']}{delim}".rstrip()], [item["continuation"]]
    out, window = [], model.cfg.max_seq_len
    for ctx, cont in zip(contexts, continuations):
        ids = [0, *tokenizer.encode(text, add_special_tokens=False).ids]
        ids += tokenizer.encode(ctx, add_special_tokens=False).ids
        cont_ids = tokenizer.encode(
            cont if cont.startswith(" ") else " " + cont, add_special_tokens=False
        ).ids
        if len(ids) + len(cont_ids) > window:
            ids = ids[-(window - len(cont_ids)) :]
        seq = ids + cont_ids
        logits = model(torch.tensor([seq])).float()[0]
        at = slice(len(ids) - 1, len(seq) - 1)
        if kind == LANGUAGE_MODELING:
            return [bool((logits[at].argmax(-1) == torch.tensor(cont_ids)).all())]
        out.append(F.cross_entropy(logits[at], torch.tensor(cont_ids)).item())
    return out


@needs_core
@pytest.mark.parametrize("label", ["copa", "arc_easy", "winograd", "lambada_openai"])
def test_dclm_scoring_is_llm_foundrys_item_by_item(label):
    """lm's packed scorer on DCLM's requests against llm-foundry's dataset and metric written out: the same
    mean losses (1e-4) and greedy flags on 12 items, contexts trimmed to the window included."""
    data = core.load_task(CORE_DIR, label)
    (part,) = conventions.prepare(data, DCLM, 12)
    tokenizer = train_tokenizer([json.dumps(item) for item in data.items[:300]] * 2, 400)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, n_layer=2, d_model=32, n_head=4, max_seq_len=128)).eval()
    questions = conventions.questions(part, DCLM)
    requests = conventions.tokens(questions, DCLM, tokenizer, 0)
    scored = Scorer(model, tokenizer, 0, rows=4).score_tokens(requests)
    assert label != "arc_easy" or any(s.truncated for q in scored for s in q)  # the window's edge exercised
    rng, draws = random.Random(1234), []
    for i in range(len(data.items)):
        draws.append(foundry_draw(len(data.items), data.shots, i, rng) if data.shots else [])
    for q, mine in zip(questions, scored):
        theirs = foundry_scores(
            model, tokenizer, data.items, q.index, draws[q.index], data.kind, data.delimiter
        )
        if data.kind == LANGUAGE_MODELING:
            assert [s.greedy for s in mine] == theirs
        else:
            assert [s.mean_loss for s in mine] == pytest.approx(theirs, abs=1e-4)
