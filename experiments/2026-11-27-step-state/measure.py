"""Issue 49's "Done when" figures for one checkout of lm, measured the same way before and after.

    .venv/bin/python experiments/2026-11-27-step-state/measure.py [--repo CHECKOUT] [--out result.json]

Static (an `ast` walk of CHECKOUT/src/lm, the installed lightning and torch read as source):
  private_lightning_names / private_torch_names / private_other_names, priority_attributes,
  callback_state_dicts (+ other_resumable_state).
Runtime (CHECKOUT's train.py in a subprocess, PYTHONPATH=CHECKOUT/src, cwd=CHECKOUT, tiny CPU model, see
step_state_probe.py): modules_imported_by_smoke, files_run_to_first_resumed_step, checkpoint_contents.

The method, precisely, is in README.md next to this file; every rule below says which of its paragraphs it is.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROBE = HERE / "step_state_probe.py"
DEFAULT_REPO = HERE.parents[1]
LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities")
TORCH_PACKAGES = ("torch",)

TINY_FALLBACK = [
    "trainer=cpu",
    "trainer.enable_progress_bar=false",
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "data.max_bytes=1500000",
    "data.tokenizer_sample_bytes=500000",
    "data.vocab_size=512",
    "data.seq_len=64",
    "data.batch_size=8",
    "data.num_workers=2",
    "logger=tensorboard",
    "callbacks={}",
    "sampling.max_new_tokens=16",
]
"""tests/conftest.py's TINY at f2731ec; used only when the checkout's own TINY cannot be read."""


def is_private(name: str) -> bool:
    """A single leading underscore, not a dunder (`_x`, `_x_`; not `__x__`, not `__x`, not `_`)."""
    return len(name) > 1 and name.startswith("_") and not name.startswith("__")


def library_of(module: str) -> str:
    root = module.split(".")[0]
    if root in LIGHTNING_PACKAGES:
        return "lightning"
    if root in TORCH_PACKAGES:
        return "torch"
    if root == "lm":
        return "lm"
    return "other"


# -- the libraries' private names, read from their installed source ------------------------------------------

DEFINITION = re.compile(
    r"\b(?:def|class)\s+(_\w+)"  # def _x / class _x
    r"|(?:\bself|\bcls|^[ \t]*)\.?(_\w+)\s*(?::[^=\n]*)?=(?!=)"  # self._x = / cls._x: T = / _x = (line start)
    r"|^[ \t]*(_\w+)\s*:"  # _x: T (a class-level annotation)
    r"|^[ \t]*from\s+\S+\s+import\s.*",  # from M import _x (a re-export)
    re.M,
)
"""What defines a name in library source: `def _x`, `class _x`, `self._x =`/`cls._x =`, `_x = ...`/`_x: T` at the
start of a line (module or class level), and `from M import _x` re-exports (handled in `defined_names`)."""


def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec and spec.origin else None


def defined_names(packages: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """(names defined in the packages' .py files, every `_name` token that appears in them at all)."""
    defined: set[str] = set()
    mentioned: set[str] = set()
    token = re.compile(r"\b_[A-Za-z0-9]\w*")
    for package in packages:
        root = package_dir(package)
        if root is None:
            continue
        for path in root.rglob("*.py"):
            if is_private(path.stem):
                defined.add(path.stem)  # a private module: torch.optim._muon
            for part in path.relative_to(root).parts[:-1]:
                if is_private(part):
                    defined.add(part)
            text = path.read_text(errors="replace")
            mentioned.update(token.findall(text))
            for m in DEFINITION.finditer(text):
                if name := m.group(1) or m.group(2) or m.group(3):
                    defined.add(name)
                else:  # from M import a, _b as _c
                    defined.update(n for n in re.findall(r"\b_\w+", m.group(0).split(" import ", 1)[1]))
    return defined, mentioned


# -- src/lm, walked ---------------------------------------------------------------------------------------------


class Module:
    def __init__(self, path: Path, rel: str, dotted: str) -> None:
        self.path, self.rel, self.dotted = path, rel, dotted
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.imports: dict[str, str] = {}
        """local name -> what it names, dotted (`pl` -> lightning.pytorch, `Callback` -> lightning.pytorch.Callback)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.imports[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom):
                base = self.absolute(node)
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{base}.{a.name}"

    def absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = self.dotted.split(".")
        if not self.rel.endswith("__init__.py"):
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        return ".".join([*package, *([node.module] if node.module else [])])

    def dotted_of(self, expr: ast.expr) -> str | None:
        """`pl.Callback` -> lightning.pytorch.Callback, through this module's imports."""
        if isinstance(expr, ast.Name):
            return self.imports.get(expr.id, f"{self.dotted}.{expr.id}")
        if isinstance(expr, ast.Attribute):
            head = self.dotted_of(expr.value)
            return f"{head}.{expr.attr}" if head else None
        return None


class ClassInfo:
    def __init__(self, module: Module, node: ast.ClassDef) -> None:
        self.module, self.node = module, node
        self.qualname = f"{module.dotted}.{node.name}"
        self.bases = [b for b in (module.dotted_of(e) for e in node.bases) if b]
        self.assigned: set[str] = set()
        """Private names this class's own code defines: methods, class-level names, `self._x =` stores."""
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.assigned.add(item.name)
            for target in assign_targets(item) if not isinstance(item, ast.FunctionDef) else []:
                if isinstance(target, ast.Name):
                    self.assigned.add(target.id)
        for sub in ast.walk(node):
            for target in assign_targets(sub):
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and is_self(t.value):
                        self.assigned.add(t.attr)


def assign_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    if isinstance(node, ast.For | ast.With):
        return (
            [node.target]
            if isinstance(node, ast.For)
            else [i.optional_vars for i in node.items if i.optional_vars]
        )
    return []


def is_self(expr: ast.expr) -> bool:
    """`self`, `cls`, `super()`, `type(self)`: the receiver is the enclosing class."""
    if isinstance(expr, ast.Name):
        return expr.id in ("self", "cls")
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
        return expr.func.id == "super" or (
            expr.func.id == "type" and bool(expr.args) and is_self(expr.args[0])
        )
    return False


def resolve(dotted: str):
    """The object a dotted name names (importing its module), or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return None
        return obj
    return None


class Tree:
    """src/lm of one checkout."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        src = repo / "src"
        self.modules: list[Module] = []
        for path in sorted((src / "lm").rglob("*.py")):
            rel = path.relative_to(src)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.modules.append(Module(path, str(path.relative_to(repo)), ".".join(parts)))
        self.classes: dict[str, ClassInfo] = {}
        for m in self.modules:
            for node in ast.walk(m.tree):
                if isinstance(node, ast.ClassDef):
                    info = ClassInfo(m, node)
                    self.classes.setdefault(info.qualname, info)
        self._external: dict[str, dict[str, str]] = {}

    def lm_bases(self, info: ClassInfo, seen: set[str] | None = None) -> list[ClassInfo]:
        """info and the lm classes it derives from, nearest first."""
        seen = seen if seen is not None else set()
        if info.qualname in seen:
            return []
        seen.add(info.qualname)
        out = [info]
        for b in info.bases:
            if b in self.classes:
                out += self.lm_bases(self.classes[b], seen)
        return out

    def external_bases(self, info: ClassInfo) -> list[str]:
        return [
            b for c in self.lm_bases(info) for b in c.bases if b not in self.classes and library_of(b) != "lm"
        ]

    def external_names(self, dotted: str) -> dict[str, str]:
        """Private names the library class `dotted` has, through its MRO -> the library that defines each
        (the class attributes and methods, and the `self._x` its source assigns)."""
        if dotted not in self._external:
            names: dict[str, str] = {}
            cls = resolve(dotted)
            for k in getattr(cls, "__mro__", ())[::-1]:
                lib = library_of(getattr(k, "__module__", "") or "")
                found = {n for n in vars(k) if is_private(n)}
                with contextlib.suppress(OSError, TypeError):
                    found |= set(re.findall(r"self\.(_\w+)\s*(?::[^=\n]*)?=(?!=)", inspect.getsource(k)))
                names.update(dict.fromkeys((n for n in found if is_private(n)), lib))
            self._external[dotted] = names
        return self._external[dotted]

    def library_member(self, info: ClassInfo, name: str) -> str | None:
        """The library whose base class of `info` (through lm's own bases) has `name`, else None."""
        for base in self.external_bases(info):
            lib = self.external_names(base).get(name)
            if lib is not None:
                return lib
        return None

    def own_names(self) -> set[str]:
        """Private names lm defines: module-level names, functions and classes anywhere, names its classes
        define that none of their library base classes has, and private module names."""
        own: set[str] = set()
        for m in self.modules:
            own.update(p for p in m.dotted.split(".") if is_private(p))
            for node in ast.walk(m.tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and is_private(
                    node.name
                ):
                    own.add(node.name)
            for node in m.tree.body:
                for target in assign_targets(node):
                    own.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name) and is_private(t.id))
        for info in self.classes.values():
            own.update(n for n in info.assigned if is_private(n) and self.library_member(info, n) is None)
        return own


