"""Ledger item a: exact resume on CUDA with compile, bf16 and fused AdamW (`134m`).

Straight runs and one run cut by SIGTERM after step CUT (it saves the next step and exits 75), then resumed by
the same command to the end. "Exact" on CUDA is defined by what the card can give: the largest absolute
difference of the final weights and AdamW state (`lm.tools.selftest.max_difference`, 0.0 is bitwise) between
resumed and straight, against the same difference between two straight runs.

Verdicts (`verdict`): `bitwise` (all 0); `resume bug` when the straight runs agree bitwise and the resumed one
does not, or when the resumed run is more than 3x farther from each straight run than they are from each
other; `within spread` when it is at most 1.5x farther from either; else `undecided`. The margins are there
because with non-deterministic kernels the three runs are exchangeable if the resume is exact: the rule of
2026-11-27 ("no farther than the straight runs are from each other") fails an exact resume 2 times in 3 (the
straight pair is the closest of three exchangeable distances 1 time in 3), and did on 2026-11-28 (resumed
0.0238 and 0.0246 against 0.0240: 0.99x and 1.03x).

Arms, in order, while the box has room for one: Lightning's `deterministic=true`
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8), which can decide bitwise, then the
default kernels (the spread a user gets, and deterministic's cost in tokens/s against it).

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
    """`bitwise`, `within spread`, `undecided` or `resume bug` (the module's docstring says why the margins)."""
    resumed, spread = a["resumed_vs_straight"], a["straight_vs_straight"]
    if spread is None:  # one straight run: only bitwise agreement decides anything
        return "bitwise" if max(resumed) == 0.0 else "undecided"
    if spread == 0.0:
        return "bitwise" if max(resumed) == 0.0 else "resume bug"
    if max(resumed) <= 1.5 * spread:
        return "within spread"
    if min(resumed) > 3.0 * spread:
        return "resume bug"
    return "undecided"


def describe(tag: str, a: dict) -> str:
    r, s = a["resumed_vs_straight"], a["straight_vs_straight"]
    return f"{tag} {verdict(a)}: resumed-vs-straight max|diff| {', '.join(f'{x:.3g}' for x in r)}, straight-vs-straight {s:.3g}"


def main() -> None:
    fields = {"steps": STEPS, "cut_after": CUT, **common.gpu()}
    parts, runs_s = [], []
    for tag, extra, env in (("deterministic", DETERMINISTIC, DETERMINISTIC_ENV), ("default", [], None)):
        per_run = max(runs_s, default=0.0)  # the slowest run so far; an arm is 4 runs
        if parts and common.left() < 4 * per_run:
            parts.append(f"no time left in the box for the {tag} arm")
            break
        started = time.monotonic()
        a = arm(tag, extra, env, straights=2)
        runs_s.append((time.monotonic() - started) / 4)
        fields[tag] = a
        if "error" in a:
            parts.append(f"{tag} failed: {a['error']}")
            continue
        a["verdict"] = verdict(a)
        parts.append(describe(tag, a))
    det, default = fields.get("deterministic", {}), fields.get("default", {})
    if det.get("tokens_per_sec") and default.get("tokens_per_sec"):
        parts.append(
            f"deterministic at {det['tokens_per_sec'] / default['tokens_per_sec']:.2f}x the default's tokens/s"
        )
    fields["verdict"] = det.get("verdict") or default.get("verdict") or "failed"
    summary = f"({STEPS} steps, SIGTERM after {CUT}) " + "; ".join(parts)
    failed = all("error" in fields.get(t, {"error": 1}) for t in ("deterministic", "default"))
    common.result(summary, **({"status": "failed"} if failed else {}), **fields)


if __name__ == "__main__":
    common.main(main)
