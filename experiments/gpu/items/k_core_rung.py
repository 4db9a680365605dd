"""Ledger item k: one rung of the CORE calibration ladder on lm's own axis (issue 63).

The loss-to-CORE map is calibrated on the user's own runs (`lm core-map`): a run counts once its CORE reaches
0.1 clear of chance, about 1e19 FLOPs on the public testbed (a 154M model on 11B tokens; ~7 GPU-hours of an
H100 at 40% MFU), which no 15-minute window reaches. What one window does add: the first point on lm's own
axis (its 32K tokenizer and the plan_1b data), the price of a rung, and whether lm's CORE at the near-chance
end sits where the public prior says for that loss. The run: n110m (12 x 768) for STEPS steps of 16 x 4
windows of 2048 tokens in bf16 with compile, CORE-500 over the task files the checkout carries at its end
(evals=core, CORE-18), then `lm core-map` on it (a refusal below the signal is the expected answer, and is
recorded as such). Result: tokens, seconds, FLOPs, the final validation loss, CORE +- its stderr, the
prior's 90% interval at that loss, and core-map's verdict.

    python3 experiments/gpu/items/k_core_rung.py [STEPS]
"""

from __future__ import annotations

import json
import sys

import common

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 400
SHAPE = ["model.n_layer=12", "model.d_model=768", "model.n_head=12"]
RUN = [
    *common.DATA,
    "data.batch_size=16",
    "trainer.accumulate_grad_batches=4",
    "precision=bf16",
    "kernels=compile",
    "sampling=off",
    "early_stopping=off",
    "logger=tensorboard",
    "trainer.enable_progress_bar=false",
]


def main() -> None:
    root = common.WORK / "core_rung"
    base = common.TINY if common.STANDIN else [*RUN, *SHAPE]
    steps = 8 if common.STANDIN else STEPS
    evals = [
        "evals=core",
        "evals.partial=true",
        f"evals.data_dir={common.core_dir()}",
        f"evals.steps=[{steps}]",
    ]
    args = [
        *base,
        *evals,
        f"trainer.max_steps={steps}",
        f"trainer.val_every_steps={steps}",
        "phases.phases=[]",
    ]
    code, seconds = common.train(root, "rung", args, common.left(60))
    run = root / "rung"
    fields: dict = {**common.gpu(), "exit": code, "seconds": round(seconds, 1), "steps": steps}
    records = (
        [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()] if code == 0 else []
    )
    core = next((r["core"] for r in reversed(records) if r.get("core")), None)
    losses = common.scalars(run, "val/loss")
    if core is None or not losses:
        common.result(f"no CORE point: train exit {code} after {seconds:.0f} s", status="failed", **fields)
        return
    from lm.numbers.core_map import public_prior

    loss = losses[-1][1]
    prior = public_prior(core.get("version", "v1")).predict(loss)
    map_code, _ = common.lm("core-map", [str(run), "--out", str(root / "core_map.json")], 120)
    fields |= {"loss": loss, "core": core["value"], "stderr": core.get("stderr"), "label": core["label"]}
    fields |= {"prior": prior.record(), "core_map_exit": map_code}
    verdict = (
        "calibrated"
        if map_code == 0
        else "refused (below the signal)"
        if map_code == 78
        else f"exit {map_code}"
    )
    common.result(
        f"n110m, {steps} steps in {seconds:.0f} s: val loss {loss:.3f}, {core['label']} {core['value']:.4f} +- "
        f"{core.get('stderr') or 0:.4f}; the prior says {prior.text()}; lm core-map: {verdict}",
        **fields,
    )


if __name__ == "__main__":
    common.main(main)
