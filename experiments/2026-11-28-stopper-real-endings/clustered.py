"""The stopper table's intervals with the curves' dependence counted, and the fixed rule picked out of sample
(issue 63 item 6).

regret.py's intervals treat its 30 curves as 30 independent draws. They are 6 (rung, arm) groups x 5 seeds: the
seeds of one group share the shape, the arm and the LR, so their regrets move together. Here each group's mean
regret is one value and the interval is Student's t over the 6 group means (5 degrees of freedom), for each rule
and for the forecast stopper's regret minus the trailing window's, paired by curve.

"The best fixed rule" in regret.py's table is the trivial rule (never stop, always end at 0.5 / 0.6 / 0.8) with
the least mean regret over the same 30 curves it is then scored on: picked in sample. Held out, each group's
rule is the one with the least mean regret over the other 5 groups, scored on the held-out group's 5 curves
(leave one group out); a leave-one-curve-out pick is printed beside it, and the 4-point forecast
stopper's regret minus the held-out pick's, over the groups.

    python experiments/2026-11-28-stopper-real-endings/clustered.py --json experiments/2026-11-28-stopper-real-endings/clustered.json   # ~40 s
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import regret  # the study's own script, beside this one

from lm.numbers.stats import t_interval

FIXED = ("never stop", "always 0.5", "always 0.6", "always 0.8")


def group_of(name: str) -> str:
    """'s80/qk_norm_muon/s3' -> 's80/qk_norm_muon'."""
    return name.rsplit("/", 1)[0]


def clustered(values: list[float], groups: list[str]) -> list[float]:
    """Mean and 95% t interval over the groups' means (each group one value)."""
    by: dict[str, list[float]] = {}
    for v, g in zip(values, groups, strict=True):
        by.setdefault(g, []).append(v)
    iv = t_interval([sum(vs) / len(vs) for vs in by.values()])
    return [iv.mean, iv.low, iv.high]


def held_out(table: dict, threshold: float, groups: list[str], unit: str) -> dict:
    """The fixed rule picked on everything but one unit (a group, or a curve), scored on that unit."""
    per_rule = {rule: [r["regret"] for r in table[(threshold, rule)]] for rule in FIXED}
    units = sorted(set(groups)) if unit == "group" else list(range(len(groups)))
    member = (lambda i, u: groups[i] == u) if unit == "group" else (lambda i, u: i == u)
    scored: list[float] = [0.0] * len(groups)
    picks = []
    for u in units:
        train = [i for i in range(len(groups)) if not member(i, u)]
        best = min(FIXED, key=lambda rule: sum(per_rule[rule][i] for i in train) / len(train))
        picks.append(best)
        for i in range(len(groups)):
            if member(i, u):
                scored[i] = per_rule[best][i]
    in_sample = min(FIXED, key=lambda rule: sum(per_rule[rule]) / len(groups))
    return {
        "in_sample_rule": in_sample,
        "in_sample": sum(per_rule[in_sample]) / len(groups),
        "held_out": sum(scored) / len(groups),
        "held_out_clustered": clustered(scored, groups),
        "picks": sorted(set(picks)),
        "regret_per_curve": scored,
    }


def run() -> dict:
    curves = regret.load()
    real = [{f: c["endings"][f]["final"] for f in (*regret.FRACTIONS, 1.0)} for c in curves]
    decisions = {
        (t, rule): [regret.decide(c, rule, t) for c in curves]
        for t in regret.THRESHOLDS
        for rule in regret.RULES
    }
    table = regret.regrets(curves, real, decisions)
    names = [c["name"] for c in curves]
    groups = [group_of(n) for n in names]
    out: dict = {"curves": names, "groups": sorted(set(groups)), "thresholds": {}}
    for t in regret.THRESHOLDS:
        rows = {rule: [r["regret"] for r in table[(t, rule)]] for rule in regret.RULES}
        naive = {rule: t_interval(v) for rule, v in rows.items()}
        diff = [a - b for a, b in zip(rows["window"], rows["forecast"], strict=True)]
        out["thresholds"][str(t)] = {
            "regret_curves": {r: [iv.mean, iv.low, iv.high] for r, iv in naive.items()},
            "regret_groups": {r: clustered(v, groups) for r, v in rows.items()},
            "window_minus_forecast_curves": [(iv := t_interval(diff)).mean, iv.low, iv.high],
            "window_minus_forecast_groups": clustered(diff, groups),
            "fixed_leave_one_group_out": (fixed := held_out(table, t, groups, "group")),
            "fixed_leave_one_curve_out": held_out(table, t, groups, "curve"),
            "forecast4_minus_held_out_fixed_groups": clustered(
                [a - b for a, b in zip(rows["forecast4"], fixed["regret_per_curve"], strict=True)], groups
            ),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = run()
    print(f"{len(res['curves'])} curves in {len(res['groups'])} groups: {', '.join(res['groups'])}\n")
    print(
        "| $/loss point | rule | regret [95% over 30 curves] | regret [95% over 6 groups] |\n|---|---|---|---|"
    )
    for t, row in res["thresholds"].items():
        for rule in regret.RULES:
            a, b = row["regret_curves"][rule], row["regret_groups"][rule]
            print(
                f"| {t} | {rule} | {a[0]:.1f} [{a[1]:.1f}, {a[2]:.1f}] | {b[0]:.1f} [{b[1]:.1f}, {b[2]:.1f}] |"
            )
    print("\ntrailing window minus forecast (paired by curve; > 0: the forecast leads):\n")
    for t, row in res["thresholds"].items():
        a, b = row["window_minus_forecast_curves"], row["window_minus_forecast_groups"]
        lead = "holds" if b[1] > 0 else "not shown"
        print(
            f"- ${t}: over curves {a[0]:+.1f} [{a[1]:+.1f}, {a[2]:+.1f}]; "
            f"over groups {b[0]:+.1f} [{b[1]:+.1f}, {b[2]:+.1f}] ({lead})"
        )
    print("\nthe best fixed rule, in sample against held out:\n")
    for t, row in res["thresholds"].items():
        g, c = row["fixed_leave_one_group_out"], row["fixed_leave_one_curve_out"]
        hg = g["held_out_clustered"]
        print(
            f"- ${t}: in sample {g['in_sample']:.1f} ({g['in_sample_rule']}); leave one group out "
            f"{g['held_out']:.1f} [{hg[1]:.1f}, {hg[2]:.1f}] (picks: {', '.join(g['picks'])}); "
            f"leave one curve out {c['held_out']:.1f} (picks: {', '.join(c['picks'])})"
        )
    print("\n`forecast4` (the forecast from 4 points) minus the fixed rule picked held out, over groups:\n")
    for t, row in res["thresholds"].items():
        d = row["forecast4_minus_held_out_fixed_groups"]
        print(f"- ${t}: {d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
