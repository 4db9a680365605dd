"""How the Rust batch encoder alone scales on this machine: encode_batch(_fast) with and without its threads.

    PYTHONPATH=src python experiments/2026-11-22-data-prep/encode_scaling.py true    # Rust threads on
    PYTHONPATH=src python experiments/2026-11-22-data-prep/encode_scaling.py false   # one thread

Texts are in memory (12 MB of stdlib source), so this is the tokenizer's ceiling, without reading or writing.
"""

import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = sys.argv[1]  # before the first encode: the Rust side reads it then

from lm.data.stdlib import stdlib_documents
from lm.data.tokenizer import sample_texts, train_tokenizer

docs = [d.text for d in stdlib_documents(max_bytes=12_000_000).documents]
tok = train_tokenizer(sample_texts(docs, 8_000_000), 32000)
n_bytes = sum(len(d.encode()) for d in docs)
for name in ["encode_batch", "encode_batch_fast"]:
    encode = getattr(tok, name)
    t0 = time.perf_counter()
    for i in range(0, len(docs), 256):
        ids = [e.ids for e in encode(docs[i : i + 256], add_special_tokens=False)]
    print(
        f"TOKENIZERS_PARALLELISM={sys.argv[1]} {name}: {n_bytes / 1e6 / (time.perf_counter() - t0):.2f} MB/s"
    )
