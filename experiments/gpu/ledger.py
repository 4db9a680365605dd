"""The GPU ledger's scheduler: run the pending items of `ledger.json` in priority order, each under its own time
box, and record each result the moment it finishes; exit before the window's seconds are spent.

    python3 experiments/gpu/ledger.py run SECONDS [--mirror DIR]     # on a GPU: what run.sh calls
    python3 experiments/gpu/ledger.py run SECONDS --dry-run           # on a CPU: stand-ins, a separate ledger
    python3 experiments/gpu/ledger.py render                          # README.md's table from ledger.json
    python3 experiments/gpu/ledger.py adopt FILES_AT                  # bring a device call's files home
    python3 experiments/gpu/ledger.py reset ID                        # make a failed/timed-out item pending

An item is a shell command run from the repository root in a process group of its own. It prints one line
`LEDGER_RESULT {json}` (the last one counts) with at least `summary`; `status` may say `failed`. An item
still running at the end of its box gets SIGTERM, then SIGKILL after `--grace`, and is recorded `timeout`
(with whatever result line it printed). An item whose box (plus the grace) does not fit in the seconds left
is not started and stays pending: the next window runs it first. Only `pending` items run; a failed or
timed-out one waits for a person to look at its log and `reset` it.

Each result is written into the ledger atomically (temporary file, fsync, rename) as soon as its item ends,
and README.md's table is regenerated, so a kill of this process loses at most the item then running, which
stays pending. No import beyond the standard library: it runs under any python3, the device's included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LEDGER = HERE / "ledger.json"
STATUSES = ("pending", "done", "failed", "timeout")
RESULT_MARK = "LEDGER_RESULT "
BEGIN, END = "<!-- ledger:begin -->", "<!-- ledger:end -->"
STANDIN_DEVICE = "cpu (stand-in, not a GPU number)"
EMPTY_LAST = {
    "summary": None,
    "result": None,
    "date": None,
    "device": None,
    "driver": None,
    "torch": None,
    "wall_s": None,
    "exit": None,
    "log": None,
}


class Stopped(Exception):
    """SIGTERM or SIGINT reached the scheduler: the running item is ended and stays pending."""


# -- the ledger file -----------------------------------------------------------------------------------------


def load(path: Path) -> dict:
    ledger = json.loads(path.read_text())
    for item in ledger["items"]:
        if item["status"] not in STATUSES:
            raise ValueError(f"{path}: item {item['id']} has status {item['status']!r}; one of {STATUSES}")
        item.setdefault("last", dict(EMPTY_LAST))
    return ledger


def write_atomic(path: Path, text: str) -> None:
    """`path` holds either its old or its new text, whatever kills this process when."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself on disk (not every filesystem allows it)
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


def save(ledger: dict, path: Path) -> None:
    write_atomic(path, json.dumps(ledger, indent=1) + "\n")
    render(ledger, path.parent / "README.md")


# -- the README table ----------------------------------------------------------------------------------------


def cell(value) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def table(ledger: dict, base: Path = HERE) -> str:
    """The items as a Markdown table; log links relative to `base` (the README's folder)."""
    rows = [
        "| item | status | box s | last result | date | device | torch | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for it in sorted(ledger["items"], key=lambda i: i["priority"]):
        last = it.get("last") or EMPTY_LAST
        result = cell(last.get("summary")) or "-"
        if last.get("log"):
            result += f" ([log]({cell(os.path.relpath(REPO / last['log'], base))}))"
        rows.append(
            f"| **{it['id']}** {cell(it['title'])} | {it['status']} | {it['box_s']} | {result} "
            f"| {cell(last.get('date'))} | {cell(last.get('device'))} | {cell(last.get('torch'))} "
            f"| `{cell(it['command'])}` |"
        )
    banner = "**STAND-IN LEDGER: a CPU dry run of the scheduler; no number here is a GPU measurement.**\n\n"
    return (banner if ledger.get("standin") else "") + "\n".join(rows)


def render(ledger: dict, readme: Path) -> None:
    """Replace the table between the markers of `readme` (a new file holds only the table)."""
    generated = f"{BEGIN}\n<!-- generated by ledger.py from ledger.json: edit that, not this table -->\n"
    generated += table(ledger, readme.parent) + f"\n{END}"
    text = readme.read_text() if readme.exists() else f"# GPU ledger\n\n{BEGIN}\n{END}\n"
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"{readme} has no {BEGIN} ... {END} markers for the table")
    write_atomic(readme, head + generated + tail)


