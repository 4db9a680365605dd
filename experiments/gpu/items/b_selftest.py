"""Ledger item b: `lm selftest +experiment=plan_1b` on the GPU: its wall time (goal <= 180 s) and each check's.

The selftest prints `lm selftest: <check> <STATUS> (<s> s)` on stderr as each check ends, so a selftest cut
at the box's end still says which checks ran and what each took. The selftest is stopped 10 s before the
box ends (SIGTERM from `timeout`) so this item always reports.

    python3 experiments/gpu/items/b_selftest.py [overrides...]      # default: +experiment=plan_1b evals=off
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import common

GOAL_S = 180.0
LINE = re.compile(r"^lm selftest: (\w+) (PASS|FAIL|SKIP) \(([\d.]+) s\)")


def main() -> None:
    overrides = sys.argv[1:] or ["+experiment=plan_1b", "evals=off"]
    cmd = [sys.executable, "-m", "lm.cli", "selftest", *overrides]
    common.say(f"$ {' '.join(cmd)}")
    output = common.WORK / "selftest.txt"
    output.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(output, "w") as f:  # a file, not a pipe: the wait below needs no reader
        proc = subprocess.Popen(cmd, cwd=common.REPO, stdout=f, stderr=subprocess.STDOUT)
    try:
        code = proc.wait(timeout=max(1.0, common.left()))
    except subprocess.TimeoutExpired:
        code = None
    finally:
        common.stop(proc)
    wall = time.monotonic() - started
    text = output.read_text(errors="replace")
    common.say(text)
    checks = {
        m[1]: {"status": m[2].lower(), "s": float(m[3])} for m in map(LINE.match, text.splitlines()) if m
    }
    rows = ", ".join(
        f"{k} {v['s']:.0f}s" + ("" if v["status"] == "pass" else f" {v['status']}") for k, v in checks.items()
    )
    if code is not None:
        met = "met" if wall <= GOAL_S else "missed"
        summary = f"{wall:.0f} s (goal <= {GOAL_S:.0f} s: {met}), exit {code}: {rows}"
    else:
        summary = f"cut after {wall:.0f} s (goal {GOAL_S:.0f} s: missed), {len(checks)} checks done: {rows}"
    common.result(
        summary,
        status="failed" if any(v["status"] == "fail" for v in checks.values()) else "done",
        wall_s=round(wall, 1),
        goal_s=GOAL_S,
        exit=code,
        checks=checks,
        overrides=overrides,
        **common.gpu(),
    )


if __name__ == "__main__":
    common.main(main)
