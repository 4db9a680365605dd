"""Bytes of text per token id: the denominator of validation bits per byte (`val/bpb`).

Bits per byte is the loss in a unit that does not depend on the tokenizer, so runs with different vocabularies
compare. A window's bytes are the summed byte lengths of its target tokens, read from one table of `vocab`
integers built once per run from the run's tokenizer: for a byte-level BPE (lm's own tokenizer, GPT-2's) each
id stands for a fixed byte string, so the table gives exactly the UTF-8 length of the decoded window, and
counting a batch's bytes is a gather next to the forward pass. The end-of-text token (and every special or
padding id) is 0 bytes: it separates documents, it is not text.
"""

from __future__ import annotations

import logging

import torch
from tokenizers import Tokenizer, decoders

log = logging.getLogger("lm.data")


def token_byte_lengths(tokenizer: Tokenizer, vocab: int) -> torch.Tensor:
    """(vocab,) int64: the UTF-8 bytes each id decodes to; 0 for special tokens and ids past the tokenizer.

    Exact for byte-level tokenizers, whose tokens are spelled one character per byte (GPT-2's printable
    stand-ins for the 256 bytes); for any other (a SentencePiece-style hub tokenizer) each id is decoded
    alone, which can miss a joining space, so `val/bpb` is then an estimate (logged once).
    """
    lengths = torch.zeros(vocab, dtype=torch.int64)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    if not byte_level:
        log.warning(
            "val/bpb: the tokenizer is not byte-level; byte counts are per-token decodes (an estimate)"
        )
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i >= vocab or token in special:
            continue
        lengths[i] = len(token) if byte_level else len(tokenizer.decode([i]).encode("utf-8"))
    return lengths
