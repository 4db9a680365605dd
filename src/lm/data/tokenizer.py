"""Byte-level BPE tokenizer (GPT-2 style) trained with Hugging Face `tokenizers`.

Byte-level means every string is representable and decode(encode(text)) == text, so no text is ever lost to
an unknown token. The single special token marks the end of each document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lm.base.exits import Refused

EOT = "<|endoftext|>"
EOT_ID = 0
"""Special tokens take the first ids, so the end-of-text id is the same for every vocab_size."""
MIN_VOCAB_SIZE = 256 + 2
"""The 256 byte tokens, end-of-text and at least one merge."""


def train_tokenizer(texts: Iterable[str], vocab_size: int, eot_token: str = EOT) -> Tokenizer:
    """Train a byte-level BPE with at most `vocab_size` ids: `eot_token` (id 0), the 256 bytes, then merges."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise Refused(f"data.vocab_size={vocab_size} is too small; use data.vocab_size>={MIN_VOCAB_SIZE}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eot_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(eot_token) != EOT_ID:
        raise RuntimeError(
            f"{eot_token} got id {tok.token_to_id(eot_token)}, expected {EOT_ID}; the trainer changed"
        )
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer saved by `prepare` (a `tokenizer.json` file or the dataset folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}; run `prepare` (or the training script) first")
    return Tokenizer.from_file(str(path))


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file: the identity of a saved tokenizer."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sample_texts(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Yield whole texts until `max_bytes` of UTF-8 is reached, passing over those that do not fit."""
    total, first = 0, None
    for text in texts:
        first = text if first is None else first
        size = len(text.encode("utf-8"))
        if total + size <= max_bytes:
            total += size
            yield text
    if total == 0 and first:
        # Every text is larger than the budget: train on a prefix rather than on nothing.
        yield first[:max_bytes]


def tokenizer_id(tokenizer: Tokenizer, eot_token: str) -> int:
    """Id of `eot_token` in `tokenizer`, or an error naming the fix."""
    eot = tokenizer.token_to_id(eot_token)
    if eot is None:
        raise Refused(
            f"the tokenizer has no end-of-text token {eot_token!r}; set data.eot_token to its end-of-document "
            "token (e.g. '</s>' or '<|end_of_text|>')"
        )
    return eot


def load_tokenizer_spec(spec: str) -> tuple[Tokenizer, str]:
    """(tokenizer, its serialized JSON) from a tokenizer.json path or a Hugging Face tokenizer name."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        text = path.read_bytes().decode("utf-8")  # no newline translation: the sha256 is of the bytes
        return Tokenizer.from_str(text), text
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"data.tokenizer {spec!r} does not exist; train one with `lm tokenizer train`"
        )
    try:
        tok = Tokenizer.from_pretrained(spec)
    except Exception as e:
        raise Refused(
            f"data.tokenizer {spec!r} is neither a tokenizer.json file nor a Hugging Face tokenizer this "
            f"machine can download ({type(e).__name__}: {e})"
        ) from e
    return tok, tok.to_str()


def text_sha256(text: str) -> str:
    """Hex sha256 of a serialized tokenizer: the identity recorded in a manifest."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
