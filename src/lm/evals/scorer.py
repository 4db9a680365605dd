"""Log-likelihoods of continuations, many per forward pass: what CORE and the @olmo sets are scored with
(lm.evals.core, lm.evals.olmo), on lm's own model or any transformers causal LM (`Backbone`, `HFBackbone`),
so a run and the public models it is compared with are on one yardstick.

A request is a token sequence and the index of its first scored token (`score_tokens`): CORE's conventions
tokenize their own way (lm.evals.conventions). `score` takes (context, continuation) pairs and splits them as
lm-evaluation-harness does (`encode_pair`), so the two score the same tokens: trailing whitespace of the
context moves to the continuation, the pair is tokenized whole and the context's own tokens are cut off the
front. Every prompt starts with the model's start token (lm's end of text, as every training document does).

Speed comes from packing. The requests of one question that share a prefix (a multiple-choice context and
its choices, a schema task's few-shot examples) become one unit: the prefix once, then each continuation as
a branch that sees the prefix and itself, never its sibling, each at the positions it would have alone.
Units are packed into rows as long as the longest unit of their batch (attention costs the square of a
row's length), rows into batches of a token budget, and attention runs with a boolean mask (same unit,
prefix or own branch, causal). The output head runs only at the positions whose
next token is scored: logits for a few hundred positions, not (B, T, V).
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.base.exits import Refused
from lm.model import Transformer

BUDGET_ROW = 2048
"""A batch holds at most `rows` x min(context length, this) tokens: a model with a 32K context must not ask
for 32K-token rows of memory when CORE's prompts are a few hundred tokens."""