def private_names(
    tree: Tree, lightning: tuple[set[str], set[str]], torch_: tuple[set[str], set[str]]
) -> dict:
    """Every reference in src/lm to a private name of a library (README, "Private names")."""
    own = tree.own_names()
    occurrences: list[dict] = []

    def classify(name: str, receiver_module: str | None) -> str | None:
        if receiver_module is not None:  # `torch._dynamo`, `os._exit`: the module says whose name it is
            lib = library_of(receiver_module)
            return None if lib == "lm" else lib
        if name in own:
            return None
        for lib, (defined, _) in (("lightning", lightning), ("torch", torch_)):
            if name in defined:
                return lib
        for lib, (_, mentioned) in (("lightning", lightning), ("torch", torch_)):
            if name in mentioned:
                return lib
        return "other"

    for m in tree.modules:
        private_imports: dict[str, str] = {}  # local name -> library, for the uses of a private import

        def add(node: ast.AST, kind: str, name: str, lib: str | None, m: Module = m) -> None:
            if lib is None or lib == "lm":
                return
            code = ast.get_source_segment(m.path.read_text(), node) or ""
            occurrences.append(
                {
                    "library": lib,
                    "file": m.rel,
                    "line": node.lineno,
                    "kind": kind,
                    "name": name,
                    "code": code.splitlines()[0][:120] if code else "",
                }
            )

        def walk(
            node: ast.AST, cls: ClassInfo | None, m: Module = m, private_imports: dict = private_imports
        ) -> None:
            if isinstance(node, ast.ClassDef):
                cls = tree.classes.get(f"{m.dotted}.{node.name}", cls)
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and cls is not None
                and is_private(node.name)
            ):
                lib = tree.library_member(cls, node.name) if node in cls.node.body else None
                add(node, "override", node.name, lib)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if any(is_private(p) for p in a.name.split(".")):
                        add(node, "import", a.name, library_of(a.name))
            if isinstance(node, ast.ImportFrom):
                module = m.absolute(node)
                lib = library_of(module)
                if lib != "lm":
                    if any(is_private(p) for p in module.split(".")):
                        add(node, "import (private module)", module, lib)
                    for a in node.names:
                        if is_private(a.name):
                            add(node, "import", a.name, lib)
                            private_imports[a.asname or a.name] = lib
            if (
                isinstance(node, ast.Name)
                and node.id in private_imports
                and not isinstance(node.ctx, ast.Store)
            ):
                add(node, "use of a private import", node.id, private_imports[node.id])
            receiver, name = None, None
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                receiver, name = node.value, node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and is_private(node.args[1].value)
            ):
                receiver, name = node.args[0], node.args[1].value
            if name is not None:
                kind = "attribute" if isinstance(node, ast.Attribute) else f"{node.func.id}() string"
                if cls is not None and is_self(receiver):
                    lib = tree.library_member(cls, name)
                    if lib is None and name not in cls.assigned and name not in own:
                        lib = classify(name, None)
                    add(node, kind, name, lib)
                else:
                    head = m.dotted_of(receiver) if isinstance(receiver, ast.Name) else None
                    module = (
                        head if head and isinstance(receiver, ast.Name) and receiver.id in m.imports else None
                    )
                    if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
                        module = None
                    add(node, kind, name, classify(name, module))
            for child in ast.iter_child_nodes(node):
                walk(child, cls)

        walk(m.tree, None)

    def summary(lib: str) -> dict:
        rows = [o for o in occurrences if o["library"] == lib]
        files = Counter(o["file"] for o in rows)
        return {
            "count": len(rows),
            "files": len(files),
            "names": len({o["name"] for o in rows}),
            "by_kind": dict(sorted(Counter(o["kind"] for o in rows).items())),
            "by_file": dict(sorted(files.items())),
            "occurrences": rows,
        }

    lightning_s, torch_s = summary("lightning"), summary("torch")
    both = Counter(o["file"] for o in occurrences if o["library"] in ("lightning", "torch"))
    return {
        "private_lightning_names": lightning_s,
        "private_torch_names": torch_s,
        "private_lightning_or_torch": {"count": sum(both.values()), "files": len(both)},
        "private_other_names": summary("other"),
    }


