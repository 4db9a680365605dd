"""Resume stays exact on a busy machine: with every core taken by a CPU hog, the same run twice ends bitwise
equal, and runs cut by SIGTERM at steps 10 and 19 (where the smoke run was once cut and, at load 11-17, resumed
to different weights) and rerun end bitwise equal to them.

Whatever in a run depends on timing (the throughput baseline and alarm, the cost meter, DataLoader workers'
prefetch, thread counts) must not reach the weights; a loaded machine is where that shows. The runs keep what
the smoke run has that the every-step test trims (two workers, the default throughput alarm, milestone
samples, validation) on the test corpus. experiments/2026-11-26-resume-under-load has the measurements.
"""

import os
import subprocess
import sys

import pytest

from lm.base.exits import EXIT_PREEMPTED

from ..conftest import TINY
from ..harness import assert_matches_reference, fault, last, run

STEPS = 24  # past both cuts, a validation (step 20) and a milestone sample (15); 40 took 4.3 min in CI
CUTS = (10, 19)


@pytest.fixture(scope="module")
def hog():
    """One busy process per core for the module's runs (each bounded: killed at the end, waited with a limit)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield len(busy)
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=30)


@pytest.mark.slow
def test_straight_and_cut_runs_agree_bitwise_under_a_cpu_hog(root, data_cache, hog):
    base = [
        *TINY, f"run.root={root}", f"data.cache_dir={data_cache}", f"trainer.max_steps={STEPS}",
        "optim.total_steps=300",  # the smoke run's schedule, ended early: every run here stops at STEPS
        "trainer.val_every_steps=20", "trainer.limit_val_batches=2", "sampling.steps=[15]",
    ]  # fmt: skip
    for name in ("straight-a", "straight-b"):
        outcome = run([*base, f"run.name={name}"])
        assert outcome.code == 0, outcome.tail()
    reference = last(root, "straight-a")
    assert_matches_reference(root, "straight-b", reference, steps=STEPS)
    for step in CUTS:
        name = f"sigterm-{step}"
        (root / name).mkdir()
        cmd = [*base, f"run.name={name}", *fault(root / name, "sigterm", step=step)]
        first = run(cmd)
        assert first.code == EXIT_PREEMPTED, first.tail()
        assert last(root, name)["global_step"] == step + 1
        again = run(cmd)
        assert again.code == 0, again.tail()
        assert_matches_reference(root, name, reference, steps=STEPS)
