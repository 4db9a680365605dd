"""Text generation with a KV cache: greedy or seeded temperature / top-k sampling.

With the cache, each new token costs one forward over one position instead of over the whole prefix, so
sampling a 1B model for a few hundred tokens takes seconds. `use_cache=False` recomputes the whole prefix
every step; it exists as the reference the cached path is tested against.
"""

from __future__ import annotations

import logging

import torch
from tokenizers import Tokenizer

from lm.base.exits import Refused
from lm.model import KVCache, Transformer

log = logging.getLogger(__name__)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_id: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Continue `prompt` (token ids) by up to `max_new_tokens` ids; returns only the new ids.

    temperature 0 is greedy (argmax). Otherwise logits / temperature are sampled, restricted to the `top_k`
    most likely tokens if given, with a private generator seeded by `seed`: the same weights, prompt and
    seed always give the same text, whatever else the process has drawn from the global RNG.
    Generation stops after `stop_id` (end of text) or at the model's context length.
    """
    if not prompt:
        raise Refused("generate needs a non-empty prompt; an empty string encodes to no tokens")
    cfg = model.cfg
    device = model.lm_head.weight.device
    room = cfg.max_seq_len - len(prompt)
    if room < 1:
        raise Refused(
            f"the prompt has {len(prompt)} tokens but model.max_seq_len={cfg.max_seq_len}; shorten the prompt"
        )
    if max_new_tokens > room:
        log.debug("generating %d tokens, not %d: the context holds %d", room, max_new_tokens, cfg.max_seq_len)
        max_new_tokens = room
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)

    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    cache = KVCache(cfg, 1, device, model.tok_emb.weight.dtype) if use_cache else None
    step_input = ids
    out: list[int] = []
    for _ in range(max_new_tokens):
        # .forward, not __call__: a model compiled in place for training would otherwise recompile for
        # every new cache length; generation is latency-bound on one sequence and gains little from it.
        logits = model.forward(step_input, kv_cache=cache) if use_cache else model.forward(ids)
        next_id = pick(logits[0, -1, : vocab_limit(model)].float(), temperature, top_k, generator)
        out.append(next_id)
        if next_id == stop_id:
            break
        new = torch.tensor([[next_id]], dtype=torch.long, device=device)
        ids = torch.cat([ids, new], dim=1)
        step_input = new  # with the cache, only the newest token goes through the model
    model.train(was_training)
    return out


def vocab_limit(model: Transformer) -> int:
    """Real vocabulary size: the padding rows of the embedding are never sampled."""
    return model.cfg.vocab_size


def pick(
    logits_V: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> int:
    """One token id from last-position logits (V,)."""
    if temperature <= 0:
        return int(torch.argmax(logits_V))
    logits_V = logits_V / temperature
    if top_k is not None and top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    probs = torch.softmax(logits_V, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def complete(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_id: int | None = None,
    fit_context: bool = False,
) -> str:
    """The model's continuation of `prompt` as text (without the prompt), stopping after `stop_id` (the
    run's end-of-text id), which is not part of the text.

    `fit_context` keeps only the prompt's last tokens when it would leave the model no room to write (a
    milestone sampler must never stop a training run over a long prompt); otherwise that is an error.
    """
    ids = tokenizer.encode(prompt).ids
    if fit_context:
        keep = model.cfg.max_seq_len - max(1, min(max_new_tokens, model.cfg.max_seq_len // 2))
        if len(ids) > keep:
            log.warning(
                "prompt %r has %d tokens; sampling from its last %d (model.max_seq_len=%d)",
                prompt[:40],
                len(ids),
                keep,
                model.cfg.max_seq_len,
            )
            ids = ids[-keep:]
    new = generate(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        stop_id=stop_id,
    )
    if new and new[-1] == stop_id:
        new = new[:-1]
    return tokenizer.decode(new)
