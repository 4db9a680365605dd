"""Ledger item a: exact resume on CUDA with compile, bf16 and fused AdamW (`134m`).

Two straight runs and one run cut by SIGTERM after step CUT (it saves the next step and exits 75), then
resumed by the same command to the end. "Exact" on CUDA is defined by what the card can give: the largest
absolute difference of the final weights and AdamW state (`lm.tools.selftest.max_difference`, 0.0 is bitwise)
between resumed and straight, against the same difference between the two straight runs. Verdicts:
`bitwise` (all 0), `within spread` (the resumed run is no farther from either straight run than they are from
each other: the resume adds nothing the kernels do not already do), `resume bug` (farther).

When the straight runs differ and the box has time left, the same pair again with Lightning's
`deterministic=true` (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8): whether it is
bitwise then, and its cost in tokens/s against the default's.

    python3 experiments/gpu/items/a_exact_resume.py [STEPS CUT]
    LEDGER_CPU_STANDIN=1 python3 experiments/gpu/items/a_exact_resume.py 8 3    # the item's logic, tiny, on CPU
"""

from __future__ import annotations

import sys
import time

import common

from lm.tools.selftest import max_difference

STEPS, CUT = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (40, 17)
MODEL = ["model=134m", "precision=bf16", "kernels=compile", "optim.fused=true", *common.DATA]
BASE = [
    *(common.TINY if common.STANDIN else MODEL),
    *common.QUIET,
    "data.batch_size=8",
    f"trainer.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",  # one schedule for every invocation, however early it stops
    f"optim.warmup_steps={max(1, STEPS // 4)}",
    "optim.decay_fraction=0.25",  # the decay starts at step 30 of 40: the resumed run crosses it
    f"trainer.val_every_steps={STEPS // 2}",  # a validation before the cut and one after
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=5",
    "checkpoint.every_n_steps=100000",  # only the SIGTERM save and the final one
    "checkpoint.keep_last=1",
]
SIGTERM = ["+callbacks.ledger_cut._target_=lm.tools.selftest.SigtermAt", f"+callbacks.ledger_cut.step={CUT}"]
DETERMINISTIC = ["+trainer.extra.deterministic=true"]
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def arm(tag: str, extra: list[str], env: dict[str, str] | None, straights: int) -> dict:
    """`straights` straight runs and one cut + resumed run; the differences and tokens/s."""
    root = common.WORK / tag
    out: dict = {"runs": {}}
    names = [f"straight{i + 1}" for i in range(straights)]
    for name in names:
        code, seconds = common.train(root, name, [*BASE, *extra], common.left(), env)
        out["runs"][name] = {"exit": code, "s": round(seconds, 1)}
        if code != 0:
            out["error"] = f"{tag}/{name} exit {code}"
            return out
    code, seconds = common.train(root, "cut", [*BASE, *extra, *SIGTERM], common.left(), env)
    out["runs"]["cut"] = {"exit": code, "s": round(seconds, 1)}
    if code != 75:
        out["error"] = f"{tag}/cut exit {code} (expected 75: saved at the next step and preempted)"
        return out
    out["saved_at"] = common.last_checkpoint(root / "cut")["global_step"]
    code, seconds = common.train(root, "cut", [*BASE, *extra], common.left(), env)  # the same run, no cut
    out["runs"]["resume"] = {"exit": code, "s": round(seconds, 1)}
    if code != 0:
        out["error"] = f"{tag}/resume exit {code}"
        return out
    ckpt = {n: common.last_checkpoint(root / n) for n in [*names, "cut"]}
    assert all(c["global_step"] == STEPS for c in ckpt.values()), {
        n: c["global_step"] for n, c in ckpt.items()
    }
    out["resumed_vs_straight"] = [max_difference(ckpt["cut"], ckpt[n]) for n in names]
    out["straight_vs_straight"] = max_difference(ckpt[names[0]], ckpt[names[1]]) if straights > 1 else None
    out["tokens_per_sec"] = common.steady(root / names[0], "perf/tokens_per_sec", skip=15)
    return out


def verdict(a: dict) -> str:
    resumed, spread = max(a["resumed_vs_straight"]), a["straight_vs_straight"]
    if resumed == 0.0 and not spread:
        return "bitwise"
    if spread is not None and resumed <= spread:
        return "within spread"
    return "resume bug"


def main() -> None:
    started = time.monotonic()
    default = arm("default", [], None, straights=2)
    fields = {"steps": STEPS, "cut_after": CUT, **common.gpu(), "default": default}
    if "error" in default:
        common.result(f"failed: {default['error']}", status="failed", **fields)
        return
    fields["verdict"] = verdict(default)
    summary = (
        f"{fields['verdict']}: resumed-vs-straight max|diff| {max(default['resumed_vs_straight']):.3g}, "
        f"straight-vs-straight {default['straight_vs_straight']:.3g} ({STEPS} steps, SIGTERM after {CUT})"
    )
    per_run = (time.monotonic() - started) / 4
    if default["straight_vs_straight"] and common.left() > 3.3 * per_run:
        det = arm("deterministic", DETERMINISTIC, DETERMINISTIC_ENV, straights=1)
        fields["deterministic"] = det
        if "error" in det:
            summary += f"; deterministic=true failed: {det['error']}"
        else:
            cost = (det["tokens_per_sec"] or 0) / (default["tokens_per_sec"] or float("nan"))
            diff = det["resumed_vs_straight"][0]
            summary += f"; deterministic=true: resumed-vs-straight {diff:.3g} at {cost:.2f}x the tokens/s"
    elif default["straight_vs_straight"]:
        summary += "; no time left in the box for the deterministic=true arm"
    common.result(summary, **fields)


if __name__ == "__main__":
    common.main(main)
