"""Run the whole fault matrix (fast and `faults_slow` cases) and print it as a Markdown table.

    python tests/run_matrix.py [pytest args, e.g. -k sigint] > matrix.md      (or: just faults)

Each case of tests/test_faults.py appends its row (exit code, seconds to exit, resumed, bitwise equal) to a
JSON-lines log; pytest's JUnit XML says whether the case passed and, if not, the first line of what failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(extra: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        log, junit = Path(tmp) / "rows.jsonl", Path(tmp) / "junit.xml"
        cmd = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_faults.py", "tests/test_faults_end.py",
            "-m", "faults_slow or not faults_slow", f"--junitxml={junit}", *extra,
        ]  # fmt: skip
        started = time.monotonic()
        env = {**os.environ, "FAULT_MATRIX_LOG": str(log)}
        # pytest's own report goes to stderr: stdout is the table alone.
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stderr, check=False)
        minutes = (time.monotonic() - started) / 60
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        print(table(rows, results(junit)))
        print(f"\n{len(rows)} cases in {minutes:.1f} min; pytest exit {done.returncode}")
    return done.returncode


def results(junit: Path) -> dict[str, tuple[str, str]]:
    """{test name as in its node id: (passed | failed | skipped, first line of the reason)}."""
    found = {}
    if not junit.exists():
        return found
    for case in ET.parse(junit).getroot().iter("testcase"):
        status, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = "skipped" if tag == "skipped" else "failed"
                why = (node.get("message") or node.text or "").strip().splitlines()[0][:160]
        found[case.get("name")] = (status, why)
    return found


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def table(rows: list[dict], outcomes: dict[str, tuple[str, str]]) -> str:
    lines = [
        "| case | expected | exit code | seconds to exit | last saved step | resumed | bitwise equal | result "
        "| what failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        status, why = outcomes.get(row["test"].split("::")[-1], ("?", ""))
        cells = [row["case"], row["expected"], row["code"], row["exit_s"], row.get("saved")]
        cells += [row["resumed"], row["equal"]]
        why = why.replace("|", "\\|")
        lines.append("| " + " | ".join([*map(cell, cells), status, why]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