def priority_attributes(tree: Tree) -> dict:
    rows = []
    for info in tree.classes.values():
        for item in info.node.body:
            for target in assign_targets(item):
                if isinstance(target, ast.Name) and target.id == "priority":
                    value = (
                        ast.get_source_segment(info.module.path.read_text(), item.value)
                        if item.value
                        else None
                    )
                    rows.append(
                        {
                            "file": info.module.rel,
                            "line": item.lineno,
                            "class": info.node.name,
                            "value": value,
                        }
                    )
    return {"count": len(rows), "attributes": sorted(rows, key=lambda r: (r["file"], r["line"]))}


def callback_state(tree: Tree) -> dict:
    """Classes defining `state_dict` (Lightning callbacks and others) and `on_save_checkpoint` hooks."""
    import lightning.pytorch as pl

    def is_callback(info: ClassInfo) -> bool:
        return any(
            isinstance(c := resolve(b), type) and issubclass(c, pl.Callback)
            for b in tree.external_bases(info)
        )

    callbacks, others, hooks = [], [], []
    for info in tree.classes.values():
        methods = {i.name: i for i in info.node.body if isinstance(i, ast.FunctionDef | ast.AsyncFunctionDef)}
        row = {"file": info.module.rel, "class": info.node.name}
        if "state_dict" in methods:
            row["line"] = methods["state_dict"].lineno
            (callbacks if is_callback(info) else others).append(row)
        if "on_save_checkpoint" in methods:
            fn = methods["on_save_checkpoint"]
            keys = sorted(
                {
                    ast.get_source_segment(info.module.path.read_text(), t.slice) or "?"
                    for n in ast.walk(fn)
                    for t in assign_targets(n)
                    if isinstance(t, ast.Subscript)
                }
            )
            hooks.append({**row, "line": fn.lineno, "writes_keys": keys, "callback": is_callback(info)})
    key = lambda r: (r["file"], r["line"])  # noqa: E731
    return {
        "count": len(callbacks),
        "count_with_other_classes": len(callbacks) + len(others),
        "callbacks": sorted(callbacks, key=key),
        "other_classes_with_state_dict": sorted(others, key=key),
        "on_save_checkpoint_hooks": sorted(hooks, key=key),
    }


