"""What a newcomer's first commands cost: `lm --help` and a refused `train.py` answer before torch or Lightning
are imported (experiments/2026-11-24-startup measured the seconds that saves)."""

import subprocess
import sys

import pytest

from ..conftest import CONF

ROOT = CONF.parent
HEAVY = ("torch", "lightning", "transformers")

# Runs `lm <argv>` as the console script does and prints the heavy packages it imported.
LIST_IMPORTS = """
import sys, runpy
sys.argv = ["lm", *sys.argv[1:]]
try:
    runpy.run_module("lm.cli", run_name="__main__")
except SystemExit:
    pass
print(sorted({m.split(".")[0] for m in sys.modules} & set(%r)), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["export", "--help"], ["sky", "--help"]])
def test_lm_help_imports_no_torch(argv):
    result = subprocess.run(
        [sys.executable, "-c", LIST_IMPORTS % (HEAVY,), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "usage: lm" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr[-2000:]


@pytest.mark.parametrize(
    "override",
    ["model.n_layr=3", "trainer.max_steps=abc", "data.batch_size=0"],
    ids=["unknown key", "schema-invalid value", "refused by CheckBeforeRun"],
)
def test_a_refused_config_is_refused_before_lightning_is_imported(override, tmp_path):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", override, f"run.root={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 78, result.stderr[-2000:]
    imported = {
        line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line
    }
    assert not imported & {"lightning", "transformers"}
    assert not list(tmp_path.iterdir())  # and nothing written
