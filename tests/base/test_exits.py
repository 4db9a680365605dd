"""What an `lm` verb and a run exit with: a refusal is 78 in every verb, an outage never is."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lm import cli
from lm.base.exits import (
    EXIT_CONFIG,
    EXIT_SAVE_FAILED,
    EXIT_UNAVAILABLE,
    DiskFull,
    Refused,
    exit_code,
    outage,
    verb_exit_code,
)


class LocalEntryNotFoundError(FileNotFoundError):
    """huggingface_hub's name and base: the file is not cached and the Hub could not be asked."""


# httpx's shape: ConnectError is a NetworkError, matched by its base's name.
NetworkError = type("NetworkError", (Exception,), {})
ConnectError = type("ConnectError", (NetworkError,), {})


def chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (Refused("data.batch_size=0 must be >= 1"), EXIT_CONFIG),
        (FileNotFoundError("runs/nope is not a run directory"), EXIT_CONFIG),
        (ImportError("lm export needs transformers: pip install 'lm[export]'"), EXIT_CONFIG),
        (ModuleNotFoundError("No module named 'lm_eval'"), EXIT_CONFIG),
        (LocalEntryNotFoundError("cannot reach the Hub, not in the cache"), EXIT_UNAVAILABLE),
        (chained(Refused("model.init_from=x is neither a folder nor a Hub model"), ConnectError()), EXIT_UNAVAILABLE),
        (DiskFull(28, "No space left on device"), EXIT_SAVE_FAILED),
        (ValueError("a library's ValueError"), None),
        (ConnectionError("reset by peer"), None),  # a crash in a verb: retried, with its traceback
    ],
    ids=["refused", "missing input", "missing extra", "missing module", "hub outage", "refusal of an outage",
         "disk full", "value error", "connection error"],
)  # fmt: skip
def test_a_verbs_exit_code_is_typed_by_what_should_happen_next(error, code):
    assert verb_exit_code(error) == code


def test_an_outage_is_found_anywhere_in_the_chain_and_only_there():
    assert outage(chained(RuntimeError("wrapped"), TimeoutError())) is not None
    assert outage(ValueError("no")) is None
    import multiprocessing as mp  # its TimeoutError is a poll's, not the network's

    assert outage(mp.TimeoutError()) is None
    # A refusal that an outage caused is not a refusal; one raised on its own is.
    assert exit_code(chained(Refused("x"), ConnectionError())) == EXIT_UNAVAILABLE
    assert exit_code(Refused("x")) == EXIT_CONFIG


def test_a_verb_refusal_prints_one_line_and_exits_78(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["report", str(tmp_path / "nope")])
    assert e.value.code == EXIT_CONFIG and str(e.value).startswith("lm report: ")
    assert capsys.readouterr().err.strip() == str(e.value)


def test_lm_prepare_refuses_a_zero_batch_with_78():
    """Issue 54: `lm prepare data.batch_size=0` exited 1, the crash code, so a wrapper retried a refusal."""
    done = subprocess.run(
        [sys.executable, "-m", "lm.cli", "prepare", "data.batch_size=0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("lm prepare: ") and "batch_size" in done.stderr
