"""How CORE's items become scored tokens, one convention at a time: `nanochat` (the default: its base_eval,
the leaderboard's, so GPT-2 = 0.2565 is on it) and `dclm` (llm-foundry's in-context-learning datasets, which
DCLM's own numbers come from). Every CORE record names its convention; figures of two conventions differ by
single items per task and are not compared (docs/export-eval.md#core has the table of differences).

nanochat (`scripts/base_eval.py`, `nanochat/core_eval.py`): each task's items shuffled with
`random.Random(1337)` and, with a limit, cut to the first N (the few-shot pool is what is left); item i's
examples drawn by `random.Random(1234 + i)` from the other items; fields rendered unstripped (language
modelling contexts trimmed), examples joined by a blank line; every prompt encoded whole and the scored
tokens found from the token sequences themselves: the choices' common prefix (multiple choice), the options'
common suffix (schema), the prompt without its continuation (language modelling); a prompt past the context
keeps its last `context` tokens.

dclm (llm-foundry's in-context-learning datasets, `llmfoundry/eval/datasets/`): every string field stripped;
jeopardy scored per category (its five, each drawn within itself) and the categories' accuracies averaged; one
`random.Random(1234)` per task (per category) drawing every item's examples in file order, as a set (an item
drawn for itself is replaced); examples joined by one newline, the item's context right-stripped; the few-shot
text, the item's context and its continuation each encoded alone, the continuation with a leading space where
the tokenizer wants one; the whole continuation scored; a prompt past the context keeps its last `context`
tokens.

Under both, lm starts every prompt with the model's start token (lm's end of text; a transformers folder's bos,
else eos), as nanochat starts with its BOS: a model trained by lm never saw text without one before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from lm.config.root import CONVENTIONS, DCLM, NANOCHAT
from lm.evals.core import (
    FEWSHOT_SEED,
    LANGUAGE_MODELING,
    MULTIPLE_CHOICE,
    SCHEMA,
    Question,
    TaskData,
    fewshot_indices,
    render,
    subset,
)

SHUFFLE_SEED = 1337
"""nanochat's `random.Random(1337).shuffle` of each task before its items are cut and drawn from."""
CATEGORY_SEP = "/"
"""A part of a task scored on its own (DCLM's jeopardy categories): `jeopardy/world_history`."""


@dataclass
class Part:
    """A task as a convention scores it: its items in the convention's order (the few-shot pool) and the
    ones scored."""

    data: TaskData
    chosen: list[int]
    """Indices into `data.items` scored (all of them, or a limit's share)."""

    @property
    def task(self) -> str:
        """The CORE task this part counts towards."""
        return self.data.label.split(CATEGORY_SEP)[0]


def prepare(data: TaskData, convention: str, limit: int | None) -> list[Part]:
    """A CORE task's parts under `convention`: nanochat's shuffled (and cut to `limit`) pool, or DCLM's
    stripped items (jeopardy one part per category) with lm's seeded sample of `limit` (`core.subset`:
    llm-foundry has no limit, it scores everything)."""
    if convention == NANOCHAT:
        items = list(data.items)
        random.Random(SHUFFLE_SEED).shuffle(items)
        items = items[:limit] if limit is not None else items
        return [Part(replace(data, items=items), list(range(len(items))))]
    if convention != DCLM:
        raise ValueError(f"unknown CORE convention {convention!r}: one of {', '.join(CONVENTIONS)}")
    items = [{k: v.strip() if isinstance(v, str) else v for k, v in item.items()} for item in data.items]
    chosen = subset(len(items), limit, data.label)
    if data.label != "jeopardy":
        return [Part(replace(data, items=items), chosen)]
    # DCLM's `has_categories: true`: a dataset per category, sorted by name, each drawing within itself; a
    # limit samples the task as a whole first, so it stays a count of items per task
    picked, parts = set(chosen), []
    for name in sorted({item["category"] for item in items}):
        where = [i for i, item in enumerate(items) if item["category"] == name]
        rows = [items[i] for i in where]
        mine = [k for k, i in enumerate(where) if i in picked]
        parts.append(Part(replace(data, label=f"jeopardy{CATEGORY_SEP}{name}", items=rows), mine))
    return parts


# --- few-shot draws ---------------------------------------------------------------------------------------


def dclm_draws(n: int, shots: int) -> list[list[int]]:
    """Every item's few-shot indices as llm-foundry draws them: one `Random(1234)` for the task, items in
    order; `shots` indices sampled from all n, as a set, and one drawn for its own item replaced by a fresh
    `choice` until it is new. The list order is the set's iteration order, which is the prompt's order."""
    if shots == 0:
        return [[] for _ in range(n)]
    rng, k = random.Random(FEWSHOT_SEED), min(n - 1, shots)
    out = []
    for index in range(n):
        drawn = set(rng.sample(range(n), k))
        if index in drawn:
            drawn.remove(index)
            if len(drawn) < n - 1:
                extra = rng.choice(range(n))
                while extra in drawn or extra == index:
                    extra = rng.choice(range(n))
                drawn.add(extra)
        out.append(list(drawn))
    return out


# --- prompts ----------------------------------------------------------------------------------------------


