"""Runs a checkout's `train.py` in this process for measure.py, and records what it loaded and ran.

    python step_state_probe.py --checkout DIR --out FILE [--profile] -- OVERRIDE...

- Every run: at exit (atexit, in this process only, not in a forked child) FILE gets `lm.__file__` and the
  sorted names of the modules under `lm` in `sys.modules`.
- `--profile`: from the first line of this script, `sys.setprofile` and `threading.setprofile` record the code
  object of every Python call (every thread started after that; DataLoader *worker processes* are not
  followed: measure.py runs with `data.num_workers=0`, so batches are made in this process). The `Probe`
  callback (`+callbacks.probe._target_=step_state_probe.Probe`) stops recording at the end of the first
  optimizer step of this invocation (the first `on_train_batch_end` whose `trainer.global_step` is past the one
  training started from) and FILE's `profile` section lists the lm files (src/lm and train.py) that ran code.

This file must not import lm, torch or Lightning at the top: what is loaded is what is measured.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import json
import os
import runpy
import sys
import threading
from pathlib import Path

CODES: dict[int, object] = {}
"""id(code) -> code object of every Python frame called while recording."""
ACTIVE = False
STATE: dict = {"fired": False}
COMPREHENSIONS = {"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"}


def _record(frame, event, arg):
    if ACTIVE and event == "call":
        code = frame.f_code
        CODES[id(code)] = code


def start_profile() -> None:
    global ACTIVE
    ACTIVE = True
    threading.setprofile(_record)
    sys.setprofile(_record)


def stop_profile() -> None:
    global ACTIVE
    ACTIVE = False
    sys.setprofile(None)
    threading.setprofile(None)  # threads already started keep the hook, which records nothing now


def lm_files(checkout: Path) -> dict:
    """The lm files (under checkout/src/lm, and checkout/train.py) that ran code while recording: `any_code`
    counts module bodies (import time) and class bodies too; `functions` only functions and methods."""
    src, train = (checkout / "src" / "lm").resolve(), (checkout / "train.py").resolve()
    any_code: set[str] = set()
    functions: set[str] = set()
    cache: dict[str, str | None] = {}
    for code in list(CODES.values()):
        name = code.co_filename
        if name not in cache:
            path = Path(name).resolve() if name and not name.startswith("<") else None
            rel = None
            if path is not None and (path == train or src in path.parents):
                rel = str(path.relative_to(checkout.resolve()))
            cache[name] = rel
        rel = cache[name]
        if rel is None:
            continue
        any_code.add(rel)
        if code.co_flags & inspect.CO_OPTIMIZED and code.co_name not in COMPREHENSIONS:
            functions.add(rel)
    return {"functions": sorted(functions), "any_code": sorted(any_code)}


def _probe_class() -> type:
    """`Probe`, built on first use (Hydra instantiating it): a Lightning Callback that stops the recording at
    the end of this invocation's first optimizer step. Lightning is imported by then."""
    import lightning.pytorch as pl

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.start_step: int | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.start_step = trainer.global_step
            STATE["start_step"] = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if STATE["fired"] or self.start_step is None or trainer.global_step <= self.start_step:
                return
            stop_profile()
            STATE.update(fired=True, first_step_ended=trainer.global_step)

    return Probe


def __getattr__(name: str):
    if name == "Probe":
        cls = _probe_class()
        globals()["Probe"] = cls
        return cls
    raise AttributeError(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    pid = os.getpid()

    def dump() -> None:
        if os.getpid() != pid:  # a forked child (a DataLoader worker, a tokenizer process) exiting
            return
        lm = sys.modules.get("lm")
        result = {
            "lm_file": getattr(lm, "__file__", None),
            "lm_modules": sorted(m for m in sys.modules if m == "lm" or m.startswith("lm.")),
        }
        if args.profile:
            stop_profile()
            result["profile"] = {**STATE, **(lm_files(checkout) if STATE["fired"] else {})}
        args.out.write_text(json.dumps(result, indent=1))

    atexit.register(dump)
    if args.profile:
        start_profile()
    sys.argv = [str(checkout / "train.py"), *args.overrides]
    runpy.run_path(str(checkout / "train.py"), run_name="__main__")


if __name__ == "__main__":
    # Started as a script this module is `__main__`; Hydra imports `step_state_probe` for the callback, a
    # second copy whose globals the hook would not see. Make both names one module.
    sys.modules.setdefault("step_state_probe", sys.modules["__main__"])
    main()