class Backbone:
    """What the scorer needs of a model, lm's `Transformer` here: its context length, whether it was trained
    with documents masked apart, its final hidden states under packed positions and mask, and its output head."""

    def __init__(self, model: Transformer) -> None:
        self.module: nn.Module = model
        self.context = model.cfg.max_seq_len
        self.doc_mask = model.cfg.doc_mask

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def hidden(self, idx_BT, pos_BT=None, mask_B1TT=None) -> torch.Tensor:
        return self.module.hidden(idx_BT, pos_BT=pos_BT, mask_B1TT=mask_B1TT)

    def head(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.module.head(x_ND)


class HFBackbone(Backbone):
    """A transformers causal LM (Llama, Qwen, GPT-2...): its base model takes position ids and a custom 4D
    mask (transformers returns a 4D mask as given), its output embeddings are the head. A model whose logits
    are more than the head of the last hidden state (a final softcap) is refused rather than mis-scored."""

    def __init__(self, model) -> None:  # a transformers PreTrainedModel
        config = model.config
        if getattr(config, "final_logit_softcapping", None):
            raise Refused(
                f"{config.model_type}'s logits are softcapped after the head: lm's scorer cannot score it"
            )
        self.module, self.doc_mask = model, False
        self.context = getattr(config, "max_position_embeddings", None) or config.n_positions

    def hidden(self, idx_BT, pos_BT=None, mask_B1TT=None) -> torch.Tensor:
        mask = None
        if mask_B1TT is not None:  # additive, so eager attention (which adds it) and SDPA read it alike
            dtype = next(self.module.parameters()).dtype
            mask = torch.zeros(mask_B1TT.shape, dtype=dtype, device=mask_B1TT.device)
            mask.masked_fill_(~mask_B1TT, torch.finfo(dtype).min)
        out = self.module.base_model(
            input_ids=idx_BT, position_ids=pos_BT, attention_mask=mask, use_cache=False
        )
        return out.last_hidden_state

    def head(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.module.get_output_embeddings()(x_ND)


@dataclass
class Scored:
    """One request's result."""

    logprob: float
    """Sum of the continuation tokens' log-probabilities (natural log)."""
    tokens: int
    """Continuation tokens scored."""
    greedy: bool
    """Whether greedy decoding reproduces every continuation token."""
    truncated: bool = False
    """The sequence was longer than the model's context: its context lost tokens on the left."""

    @property
    def mean_loss(self) -> float:
        """NaN when nothing was scored (a choice that is a token prefix of another, under nanochat)."""
        return -self.logprob / self.tokens if self.tokens else float("nan")


def split_space(context: str, continuation: str) -> tuple[str, str]:
    """Trailing whitespace of the context moved to the continuation (lm-evaluation-harness's rule)."""
    spaces = len(context) - len(context.rstrip())
    return (context[:-spaces], context[-spaces:] + continuation) if spaces else (context, continuation)


def split_ids(ctx_ids: list[int], whole_ids: list[int], prefix_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) from the encodings of the context and of the whole text: the whole
    with the context's length cut off its front, after the end-of-text prefix."""
    ctx, whole = [prefix_id, *ctx_ids], [prefix_id, *whole_ids]
    if len(whole) <= len(ctx):  # the continuation merged into the context's last token: score that token
        return whole[:-1], whole[-1:]
    return whole[: len(ctx)], whole[len(ctx) :]


def encode_pair(tokenizer, context: str, continuation: str, prefix_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness's `_encode_pair` splits them, after the
    end-of-text prefix: trailing whitespace goes to the continuation, the whole text is encoded and the
    context's own encoding cut off its front. `tokenizer` is a `tokenizers.Tokenizer`."""
    context, continuation = split_space(context, continuation)
    ctx = tokenizer.encode(context, add_special_tokens=False).ids
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    return split_ids(ctx, whole, prefix_id)


@dataclass
class _Request:
    seq: list[int]
    start: int
    """Index in `seq` of the first continuation token."""
    truncated: bool


@dataclass
class _Unit:
    """A shared prefix and the branches that follow it, in one row."""

    prefix: list[int]
    branches: list[tuple[int, list[int], list[int]]]
    """(request index, the branch's input tokens, its scored tokens). A branch's inputs are its sequence past
    the prefix without the last token (only ever a target); its targets are the continuation, the first
    predicted at the input just before it (the prefix's last token when the branch has no context of its own)."""

    @property
    def size(self) -> int:
        return len(self.prefix) + sum(len(b) for _, b, _ in self.branches)

    @property
    def plain(self) -> bool:
        """One sequence: at most one branch has inputs of its own (a choice of one token is predicted at the
        prefix's last token and adds none), so plain causal attention serves it."""
        return sum(1 for _, inputs, _ in self.branches if inputs) <= 1


class Scorer:
    """Scores (context, continuation) requests on a `Transformer` (or a `Backbone`), packed (see the module's
    docstring). `tokenizer` is a `tokenizers.Tokenizer`; `prefix_id` starts every prompt.

    Each forward pass holds at most `rows` times the model's context length (at most `BUDGET_ROW`) in tokens.
    On CUDA the forward runs under bf16 autocast unless the model is already in a low precision; elsewhere in
    the model's dtype.
    """

    def __init__(self, model: Transformer | Backbone, tokenizer, prefix_id: int, *, rows: int = 16) -> None:
        self.backbone = model if isinstance(model, Backbone) else Backbone(model)
        self.model = self.backbone.module
        self.tokenizer, self.prefix_id = tokenizer, prefix_id
        self.row_len = self.backbone.context
        self.rows = rows

    # --- tokens --------------------------------------------------------------------------------------------

    def requests(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
        """The pairs tokenized as `encode_pair` does, as (sequence, first continuation index), each distinct
        text once, in parallel batches (the tokenizer's own threads: a multiple-choice context is shared by
        its choices)."""
        split = [split_space(c, k) for c, k in pairs]
        texts = list(dict.fromkeys(t for c, k in split for t in (c, c + k)))
        ids = dict(zip(texts, (e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False))))
        out = []
        for context, continuation in split:
            ctx, cont = split_ids(ids[context], ids[context + continuation], self.prefix_id)
            out.append((ctx + cont, len(ctx)))
        return out

    def fit(self, seq: list[int], start: int, keep: int) -> _Request:
        """A tokenized request cut to the model: a continuation longer than the context keeps its head; a
        sequence longer than `keep` tokens loses tokens of its context on the left."""
        seq = seq[: start + min(self.row_len, keep - 1)]  # at least one context token survives the cut
        if len(seq) > keep:
            cut = len(seq) - keep
            return _Request(seq[cut:], max(0, start - cut), True)
        return _Request(seq, start, False)

    def units(
        self, questions: list[list[tuple[list[int], int]]], keep: int
    ) -> tuple[list[_Request], list[_Unit]]:
        """Every request, and the units they are packed as: per question, the prefix all its requests share
        (up to the shortest context), then one branch each; split where the unit would not fit a row."""
        requests = [self.fit(seq, start, keep) for q in questions for seq, start in q]
        units, first = [], 0
        for pairs in questions:
            reqs = requests[first : first + len(pairs)]
            shared = min(r.start for r in reqs)
            for r in reqs[1:]:
                shared = min(
                    shared, next((i for i, (a, b) in enumerate(zip(reqs[0].seq, r.seq)) if a != b), shared)
                )
            prefix = reqs[0].seq[:shared]
            unit = _Unit(prefix, [])
            for k, r in enumerate(reqs):
                branch = (first + k, r.seq[shared:-1], r.seq[r.start :])
                if unit.branches and unit.size + len(branch[1]) > self.row_len:
                    units.append(unit)
                    unit = _Unit(prefix, [])
                unit.branches.append(branch)
            units.append(unit)
            first += len(pairs)
        return requests, units

    def batches_of(self, units: list[_Unit]) -> list[list[list[_Unit]]]:
        """Units into forward passes: the largest unit left sets a batch's row length T, and the units that
        follow (largest first) are packed best-fit into at most `rows * row_len / T` rows of T tokens.

        Rows as long as the batch's largest unit, not the model's context: attention costs T^2 a row, so
        short units share a short row instead of a long one (and never more rows than the token budget).
        A plain unit (one sequence) gets a row of its own in a batch of plain rows."""
        budget = self.rows * min(self.row_len, BUDGET_ROW)
        # A plain unit is one sequence: one a row, plain causal attention (no mask: SDPA may take its flash
        # kernel), so never packed with another.
        plain = sorted((u for u in units if u.plain), key=lambda u: -u.size)
        batches, at = [], 0
        while at < len(plain):
            take = max(1, budget // plain[at].size)
            batches.append([[u] for u in plain[at : at + take]])
            at += take
        ordered = sorted((u for u in units if not u.plain), key=lambda u: -u.size)
        at = 0
        while at < len(ordered):
            width = ordered[at].size
            rows: list[list[_Unit]] = []
            free: list[tuple[int, int]] = []  # (free tokens, row index), sorted
            while at < len(ordered):
                unit = ordered[at]
                fit = bisect.bisect_left(free, (unit.size, -1))
                if fit < len(free):
                    space, row = free.pop(fit)
                    rows[row].append(unit)
                elif (len(rows) + 1) * width <= budget or not rows:
                    rows.append([unit])
                    space, row = width, len(rows) - 1
                else:
                    break
                if space > unit.size:
                    bisect.insort(free, (space - unit.size, row))
                at += 1
            batches.append(rows)
        return batches

    # --- scoring -------------------------------------------------------------------------------------------

    def score(self, questions: list[list[tuple[str, str]]], on_batch=None) -> list[list[Scored]]:
        """Each question's (context, continuation) pairs scored, in order, split as lm-evaluation-harness
        splits them (its truncation too: row_len + 1 tokens, the last only a target)."""
        flat = self.requests([pair for pairs in questions for pair in pairs])
        tokenized, k = [], 0
        for pairs in questions:
            tokenized.append(flat[k : k + len(pairs)])
            k += len(pairs)
        return self.score_tokens(tokenized, on_batch, keep=self.row_len + 1)

    @torch.no_grad()
    def score_tokens(
        self, questions: list[list[tuple[list[int], int]]], on_batch=None, *, keep: int | None = None
    ) -> list[list[Scored]]:
        """Each question's requests, tokenized as (sequence, index of its first scored token), scored in
        order: a list of `Scored` per question. A sequence longer than `keep` tokens (default: the context
        length, as nanochat and llm-foundry cut) loses tokens on the left. `on_batch(items)` after each
        forward pass: the questions it finished, a request counting 1/len(its question)."""
        requests, units = self.units(questions, self.row_len if keep is None else keep)
        results: list[Scored | None] = [None] * len(requests)
        batches = self.batches_of(units)
        share = [1.0 / len(pairs) for pairs in questions for _ in pairs]
        model = self.model
        was_training = model.training
        model.eval()
        try:
            for rows in batches:
                self.forward(rows, requests, results)
                if on_batch is not None:
                    on_batch(sum(share[r] for row in rows for u in row for r, _, _ in u.branches))
        finally:
            model.train(was_training)
        out, k = [], 0
        for pairs in questions:
            out.append(results[k : k + len(pairs)])
            k += len(pairs)
        return out

    def forward(self, rows: list[list[_Unit]], requests: list[_Request], results: list) -> None:
        """One packed batch: fill `results` for every request with a branch in these rows."""
        device = self.backbone.device
        T = max(sum(u.size for u in row) for row in rows)
        B = len(rows)
        idx = torch.zeros(B, T, dtype=torch.long)
        pos = torch.zeros(B, T, dtype=torch.long)
        unit_id = torch.full((B, T), -1, dtype=torch.long)  # padding: its own unit, seen by nothing real
        branch_id = torch.zeros(B, T, dtype=torch.long)  # 0: a prefix token
        where: list[tuple[int, list[int], list[int]]] = []  # (request, flat predictor indices, targets)
        n_unit = 0
        for b, row in enumerate(rows):
            t = 0
            for unit in row:
                p = len(unit.prefix)
                idx[b, t : t + p] = torch.tensor(unit.prefix, dtype=torch.long)
                pos[b, t : t + p] = torch.arange(p)
                unit_id[b, t : t + p] = n_unit
                last_prefix = t + p - 1
                t += p
                for k, (request, tokens, targets) in enumerate(unit.branches, start=1):
                    n = len(tokens)
                    if n:
                        idx[b, t : t + n] = torch.tensor(tokens, dtype=torch.long)
                        pos[b, t : t + n] = torch.arange(p, p + n)
                        unit_id[b, t : t + n] = n_unit
                        branch_id[b, t : t + n] = k
                    # the targets are the branch's last len(targets) tokens of inputs + 1: the first is
                    # predicted at input n - len(targets) (the prefix's last token when that is -1)
                    first = n - len(targets)
                    predictors = [b * T + (t + j if j >= 0 else last_prefix) for j in range(first, n)]
                    where.append((request, predictors, targets))
                    t += n
                n_unit += 1
        flat = torch.tensor([i for _, ps, _ in where for i in ps], dtype=torch.long, device=device)
        targets = torch.tensor([x for _, _, ts in where for x in ts], dtype=torch.long, device=device)
        packed = {}
        # A model trained with model.doc_mask never saw across an end-of-text token: the one each prompt starts
        # with is its own document, and the mask says so (whatever Transformer.eot_id holds), so it always has one.
        doc_mask = self.backbone.doc_mask
        if doc_mask or any(len(row) > 1 or not row[0].plain for row in rows):  # else one sequence a row
            unit_id, branch_id = unit_id.to(device), branch_id.to(device)  # the (B, T, T) mask built there
            same_unit = unit_id[:, :, None] == unit_id[:, None, :]
            visible = (branch_id[:, None, :] == 0) | (branch_id[:, :, None] == branch_id[:, None, :])
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            mask = same_unit & visible & causal
            if doc_mask:  # the leading end-of-text sees itself only
                pos_d, idx_d = pos.to(device), idx.to(device)
                lead = (pos_d == 0) & (idx_d == self.prefix_id)
                mask &= ~(lead[:, None, :] & ~lead[:, :, None])
            packed = {"pos_BT": pos.to(device), "mask_B1TT": mask.unsqueeze(1)}
        with self.autocast(device):
            hidden = self.backbone.hidden(idx.to(device), **packed)
            logits = self.backbone.head(hidden.reshape(B * T, -1)[flat])
        logprobs = F.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(1, targets[:, None])[:, 0].double().cpu()
        hits = (logprobs.argmax(dim=-1) == targets).cpu()
        at = 0
        for request, predictors, _ in where:
            n = len(predictors)
            results[request] = Scored(
                float(picked[at : at + n].sum()),
                n,
                bool(hits[at : at + n].all()),
                requests[request].truncated,
            )
            at += n

    def autocast(self, device: torch.device):
        if device.type == "cuda" and next(self.model.parameters()).dtype == torch.float32:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()
