"""Rebuild the committed ablation reports from their committed result records, without training (issue 48).

    python experiments/2026-11-25-ladder/regenerate.py          # all three studies, into their folders

For each study: the result records are copied to a scratch `--out` folder (the Muon NS study kept no results/
folder, so its records are first written from its ablation.json's runs, and kept in loss/results/), the step
times the study measured are restored as ratios to the baseline (so the report does not measure them again on
this machine), `lm ablate SPEC --report-only` rewrites the report, and the report's files are copied back.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from lm.store import rundir
from lm.tools.ablate import ablate, load_spec
from lm.tools.ablate.runner import result_file, run_config
from lm.tools.ablate.spec import make_job

HERE = Path(__file__).resolve().parent.parent
STUDIES = [  # (spec, the folder of its report, its results/ folder)
    (HERE / "2026-11-25-ladder/ladder.yaml", HERE / "2026-11-25-ladder", HERE / "2026-11-25-ladder/results"),
    (HERE / "2026-11-27-levers/levers.yaml", HERE / "2026-11-27-levers", HERE / "2026-11-27-levers/results"),
    (HERE / "2026-11-25-muon-ns/loss.yaml", HERE / "2026-11-25-muon-ns/loss", HERE / "2026-11-25-muon-ns/loss/results"),
]  # fmt: skip
REPORT = ["ablation.md", "ablation.csv", "ablation.json", "ablation.png", "lr.png", "ladder.png"]


def records_from_report(spec_path: Path, report: dict, results: Path) -> None:
    """Result records (as `lm ablate` writes them) from a report's runs, for a study that kept none."""
    spec = load_spec(spec_path)
    for run in report["runs"]:
        steps = run["steps"][-1]
        job = make_job(
            spec, results.parent, run["shape"], [], run["arm"], run["seed"], run["lr"], run["fraction"], steps
        )
        assert job.name == run["job"], (job.name, run["job"])
        record = {"config": run_config(job), "steps": job.steps, "machine": "see README.md", "result": run}
        rundir.write_record(result_file(results.parent, job), record)


def regenerate(spec_path: Path, folder: Path, results: Path) -> None:
    report = json.loads((folder / "ablation.json").read_text())
    if not results.is_dir():
        records_from_report(spec_path, report, results)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        shutil.copytree(results, out / "results")
        times: dict[str, dict[str, float]] = {}
        for row in report["rows"]:
            if row["step_time_ratio"] is not None:
                times.setdefault(row["shape"], {})[row["arm"]] = row["step_time_ratio"]
        for shape, ratios in times.items():
            rundir.write_record((out / "runs" / shape if shape else out) / "step_times.json", ratios)
        assert ablate(spec_path, out, report_only=True) == 0
        for name in REPORT:
            if (out / name).exists():
                shutil.copyfile(out / name, folder / name)


if __name__ == "__main__":
    for study in STUDIES:
        regenerate(*study)