# -- runs -------------------------------------------------------------------------------------------------------


def tiny_overrides(repo: Path) -> tuple[list[str], str]:
    conftest = repo / "tests" / "conftest.py"
    try:
        for node in ast.parse(conftest.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TINY" for t in node.targets):
                return list(ast.literal_eval(node.value)), f"{conftest.relative_to(repo)} TINY"
    except (OSError, SyntaxError, ValueError):
        pass
    return list(TINY_FALLBACK), "measure.py TINY_FALLBACK (f2731ec's TINY)"


def run_train(repo: Path, overrides: list[str], out: Path, timeout: float, profile: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(HERE)])}
    env.pop("PYTHONSTARTUP", None)
    cmd = [sys.executable, str(PROBE), "--checkout", str(repo), "--out", str(out)]
    cmd += ["--profile"] if profile else []
    cmd += ["--", *overrides]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        code, tail = (
            "timeout",
            ((e.stdout or b"")[-1500:] + (e.stderr or b"")[-1500:]).decode(errors="replace"),
        )
    result = {"command": cmd, "exit_code": code, "seconds": round(time.monotonic() - t0, 1)}
    if code != 0:
        result["output_tail"] = tail
    if out.exists():
        result.update(json.loads(out.read_text()))
    lm_file = result.get("lm_file")
    result["lm_from_checkout"] = bool(lm_file) and Path(lm_file).resolve().is_relative_to(
        (repo / "src").resolve()
    )
    return result


