"""What a run prints: every log record once (Hydra's handler alone, no Lightning "INFO: ..." copy), and none of
the third-party noise nobody can act on (a FLOPs-0 model summary, torch's pytree deprecation, TensorBoard's
event reader at exit)."""

import collections
import re

import pytest

from tests import harness

from ..conftest import TINY

HYDRA_PREFIX = re.compile(r"^\[[\d\-: ,]+\]\[[\w.]+\]\[\w+\] - ")
LIGHTNING_PREFIX = re.compile(r"^(DEBUG|INFO|WARNING|ERROR): ")
NOISE = ("Total FLOPs", "LeafSpec", "No path found", "Directory watcher", "litlogger")


def messages(text: str) -> list[str]:
    """Each printed line without its logger's prefix, so the same record printed by two handlers compares equal."""
    lines = (LIGHTNING_PREFIX.sub("", HYDRA_PREFIX.sub("", line)).rstrip() for line in text.splitlines())
    return [line for line in lines if line.strip()]


@pytest.mark.slow  # 26-74 s on 2 cores: the README command stays under 10 min
def test_a_run_prints_each_line_once_and_no_noise(tmp_path, data_cache):
    args = [*TINY, f"data.cache_dir={data_cache}", f"run.root={tmp_path}", "trainer.val_every_steps=10"]
    for steps in (20, 30):  # a fresh run, then its resume (the restored-checkpoint lines)
        run = harness.run([*args, f"trainer.max_steps={steps}"], timeout=600)
        assert run.code == 0, run.tail()
        printed = run.stdout + run.stderr
        twice = {m: n for m, n in collections.Counter(messages(printed)).items() if n > 1}
        assert not twice, f"printed more than once: {twice}"
        assert not [line for line in printed.splitlines() if any(n in line for n in NOISE)]
        assert "GPU available" in printed and "model: " in printed and "non-embedding" in printed
    # Lightning's records reach the invocation's log file too (through the root handler).
    logs = sorted((tmp_path / "smoke" / "hydra").glob("*/*.log"))
    assert logs and "Restored all states" in logs[-1].read_text()
