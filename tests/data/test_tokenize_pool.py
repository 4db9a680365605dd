"""`lm prepare`'s worker pool never leaves a wait behind: not on a lock a killed worker held, not on workers a
stop signal met while the pool was forking them (issue 54: the two windows d1e0532 left)."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.pool
import threading
import time

import pytest

from lm.base.exits import Interrupted
from lm.config import DataConfig
from lm.data import tokenize_pool


def test_a_counter_lock_a_dead_worker_holds_is_waited_for_a_second_at_most(monkeypatch):
    counters = (mp.Value("q", 0), mp.Value("q", 0))
    monkeypatch.setitem(tokenize_pool._worker, "counters", counters)
    tokenize_pool.counters_add(10, 2)
    holder = threading.Thread(target=counters[0].get_lock().acquire)  # as a worker killed inside counters_add
    holder.start()
    holder.join()
    t0 = time.monotonic()
    tokenize_pool.counters_add(5, 1)  # undercounts rather than waits
    assert time.monotonic() - t0 < tokenize_pool.COUNTER_LOCK_S + 1.0
    assert (tokenize_pool.counted(counters[0]), tokenize_pool.counted(counters[1])) == (
        10,
        2,
    )  # read unlocked


def test_a_stop_signal_while_the_pool_forks_leaves_no_worker(monkeypatch, tmp_path):
    started = multiprocessing.pool.Pool._repopulate_pool

    def interrupted(pool):
        started(pool)  # the workers exist, some still starting
        raise Interrupted("SIGTERM")

    monkeypatch.setattr(multiprocessing.pool.Pool, "_repopulate_pool", interrupted)
    monkeypatch.setattr(tokenize_pool, "_init_pool_worker", lambda *args: time.sleep(30))  # still starting
    before = {c.pid for c in mp.active_children()}
    cfg = DataConfig(num_proc=2)
    with pytest.raises(Interrupted):
        list(tokenize_pool.run_units(cfg, [object(), object()], "{}", tmp_path, {}, 0))
    deadline = time.monotonic() + 10
    while (left := [c for c in mp.active_children() if c.pid not in before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"workers left running: {left}"
