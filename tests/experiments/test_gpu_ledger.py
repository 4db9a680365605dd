"""The GPU ledger's scheduler (experiments/gpu/ledger.py) on CPU stand-ins: priority order, time boxes, items
that do not fit, a record after each item that survives a kill, the README's table, and the real ledger's
done items carrying their device, torch and date. Items here are shell one-liners; each runs under its box,
and the one scheduler process a test starts is killed in a `finally`."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..helpers import load_script

GPU = Path(__file__).resolve().parents[2] / "experiments" / "gpu"


@pytest.fixture(scope="module")
def ledger():
    return load_script(GPU / "ledger.py", "gpu_ledger")


def item(id_: str, priority: int, command: str, box: float = 5.0, status: str = "pending") -> dict:
    return {"id": id_, "priority": priority, "title": id_, "status": status, "box_s": box, "command": command}


def result(summary: str) -> str:
    return f"echo 'LEDGER_RESULT {json.dumps({'summary': summary})}'"


def write(path: Path, items: list[dict]) -> Path:
    path.write_text(json.dumps({"standin": False, "items": items}))
    (path.parent / "README.md").write_text(
        "# ledger\n\nprose kept\n\n<!-- ledger:begin -->\n<!-- ledger:end -->\n"
    )
    return path


def schedule(ledger, path: Path, seconds: float, **kw) -> dict:
    kw = {"margin": 0.0, "grace": 0.5, "dry_run": True, "say": lambda *a: None, **kw}
    return {i["id"]: i for i in ledger.schedule(path, seconds, **kw)["items"]}


def test_items_run_in_priority_order_and_each_result_is_recorded(ledger, tmp_path):
    order = tmp_path / "order"
    path = write(
        tmp_path / "ledger.json",
        [item(x, p, f"echo {x} >> {order}; {result('ran ' + x)}") for x, p in (("c", 3), ("a", 1), ("b", 2))],
    )
    items = schedule(ledger, path, 30)
    assert order.read_text().split() == ["a", "b", "c"]
    on_disk = {i["id"]: i for i in json.loads(path.read_text())["items"]}
    for x in "abc":
        assert items[x]["status"] == on_disk[x]["status"] == "done"
        last = on_disk[x]["last"]
        assert last["summary"] == f"ran {x}" and last["date"] and last["device"] and last["standin"]
        log = Path(ledger.REPO / last["log"]).read_text().splitlines()
        assert log[0].startswith(f"$ echo {x}") and log[-1] == f'LEDGER_RESULT {{"summary": "ran {x}"}}'


def test_an_item_past_its_box_is_killed_with_its_children_and_recorded_timeout(ledger, tmp_path):
    pid = tmp_path / "pid"
    hang = f"sleep 30 & echo $! > {pid}; wait"  # a grandchild, as a training run's DataLoader workers are
    path = write(tmp_path / "ledger.json", [item("a", 1, hang, box=1.0), item("b", 2, result("after"))])
    started = time.monotonic()
    items = schedule(ledger, path, 30)
    assert time.monotonic() - started < 10
    assert items["a"]["status"] == "timeout" and "killed at its 1.0 s box" in items["a"]["last"]["summary"]
    assert items["b"]["status"] == "done"  # the next item still runs
    deadline = time.monotonic() + 5  # SIGKILL is sent; its delivery may take a moment on a loaded machine
    while alive(int(pid.read_text())):
        assert time.monotonic() < deadline, "the item's child outlived the item"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running (a zombie that no one has reaped yet is not: a container's init may reap late)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_failing_item_is_recorded_failed(ledger, tmp_path):
    failed = f"echo 'LEDGER_RESULT {json.dumps({'summary': 'crashed', 'status': 'failed'})}'"
    path = write(
        tmp_path / "ledger.json",
        [item("a", 1, "echo boom; exit 3"), item("b", 2, failed), item("c", 3, "echo no result line")],
    )
    items = schedule(ledger, path, 30)
    assert items["a"]["status"] == "failed" and items["a"]["last"]["exit"] == 3
    assert "boom" in items["a"]["last"]["summary"]
    assert items["b"]["status"] == "failed" and items["b"]["last"]["summary"] == "crashed"
    assert items["c"]["status"] == "failed"


def test_an_item_whose_box_does_not_fit_is_skipped_and_stays_pending(ledger, tmp_path):
    path = write(
        tmp_path / "ledger.json",
        [
            item("a", 1, result("a"), box=1.0),
            item("big", 2, result("never"), box=60.0),
            item("small", 3, result("small"), box=1.0),
            item("old", 4, result("never"), status="done"),
        ],
    )
    items = schedule(ledger, path, 4.0)
    assert items["big"]["status"] == "pending" and items["big"]["last"]["date"] is None
    assert items["a"]["status"] == items["small"]["status"] == "done"  # a later item that fits still runs
    assert items["old"]["last"]["date"] is None  # done items are not run again


def test_results_written_before_a_kill_survive_it_and_the_running_item_stays_pending(tmp_path):
    pid, mirror = tmp_path / "pid", tmp_path / "out"
    path = write(
        tmp_path / "ledger.json",
        [item("a", 1, result("first")), item("b", 2, f"echo $$ > {pid}; exec sleep 30", box=40)],
    )
    cmd = [sys.executable, str(GPU / "ledger.py"), "run", "60", "--ledger", str(path), "--margin", "0"]
    proc = subprocess.Popen(
        [*cmd, "--mirror", str(mirror)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 20
        while not pid.exists() or not pid.read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, "item b never started"
            time.sleep(0.05)
        proc.kill()  # SIGKILL: no handler runs, nothing is written after this
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if pid.exists() and pid.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid.read_text()), signal.SIGKILL)
    for where in (path, mirror / "ledger.json"):
        items = {i["id"]: i for i in json.loads(where.read_text())["items"]}
        assert items["a"]["status"] == "done" and items["a"]["last"]["summary"] == "first"
        assert items["b"]["status"] == "pending" and items["b"]["last"]["date"] is None
    assert (mirror / "logs.tgz").exists() and "first" in (mirror / "README.md").read_text()


def test_the_readme_table_is_regenerated_and_the_prose_kept(ledger, tmp_path):
    path = write(tmp_path / "ledger.json", [item("a", 1, result("a | b")), item("z", 2, result("z"), box=99)])
    schedule(ledger, path, 10)
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# ledger\n\nprose kept\n")
    rows = [line for line in readme.splitlines() if line.startswith("| **")]
    assert len(rows) == 2 and "| done |" in rows[0] and "a \\| b" in rows[0] and "| pending |" in rows[1]
    assert "STAND-IN" not in readme  # the ledger file says standin: false


def test_the_dry_run_writes_a_separate_ledger_marked_stand_in(ledger, tmp_path):
    real = ledger.LEDGER.read_bytes()
    out = tmp_path / "dry" / "ledger.json"
    assert (
        ledger.main(["run", "4", "--dry-run", "--ledger", str(out), "--scale", "0.002", "--overrun", "b"])
        == 0
    )
    assert ledger.LEDGER.read_bytes() == real
    dry = json.loads(out.read_text())
    items = {i["id"]: i for i in dry["items"]}
    assert dry["standin"] and items["b"]["status"] == "timeout"
    assert all(i["last"]["standin"] for i in items.values() if i["status"] != "pending")
    assert "STAND-IN LEDGER" in (out.parent / "README.md").read_text()
    with pytest.raises(SystemExit):
        ledger.dry_run_path(ledger.LEDGER)


def test_the_real_ledger_is_well_formed_and_no_done_item_lacks_device_torch_or_date(ledger):
    data = ledger.load(ledger.LEDGER)
    assert not data.get("standin")
    items = data["items"]
    ids, priorities = [i["id"] for i in items], [i["priority"] for i in items]
    assert (
        set("abcdefgh") <= set(ids) and len(set(ids)) == len(ids) and len(set(priorities)) == len(priorities)
    )
    for it in items:
        script = it["command"].split()[1]
        assert (ledger.REPO / script).is_file(), script
        if it["status"] != "pending":
            last = it["last"]
            assert last["device"] and last["torch"] and last["date"], it["id"]
            assert not last.get("standin") and "stand-in" not in last["device"], it["id"]
    # the README's table is the one the ledger renders
    readme = (GPU / "README.md").read_text()
    assert ledger.table(data, GPU) in readme


def test_the_real_ledger_refuses_a_run_without_a_gpu(ledger, monkeypatch):
    real = ledger.LEDGER.read_bytes()
    monkeypatch.setattr(ledger, "probe", lambda dry_run: {"device": None, "driver": None, "torch": None})
    with pytest.raises(SystemExit, match="GPU results only"):
        ledger.schedule(ledger.LEDGER, 600, say=lambda *a: None)
    assert ledger.LEDGER.read_bytes() == real


def test_the_exact_resume_verdict_passes_an_exchangeable_resume_and_fails_a_far_one(monkeypatch):
    """Item a's rule: with non-deterministic kernels an exact resume is one more draw of the same spread, so the
    verdict needs a margin (2026-11-28's H200 numbers, 0.99x and 1.03x the straight pair's distance, were called
    a resume bug by the old 'no farther' rule); straight runs that agree bitwise leave no margin."""
    monkeypatch.syspath_prepend(str(GPU / "items"))
    monkeypatch.setattr(sys, "argv", ["a_exact_resume.py", "8", "3"])
    item_a = load_script(GPU / "items" / "a_exact_resume.py", "gpu_item_a")
    seen = {"resumed_vs_straight": [0.023782, 0.024610], "straight_vs_straight": 0.023975}
    assert item_a.verdict(seen) == "within spread"
    assert item_a.verdict({"resumed_vs_straight": [0.0, 0.0], "straight_vs_straight": 0.0}) == "bitwise"
    assert item_a.verdict({"resumed_vs_straight": [1e-6, 1e-6], "straight_vs_straight": 0.0}) == "resume bug"
    assert (
        item_a.verdict({"resumed_vs_straight": [0.08, 0.09], "straight_vs_straight": 0.024}) == "resume bug"
    )
    assert item_a.verdict({"resumed_vs_straight": [0.03, 0.05], "straight_vs_straight": 0.024}) == "undecided"
