"""Write src/lm/numbers/core_testbed.csv from the public scaling testbed of Gadre et al. 2024.

The testbed (github.com/mlfoundations/scaling, MIT licence) holds 104 models (11M-6.9B parameters, trained on
C4, RedPajama and RefinedWeb) with 8 validation losses each (exp_data/models/) and 46 downstream accuracies
(exp_data/evals/, llm-foundry's harness: DCLM's convention). This script reads them from a git clone at a
stated commit and keeps, per model: its training set, parameters, tokens, the loss on its own training set's
Paloma split (what a user measures: validation on their own data), the loss on C4's validation set (one
common axis) and the 22 CORE tasks' accuracies. CORE itself is computed by lm's code (lm.evals.core: centred
accuracy against the v1 and v2 baseline tables), and a test recomputes it from the stored accuracies.

    git clone https://github.com/mlfoundations/scaling /tmp/scaling
    python experiments/2026-11-29-core-map/testbed.py /tmp/scaling a003c4913793ac2ae7ef87b28ecb562955d026d5
"""

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

from lm.evals.core import BASELINES, CORE_TASKS, centred

OUT = Path(__file__).resolve().parents[2] / "src" / "lm" / "numbers" / "core_testbed.csv"
OWN_SPLIT = {
    "c4_original": "paloma_c4_en",
    "rpj": "paloma_redpajama",
    "rw_original": "paloma_falcon-refinedweb",
}
"""Each training set's own validation split among the testbed's eight."""


def show(repo: Path, commit: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def split_name(result: dict) -> str:
    parts = result["val_data"][0].split("/")
    return "de-en" if "de-en" in parts[-2] else parts[-2]


def row(repo: Path, commit: str, path: str) -> dict:
    model = json.loads(show(repo, commit, path))
    stem = Path(path).stem
    icl = json.loads(show(repo, commit, f"exp_data/evals/evaluation_{stem}_heavy.json"))["eval_metrics"][
        "icl"
    ]
    losses = {split_name(r): r["loss"] for r in model["results"]}
    hp = model["hyperparameters"]
    out = {
        "name": model["name"],
        "dataset": model["dataset_name"],
        "params": hp["params"],
        "tokens": hp["tokens"],
        "loss_own": round(losses[OWN_SPLIT[model["dataset_name"]]], 6),
        "loss_c4": round(losses["c4_val"], 6),
    }
    accuracy = {t.label: icl[t.label] for t in CORE_TASKS}
    for version, table in BASELINES.items():
        core = sum(centred(accuracy[label], table[label]) for label in accuracy) / len(accuracy)
        out[f"core_{version}"] = round(core, 6)
    return out | {label: round(acc, 6) for label, acc in accuracy.items()}


def main(repo: Path, commit: str) -> None:
    full = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    names = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "--name-only", full, "exp_data/models/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    rows = [row(repo, full, p) for p in sorted(names)]
    buf = io.StringIO()
    buf.write(
        "# The public scaling testbed of Gadre et al. 2024, 'Language models scale reliably with over-training\n"
        f"# and on downstream tasks': github.com/mlfoundations/scaling at commit {full} (MIT licence,\n"
        "# Copyright (c) 2024 mlfoundations). Accuracies: llm-foundry's harness (DCLM convention). Written by\n"
        "# experiments/2026-11-29-core-map/testbed.py; CORE columns computed by lm.evals.core. Do not edit.\n"
    )
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    OUT.write_text(buf.getvalue())
    print(f"wrote {OUT}: {len(rows)} models from {repo} at {full}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
