"""The same items of each CORE task scored under both conventions, item by item: nanochat's first N after its
Random(1337) shuffle, each also rendered, drawn and tokenized as DCLM's llm-foundry would (its examples drawn
over the whole file, jeopardy within the item's category). Prints a Markdown table and writes flips.json.

    python experiments/2026-11-29-core-conventions/flips.py RUN_DIR CORE_DIR N
"""

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer

from lm.evals import conventions, core, own
from lm.evals.conventions import DCLM, NANOCHAT
from lm.evals.scorer import Scorer
from lm.interop.hf import load_run


def correct(scorer, part, convention) -> list[int]:
    qs = conventions.questions(part, convention)
    scored = scorer.score_tokens(conventions.tokens(qs, convention, scorer.tokenizer, scorer.prefix_id))
    return [own.tally(part.data, q, s).right for q, s in zip(qs, scored)]


def main(run_dir: str, core_dir: str, n: int) -> None:
    run = load_run(run_dir, "cpu")
    scorer = Scorer(run.model, Tokenizer.from_file(str(run.tokenizer_path)), run.eot_id)
    present, _ = core.check_folder(core_dir, [t.label for t in core.CORE_TASKS], partial=True)
    rows = {}
    for label in present:
        data = core.load_task(core_dir, label)
        order = list(range(len(data.items)))
        random.Random(conventions.SHUFFLE_SEED).shuffle(order)  # the file index of each shuffled item
        files = order[:n]
        (part,) = conventions.prepare(data, NANOCHAT, n)
        mine = dict(zip(files, correct(scorer, part, NANOCHAT)))
        theirs = {}
        for p in conventions.prepare(data, DCLM, None):
            if label == "jeopardy":  # file index -> index within its category
                cat = p.data.label.split("/")[1]
                where = [i for i, x in enumerate(data.items) if x["category"] == cat]
            else:
                where = list(range(len(data.items)))
            local = {f: k for k, f in enumerate(where) if f in set(files)}
            sub = conventions.Part(p.data, sorted(local.values()))
            back = {k: f for f, k in local.items()}
            theirs |= {back[k]: r for k, r in zip(sub.chosen, correct(scorer, sub, DCLM))}
        flips = sum(mine[f] != theirs[f] for f in files)
        rows[label] = {
            "n": len(files),
            "nanochat": sum(mine.values()),
            "dclm": sum(theirs.values()),
            "flips": flips,
        }
        print(label, rows[label], flush=True)
    Path(__file__).with_name("flips.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