LIGHTNING_KEYS = {
    "state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step", "pytorch-lightning_version",
    "loops", "callbacks", "hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters",
    "datamodule_hparams_name", "datamodule_hparams_type", "MixedPrecision", "native_amp_scaling_state",
}  # fmt: skip
"""Top-level checkpoint keys Lightning writes itself (weights, optimizer, scheduler, loops, callbacks' states)."""


def checkpoint_contents(path: Path) -> dict:
    """What the first run's last.ckpt holds: its keys, each callback's state keys, and the places holding
    resumable state besides weights, optimizer and scheduler (a callback's non-empty state, a key Lightning
    does not write)."""
    import torch

    if not path.exists():
        return {"error": f"{path} missing"}
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        return {"error": repr(e)[:300]}
    callbacks = ckpt.get("callbacks", {})
    places = [f"callbacks[{k.split('{')[0]}]" for k, v in callbacks.items() if v]
    places += [f"[{k!r}]" for k in sorted(set(ckpt) - LIGHTNING_KEYS)]
    return {
        "path": path.name,
        "resumable_state_places": {"count": len(places), "places": places},
        "top_level_keys": sorted(ckpt),
        "callbacks": {
            k: sorted(v) if isinstance(v, dict) else type(v).__name__
            for k, v in ckpt.get("callbacks", {}).items()
        },
    }


def runtime(repo: Path, cache: Path, timeout: float) -> dict:
    tiny, tiny_from = tiny_overrides(repo)
    with tempfile.TemporaryDirectory(prefix="lm-step-state-") as tmp:
        root = Path(tmp) / "runs"
        common = [*tiny, "data.num_workers=0", f"run.root={root}", f"data.cache_dir={cache}"]

        smoke = run_train(
            repo, [*common, "run.name=smoke", "trainer.max_steps=2"], Path(tmp) / "smoke.json", timeout
        )
        modules = smoke.pop("lm_modules", [])
        total = sum(1 for _ in (repo / "src" / "lm").rglob("*.py"))
        smoke_out = {
            "count": len(modules),
            "count_without_lm_itself": len([m for m in modules if m != "lm"]),
            "modules_under_src_lm": total,
            "run": smoke,
            "modules": modules,
        }

        resume = [*common, "run.name=resume", "optim.total_steps=6", "checkpoint.every_n_steps=2"]
        first = run_train(repo, [*resume, "trainer.max_steps=4"], Path(tmp) / "first.json", timeout)
        first.pop("lm_modules", None)
        ckpt_dir = root / "resume" / "checkpoints"
        contents = checkpoint_contents(ckpt_dir / "last.ckpt")
        contents["files_in_checkpoints_dir"] = (
            sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
        )
        probe = ["+callbacks.probe._target_=step_state_probe.Probe"]
        second = run_train(
            repo, [*resume, "trainer.max_steps=6", *probe], Path(tmp) / "second.json", timeout, profile=True
        )
        second.pop("lm_modules", None)
        profile = second.pop("profile", {})
        files = profile.pop("functions", [])
        resumed = {
            "count": len(files),
            "files": files,
            "count_including_import_only": len(profile.get("any_code", [])),
            "import_only_files": sorted(set(profile.pop("any_code", [])) - set(files)),
            "probe": profile,
            "first_run": first,
            "resumed_run": second,
        }
    return {
        "overrides_base": {
            "tiny_from": tiny_from,
            "overrides": [*common[:-2], "run.root=<tmp>", f"data.cache_dir={cache}"],
        },
        "modules_imported_by_smoke": smoke_out,
        "files_run_to_first_resumed_step": resumed,
        "checkpoint_contents": contents,
    }