def render_dclm(data: TaskData, index: int, shots: list[int]) -> Question:
    """Item `index` as llm-foundry builds it: examples joined by one newline, the item after a newline
    (none when zero-shot), its context right-stripped; `cut` marks where the few-shot text ends, since
    llm-foundry encodes it apart from the item."""
    items, delim = data.items, data.delimiter
    item, examples = items[index], [items[j] for j in shots]
    lead = "\n" if examples else ""
    if data.kind == MULTIPLE_CHOICE:
        before = "\n".join(f"{e['query']}{delim}{e['choices'][e['gold']]}" for e in examples)
        context = before + f"{lead}{item['query']}{delim}".rstrip()
        pairs = [(context, choice) for choice in item["choices"]]
    elif data.kind == SCHEMA:
        before = "\n".join(f"{e['context_options'][e['gold']]}{delim}{e['continuation']}" for e in examples)
        # llm-foundry's options: after examples, newline + option + the delimiter right-stripped; alone, the
        # bare option (the continuation's leading space is the only separator then)
        options = [f"\n{o}{delim.rstrip()}" if examples else o for o in item["context_options"]]
        pairs = [(before + option, item["continuation"]) for option in options]
    elif data.kind == LANGUAGE_MODELING:
        before = "\n".join(f"{e['context']}{delim}{e['continuation']}" for e in examples)
        pairs = [(before + f"{lead}{item['context']}{delim}".rstrip(), item["continuation"])]
    else:
        raise ValueError(f"unknown CORE task type {data.kind!r}")
    gold = item.get("gold", 0)
    return Question(data.label, index, data.kind, pairs, gold, cut=len(before))


def questions(part: Part, convention: str) -> list[Question]:
    """The part's chosen items rendered under `convention` (nanochat's templates are lm.evals.core.render)."""
    data = part.data
    if convention == NANOCHAT:
        return [render(data, i, fewshot_indices(len(data.items), i, data.shots)) for i in part.chosen]
    draws = dclm_draws(len(data.items), data.shots)
    return [render_dclm(data, i, draws[i]) for i in part.chosen]


# --- tokens -----------------------------------------------------------------------------------------------


def common_length(seqs: list[list[int]], *, suffix: bool = False) -> int:
    """How many leading (or trailing) tokens every sequence shares."""
    shortest = min(map(len, seqs))
    for k in range(shortest):
        at = -1 - k if suffix else k
        if any(s[at] != seqs[0][at] for s in seqs[1:]):
            return k
    return shortest


def needs_space(tokenizer) -> bool:
    """llm-foundry's `tokenizer_needs_prefix_space`: ' a' is one token (byte-level BPE), so a continuation
    encoded alone gets the leading space it would have had after its context."""
    return len(tokenizer.encode(" a", add_special_tokens=False).ids) == 1


def tokens(
    qs: list[Question], convention: str, tokenizer, prefix_id: int
) -> list[list[tuple[list[int], int]]]:
    """Each question's requests as (token sequence, index of its first scored token), after `prefix_id`.
    A request whose scored tokens are empty (a choice that is a token prefix of another, under nanochat)
    scores nothing: its mean loss is NaN, and nanochat's `min` keeps the earlier choice over it."""
    space = needs_space(tokenizer)
    texts = [t for q in qs for t in texts_of(q, convention, space)]
    unique = list(dict.fromkeys(texts))
    encoded = tokenizer.encode_batch(unique, add_special_tokens=False)
    ids = {t: e.ids for t, e in zip(unique, encoded)}
    out = []
    for q in qs:
        if convention == NANOCHAT:
            out.append(nanochat_tokens(q, ids, prefix_id))
        else:
            out.append(dclm_tokens(q, ids, prefix_id, space))
    return out


def texts_of(q: Question, convention: str, space: bool) -> list[str]:
    """The strings a question's tokens are encoded from (encoded once each, in one batch)."""
    if convention == NANOCHAT:
        whole = [c + k for c, k in q.pairs]
        return whole + ([q.pairs[0][0].strip()] if q.kind == LANGUAGE_MODELING else [])
    return [t for c, k in q.pairs for t in (c[: q.cut], c[q.cut :], _spaced(k, space))]


def nanochat_tokens(q: Question, ids: dict, prefix_id: int) -> list[tuple[list[int], int]]:
    """nanochat's `batch_sequences_*`: each prompt encoded whole; the scored span from the sequences."""
    seqs = [[prefix_id, *ids[c + k]] for c, k in q.pairs]
    if q.kind == MULTIPLE_CHOICE:
        start = common_length(seqs)
        return [(s, start) for s in seqs]
    if q.kind == SCHEMA:
        n = common_length(seqs, suffix=True)
        return [(s, len(s) - n) for s in seqs]
    # language modelling: the prompt without its continuation, stripped (nanochat asserts it is a prefix)
    start = 1 + len(ids[q.pairs[0][0].strip()])
    return [(seqs[0], min(start, len(seqs[0]) - 1))]


def dclm_tokens(q: Question, ids: dict, prefix_id: int, space: bool) -> list[tuple[list[int], int]]:
    """llm-foundry's `tokenize_example`: few-shot text, the item's context and the continuation encoded
    apart and concatenated; the whole continuation scored."""
    out = []
    for context, continuation in q.pairs:
        ctx = [prefix_id, *ids[context[: q.cut]], *ids[context[q.cut :]]]
        out.append((ctx + ids[_spaced(continuation, space)], len(ctx)))
    return out


def _spaced(continuation: str, space: bool) -> str:
    return f" {continuation}" if space and not continuation.startswith(" ") else continuation
