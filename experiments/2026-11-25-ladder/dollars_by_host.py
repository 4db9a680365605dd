"""Measured dollars of QK-norm + Muon on each CPU that timed the ladder's runs (issue 63 item 6).

The report's measured dollars (ablation.md: 1.007x at s128, 0.988x at s80) multiply the tokens ratio by one
step-time ratio: `step_times.json`, every arm's steps interleaved in one process on the 2026-11-26 host, an
Intel Xeon with AVX512-BF16. The same results/ hold a second timing: every shorter run (0.5, 0.6, 0.8 of the
tokens) of both arms ran on an AMD EPYC (each record's `machine`), one arm at a time beside other work, so its
seconds per step are per run, not interleaved. This prints, per rung, each host's step-time ratio (the median
of QK-norm + Muon's runs over the median of the baseline's, the full runs at the best LR on the Xeon, the
shorter runs on the AMD machine) and the measured dollars it gives with the report's tokens ratio and interval.

    python experiments/2026-11-25-ladder/dollars_by_host.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARM, BASE = "qk_norm_muon", "baseline"


def main() -> None:
    report = json.loads((HERE / "ablation.json").read_text())
    rows = {(r["shape"], r["arm"]): r for r in report["rows"]}
    times: dict[tuple[str, str, str], list[float]] = {}
    hosts: dict[str, str] = {}
    for path in sorted((HERE / "results").glob("*.json")):
        record = json.loads(path.read_text())
        r = record["result"]
        row = rows.get((r["shape"], r["arm"]))
        if row is None or r["lr"] != row["lr"] or r["status"] != "done":
            continue  # the LR search's other values: not the compared runs
        host = record["machine"].split(",")[0]
        hosts[host] = record["machine"]
        kind = "full" if r["fraction"] == 1.0 else "shorter"
        times.setdefault((r["shape"], r["arm"], f"{host} ({kind} runs)"), []).append(r["seconds_per_step"])
    print("hosts: " + "; ".join(hosts.values()) + "\n")
    print(
        "| rung | host | runs (Muon / baseline) | s/step x (medians) | tokens x [95%] | measured $ x [95%] |"
    )
    print("|---|---|---|---|---|---|")
    for shape in ("s48", "s80", "s128"):
        tokens = rows[(shape, ARM)]["tokens"]["interval"]
        interleaved = rows[(shape, ARM)]["step_time_ratio"]
        cells = [("Xeon, interleaved (step_times.json: the report's)", "-", interleaved)]
        for (s, arm, host), values in sorted(times.items()):
            if s == shape and arm == ARM and (s, BASE, host) in times:
                base = times[(s, BASE, host)]
                ratio = statistics.median(values) / statistics.median(base)
                cells.append((host, f"{len(values)} / {len(base)}", ratio))
        for host, runs, ratio in cells:
            t = f"{tokens['mean']:.3f} [{tokens['low']:.3f}, {tokens['high']:.3f}]"
            usd = f"{tokens['mean'] * ratio:.3f} [{tokens['low'] * ratio:.3f}, {tokens['high'] * ratio:.3f}]"
            print(f"| {shape} | {host} | {runs} | {ratio:.3f} | {t} | {usd} |")


if __name__ == "__main__":
    main()