def git_state(repo: Path) -> dict:
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
        return r.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_files_under_src": len(git("status", "--porcelain", "src").splitlines()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--repo", type=Path, default=DEFAULT_REPO, help="the checkout to measure (default: this one)"
    )
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    ap.add_argument(
        "--data-cache",
        type=Path,
        default=Path(os.environ.get("LM_CACHE", Path.home() / ".cache" / "lm")),
        help="prepared-data cache shared by the runs (default: $LM_CACHE or ~/.cache/lm, lm's own default)",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed to each train.py process")
    ap.add_argument("--static-only", action="store_true", help="skip the train.py runs (items 4 and 5)")
    args = ap.parse_args()
    repo = args.repo.resolve()

    import lightning
    import torch

    t0 = time.monotonic()
    tree = Tree(repo)
    result: dict = {
        "repo": str(repo),
        **git_state(repo),
        "python": sys.version.split()[0],
        "lightning": lightning.__version__,
        "torch": torch.__version__,
    }
    result.update(private_names(tree, defined_names(LIGHTNING_PACKAGES), defined_names(TORCH_PACKAGES)))
    result["priority_attributes"] = priority_attributes(tree)
    result["callback_state_dicts"] = callback_state(tree)
    if not args.static_only:
        result.update(runtime(repo, args.data_cache.resolve(), args.timeout))
    result["seconds"] = round(time.monotonic() - t0, 1)

    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    print(summary(result), file=sys.stderr)


def summary(r: dict) -> str:
    lines = [f"{r['repo']} @ {r['commit'][:7]} (src files changed: {r['dirty_files_under_src']})"]
    for key in ("private_lightning_names", "private_torch_names", "private_other_names"):
        lines.append(f"  {key}: {r[key]['count']} in {r[key]['files']} files")
    both = r["private_lightning_or_torch"]
    lines.append(f"  lightning + torch: {both['count']} in {both['files']} files")
    lines.append(f"  priority_attributes: {r['priority_attributes']['count']}")
    c = r["callback_state_dicts"]
    lines.append(
        f"  callback_state_dicts: {c['count']} (+{len(c['other_classes_with_state_dict'])} other classes, "
        f"{len(c['on_save_checkpoint_hooks'])} on_save_checkpoint hooks)"
    )
    if "modules_imported_by_smoke" in r:
        s = r["modules_imported_by_smoke"]
        lines.append(
            f"  modules_imported_by_smoke: {s['count']} of {s['modules_under_src_lm']} "
            f"({s['count_without_lm_itself']} without `lm` itself) "
            f"(exit {s['run']['exit_code']}, lm from checkout: {s['run']['lm_from_checkout']})"
        )
        f = r["files_run_to_first_resumed_step"]
        places = r["checkpoint_contents"].get("resumable_state_places", {})
        lines.append(f"  resumable state places in last.ckpt: {places.get('count')} {places.get('places')}")
        lines.append(
            f"  files_run_to_first_resumed_step: {f['count']} ({f['count_including_import_only']} with import-only), "
            f"resumed from step {f['probe'].get('start_step')} (exit {f['resumed_run']['exit_code']})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
