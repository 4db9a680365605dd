"""`lm selftest` on this CPU: the CPU subset passes, what it cannot check is listed, a failure is a row and exit 1."""

import subprocess
import sys

import pytest
import torch

from lm.tools.selftest import SelfTest, max_difference, table

from ..conftest import CONF, TINY

ROOT = CONF.parent


@pytest.mark.slow  # three tiny runs, an export and a bench row: ~2-3 minutes on 2 cores
def test_selftest_passes_the_cpu_subset_and_lists_what_it_could_not_check(data_cache):
    cmd = [sys.executable, "-m", "lm.cli", "selftest", *TINY, f"data.cache_dir={data_cache}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if line[:1].isalpha()}
    for check in ("device", "train", "sample", "eval", "export", "sigterm", "resume"):
        assert rows.get(check) == "PASS", (check, done.stdout)
    assert rows["ddp"] == rows["speed"] == "SKIP"  # one CPU: no all-reduce, no catalogued peak for MFU
    assert "7 passed, 0 failed, not checked here: ddp, speed" in done.stdout


def test_a_check_that_breaks_is_a_failed_row_with_its_message(tmp_path):
    test = SelfTest(["trainer=cpu"], tmp_path)

    def broken():
        raise OSError("disk gone")

    assert not test.check("train", broken)
    assert test.checks[-1].status == "fail" and "OSError: disk gone" in test.checks[-1].saw
    assert test.check("device", test.device)
    assert "FAIL" in table(test.checks) and "PASS" in table(test.checks)


def test_checkpoint_difference_is_zero_only_for_bitwise_equal_state():
    a = {
        "state_dict": {"w": torch.ones(3)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3)}}}],
    }
    b = {
        "state_dict": {"w": torch.ones(3)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3)}}}],
    }
    assert max_difference(a, b) == 0.0
    b["optimizer_states"][0]["state"][0]["exp_avg"][1] = 1e-7
    assert max_difference(a, b) == pytest.approx(1e-7)
    b["state_dict"]["w"][0] = float("nan")
    assert max_difference(a, b) == float("inf")