# -- running one item ----------------------------------------------------------------------------------------


def probe(dry_run: bool) -> dict:
    """The device, driver and torch the items run on, read once per window."""
    if dry_run:
        return {"device": STANDIN_DEVICE, "driver": None, "torch": None}
    found = {"device": None, "driver": None, "torch": None}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        if out:
            name, _, driver = out.splitlines()[0].rpartition(",")
            found["device"], found["driver"] = name.strip(), driver.strip()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        code = "import torch; print(torch.__version__, torch.version.cuda)"
        out = subprocess.run(["python3", "-c", code], capture_output=True, text=True, timeout=120).stdout
        if out.strip():
            version, cuda = out.split()
            found["torch"] = f"{version} (CUDA {cuda})"
    return found


def parse_result(log: Path) -> dict | None:
    """The last `LEDGER_RESULT {json}` line of an item's log."""
    found = None
    with open(log, errors="replace") as f:
        for line in f:
            if line.startswith(RESULT_MARK):
                with contextlib.suppress(json.JSONDecodeError):
                    found = json.loads(line[len(RESULT_MARK) :])
    return found if isinstance(found, dict) else None


def end_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the item's whole process group (its training runs, their DataLoader workers), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_item(item: dict, log: Path, grace: float, env: dict[str, str]) -> tuple[str, int | None, dict | None]:
    """(status, exit code, result line) of one item run under its box."""
    box = float(item["box_s"])
    log.parent.mkdir(parents=True, exist_ok=True)
    item_env = {
        **os.environ,
        **env,
        "LEDGER_ITEM": item["id"],
        "LEDGER_BOX_S": str(box),
        "LEDGER_DEADLINE": str(time.time() + box),  # items budget their parts against it
        "PYTHONUNBUFFERED": "1",
    }
    with open(log, "w") as f:
        f.write(f"$ {item['command']}\n# box {box:g} s, started {now_iso()}\n")
        f.flush()
        proc = subprocess.Popen(
            ["bash", "-c", item["command"]],
            cwd=REPO,
            env=item_env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=box)
        status = "done"
    except subprocess.TimeoutExpired:
        code, status = None, "timeout"
    finally:
        end_group(proc, grace)  # also the workers an item that exited left behind
    result = parse_result(log)
    if status == "timeout":
        return status, code, result
    if code != 0 or result is None:
        return "failed", code, result
    return ("failed" if result.get("status") == "failed" else "done"), code, result


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def shown(path: Path) -> str:
    """A path relative to the repository where it lies inside it (the ledger travels with the repo)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def record(item: dict, status: str, code: int | None, result: dict | None, wall: float, log: Path, env: dict):
    previous = item.get("last") or {}
    if previous.get("date"):
        item.setdefault("history", []).append({"status": item["status"], **previous})
    result = dict(result or {})
    summary = result.pop("summary", None)
    if summary is None:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        summary = f"exit {code}, no result line; log ends: {tail[0][:160] if tail else '(empty)'}"
    if status == "timeout":
        summary = f"killed at its {item['box_s']} s box; " + summary
    # What the item saw (torch's device name and version) over what the scheduler probed; never on a stand-in.
    seen = {k: result.pop(k, None) for k in ("device", "driver", "torch")}
    if env["device"] == STANDIN_DEVICE:
        seen = {}
    item["status"] = status
    item["last"] = {
        "summary": summary,
        "result": result,
        "date": now_iso(),
        **{k: seen.get(k) or env[k] for k in ("device", "driver", "torch")},
        "wall_s": round(wall, 1),
        "exit": code,
        "log": shown(log),
    }
    if env["device"] == STANDIN_DEVICE:
        item["last"]["standin"] = True


def mirror(path: Path, out: Path) -> None:
    """Copy the ledger, its README and a tarball of its logs to `out` (the device call's $OUT): what a call
    brings back, also when the call itself is cut off."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("ledger.json", "README.md"):
        if (path.parent / name).exists():
            write_atomic(out / name, (path.parent / name).read_text())
    logs = path.parent / "logs"
    if logs.is_dir():
        fd, tmp = tempfile.mkstemp(prefix=".logs.tgz.", dir=out)
        os.close(fd)
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(logs, arcname="logs")
        os.replace(tmp, out / "logs.tgz")


def schedule(
    path: Path,
    seconds: float,
    *,
    margin: float = 20.0,
    grace: float = 10.0,
    mirror_to: Path | None = None,
    dry_run: bool = False,
    only: list[str] | None = None,
    say=print,
) -> dict:
    """Run `path`'s pending items within `seconds` from now; returns the ledger as last written."""
    deadline = time.monotonic() + seconds - margin
    ledger = load(path)
    env = probe(dry_run)
    say(f"ledger {path}: {env['device']}, driver {env['driver']}, torch {env['torch']}")
    if env["device"] is None and path.resolve() == LEDGER.resolve():
        raise SystemExit(
            "no GPU here (nvidia-smi found none): the real ledger records GPU results only; --dry-run"
        )
    items = sorted(ledger["items"], key=lambda i: i["priority"])
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    render(ledger, path.parent / "README.md")  # also when no item fits: the table shows what waits
    if mirror_to:
        mirror(path, mirror_to)

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for item in items:
            if item["status"] != "pending" or (only and item["id"] not in only):
                continue
            left = deadline - time.monotonic()
            if item["box_s"] + grace > left:
                say(
                    f"skip {item['id']}: its box {item['box_s']} s (+{grace:g} s) does not fit {left:.0f} s left"
                )
                continue
            log = path.parent / "logs" / f"{item['id']}-{stamp}.log"
            say(f"run  {item['id']} (box {item['box_s']} s, {left:.0f} s left): {item['command']}")
            started = time.monotonic()
            status, code, result = run_item(item, log, grace, {"LEDGER_WORK": str(work_dir(item))})
            record(item, status, code, result, time.monotonic() - started, log, env)
            save(ledger, path)
            if mirror_to:
                mirror(path, mirror_to)
            say(f"     {item['id']} {status} in {item['last']['wall_s']} s: {item['last']['summary']}")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return ledger


def work_dir(item: dict) -> Path:
    """Scratch space for an item's runs (checkpoints of 1b are 12.7 GB: never inside the repository)."""
    return (
        Path(os.environ.get("LEDGER_SCRATCH") or Path(tempfile.gettempdir()) / "lm-gpu-ledger") / item["id"]
    )


# -- the dry run ----------------------------------------------------------------------------------------------


def standin_ledger(real: dict, scale: float, overrun: list[str]) -> dict:
    """The real items, boxes scaled by `scale`, each command replaced by a CPU stand-in that sleeps a third of
    its box (ten boxes for the `overrun` ones, so they are killed and recorded `timeout`)."""
    items = []
    for it in real["items"]:
        box = max(0.5, round(it["box_s"] * scale, 2))
        sleep = box * (10 if it["id"] in overrun else 0.3)
        script = shlex.quote(str(HERE / "items" / "standin.py"))
        items.append(
            {
                **{k: it[k] for k in ("id", "priority", "title")},
                "status": "pending",
                "box_s": box,
                "command": f"{shlex.quote(sys.executable)} {script} {it['id']} --sleep {sleep:.2f}",
                "last": dict(EMPTY_LAST),
            }
        )
    return {"about": "STAND-IN: a CPU dry run of experiments/gpu/ledger.py", "standin": True, "items": items}


def dry_run_path(path: Path | None) -> Path:
    path = path or Path(tempfile.gettempdir()) / "lm-gpu-ledger-dry-run" / "ledger.json"
    if path.resolve() == LEDGER.resolve() or path.resolve().parent == HERE:
        raise SystemExit(f"--dry-run never writes into {HERE}: give --ledger a path elsewhere")
    return path


# -- bringing a device call's files home ---------------------------------------------------------------------


def adopt(files_at: Path, path: Path = LEDGER) -> None:
    """Copy ledger.json from a device call's returned files over the real one (refusing a stand-in), its
    README, and unpack logs.tgz into experiments/gpu/logs/."""
    came = json.loads((files_at / "ledger.json").read_text())
    if came.get("standin"):
        raise SystemExit(f"{files_at}/ledger.json is a stand-in ledger: not adopted")
    write_atomic(path, json.dumps(came, indent=1) + "\n")
    render(came, path.parent / "README.md")
    if (files_at / "logs.tgz").exists():
        with tarfile.open(files_at / "logs.tgz") as tar:
            tar.extractall(path.parent, filter="data")
    print(f"adopted {files_at}: commit experiments/gpu (ledger.json, README.md, logs/)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run", help="run pending items within SECONDS")
    r.add_argument("seconds", type=float)
    r.add_argument("--ledger", type=Path, default=None)
    r.add_argument(
        "--margin", type=float, default=None, help="seconds kept for the last write (20; dry run 1)"
    )
    r.add_argument("--grace", type=float, default=None, help="SIGTERM to SIGKILL (10; dry run 1)")
    r.add_argument(
        "--mirror", type=Path, default=None, help="copy ledger, README and logs.tgz here after each"
    )
    r.add_argument("--only", nargs="*", default=None, help="run only these item ids")
    r.add_argument("--dry-run", action="store_true", help="CPU stand-ins, written to a separate ledger")
    r.add_argument("--scale", type=float, default=0.01, help="dry run: box scale (0.01: 300 s -> 3 s)")
    r.add_argument("--overrun", nargs="*", default=[], help="dry run: items whose stand-in overruns its box")
    g = sub.add_parser("render", help="regenerate README.md's table")
    g.add_argument("--ledger", type=Path, default=LEDGER)
    a = sub.add_parser("adopt", help="bring a device call's ledger.json, README.md and logs.tgz home")
    a.add_argument("files_at", type=Path)
    z = sub.add_parser("reset", help="make items pending again (after fixing what failed or timed out)")
    z.add_argument("ids", nargs="+")
    z.add_argument("--ledger", type=Path, default=LEDGER)
    args = ap.parse_args(argv)

    if args.verb == "render":
        render(load(args.ledger), args.ledger.parent / "README.md")
    elif args.verb == "adopt":
        adopt(args.files_at)
    elif args.verb == "reset":
        ledger = load(args.ledger)
        for item in ledger["items"]:
            if item["id"] in args.ids:
                item["status"] = "pending"
        save(ledger, args.ledger)
    else:
        path = args.ledger or LEDGER
        if args.dry_run:
            path = dry_run_path(args.ledger)
            shutil.rmtree(path.parent / "logs", ignore_errors=True)
            (path.parent / "README.md").unlink(missing_ok=True)
            write_atomic(
                path, json.dumps(standin_ledger(load(LEDGER), args.scale, args.overrun), indent=1) + "\n"
            )
            os.environ.setdefault("LEDGER_SCRATCH", str(path.parent / "work"))
        quick = args.dry_run  # stand-ins need a second of grace and margin, not a GPU run's
        try:
            schedule(
                path,
                args.seconds,
                margin=(1.0 if quick else 20.0) if args.margin is None else args.margin,
                grace=(1.0 if quick else 10.0) if args.grace is None else args.grace,
                mirror_to=args.mirror,
                dry_run=args.dry_run,
                only=args.only,
            )
        except Stopped as e:
            print(f"stopped by {e}: the item then running stays pending", file=sys.stderr)
            return 143
        if args.dry_run:
            print(f"stand-in ledger: {path} (README.md beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
