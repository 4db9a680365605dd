"""Bytes of raw source per training token of the byte-level BPE `lm prepare` trains, at each vocabulary size,
on the bundled stdlib corpus: the default `lm plan` estimates an unprepared corpus with when no tokenizer
exists yet (lm.tools.corpus_size.BYTES_PER_TOKEN).

    .venv/bin/python experiments/2026-11-24-startup/bytes_per_token.py

The tokenizer is trained as `lm prepare` trains it (data.tokenizer_sample_bytes of training documents in the
same hash order). Two numbers per size: `corpus`, the corpus's bytes on disk less the validation share over
its training tokens (end-of-text included), which is what lm.tools.corpus_size.estimate_corpus divides by; and
`held out`, UTF-8 bytes per token on the validation documents only (text the tokenizer never saw).
"""

import time

from lm.config import DataConfig
from lm.data import sources
from lm.data.shards import forced_validation, sample_documents
from lm.data.tokenizer import sample_texts, train_tokenizer
from lm.tools.budget import bytes_per_token


def documents(cfg: DataConfig, plan: sources.UnitPlan) -> tuple[list[str], list[str]]:
    """(training texts, validation texts) of the whole corpus, split as `lm prepare` splits it."""
    forced = forced_validation(cfg, plan)
    train, val = [], []
    for unit in plan.units:
        for doc in sources.read_unit(unit, cfg, []):
            is_val = forced.get(doc.name, sources.is_validation(doc.name, cfg.val_fraction))
            (val if is_val else train).append(doc.text)
    return train, val


def main() -> None:
    base = DataConfig(source="stdlib")
    plan = sources.plan_units(base)
    train, val = documents(base, plan)
    print(
        f"stdlib: {plan.n_bytes / 1e6:.1f} MB on disk, {len(train)} training and {len(val)} validation documents"
    )
    for vocab in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        cfg = DataConfig(source="stdlib", vocab_size=vocab)
        start = time.process_time()
        tok = train_tokenizer(
            sample_texts(
                sample_documents(cfg, plan, forced_validation(cfg, plan)), cfg.tokenizer_sample_bytes
            ),
            vocab,
        )
        tokens = sum(len(e.ids) for e in tok.encode_batch(train)) + len(train)
        corpus = plan.n_bytes * (1 - cfg.val_fraction) / tokens
        print(
            f"vocab {vocab:>6}: corpus {corpus:.3f} bytes/token ({tokens:,} training tokens), held out "
            f"{bytes_per_token(tok, val):.3f} ({time.process_time() - start:.0f} s CPU)"
        )


if __name__ == "__main__":
    main()
