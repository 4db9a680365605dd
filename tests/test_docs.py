"""The docs cannot drift from the code: every dotted `lm.` name and every repository path that README.md, docs/
and the docstrings under src/lm name must exist, and every Markdown link must land on a file and heading.

Names resolve statically (ast, no imports): `lm.a.b` is a module or package under src/lm, what follows it a name
that module defines or imports, then a class's attribute. A path is read from the repository root, or from
src/lm when it starts with a wing (`checkpoint/files.py`); a bare `name.py` must be some file of the repository.
"""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# Repository folders and files a path may start with; wing-relative paths (`checkpoint/files.py`) are read
# against src/lm when they end in .py.
TOP = ("src/", "tests/", "conf/", "docs/", "experiments/", "slurm/", "sky/", ".ci/")
WINGS = tuple(p.name for p in (SRC / "lm").iterdir() if p.is_dir() and not p.name.startswith("_"))
# Named on purpose though not in the repository: files lm writes, and other projects' files.
NOT_OURS = {"conf/experiment/planned.yaml", "convert_hf_to_gguf.py"}
# Stale, in a file another change is rewriting now; each entry must still be stale (drop it once fixed).
KNOWN_STALE: set[str] = set()

NAME = re.compile(r"(?<![\w.])lm(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(
    r"(?<![\w/.$<{-])((?:src|tests|conf|docs|experiments|slurm|sky|\.ci)/[\w./-]*\w/?"
    r"|(?:" + "|".join(WINGS) + r")/[\w/]*\w\.py)"
)
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|NNNNN|YYYY")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE = re.compile(r"(?<![\w/.-])([A-Za-z_]\w*\.py)\b")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docstrings() -> list[tuple[str, str]]:
    """(where, text) for every module, class and function docstring under src/lm."""
    found = []
    for path in sorted((SRC / "lm").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(node, clean=False)
                if text:
                    where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}"
                    found.append((where, text))
    return found


def texts() -> list[tuple[str, str]]:
    """(where, text) to check: the Markdown outside fenced blocks (commands there name outputs, not files of the
    repository), and every docstring."""
    out = [(str(p.relative_to(ROOT)), FENCE.sub("", p.read_text())) for p in markdown_files()]
    return out + docstrings()


@cache
def module_file(dotted: str) -> Path | None:
    base = SRC / Path(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def defined(path: Path) -> dict[str, ast.AST | None]:
    """Top-level names `path` defines or imports: a class maps to its node (its attributes are looked up in it)."""
    names: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text()).body:
        names.update(bound(node))
    return names


def bound(node: ast.AST) -> dict[str, ast.AST | None]:
    if isinstance(node, ast.ClassDef):
        return {node.name: node}
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return {node.name: None}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0]: None for a in node.names}
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id: None for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.If | ast.Try):
        out: dict[str, ast.AST | None] = {}
        for child in ast.iter_child_nodes(node):
            out.update(bound(child))
        return out
    return {}


def class_attributes(node: ast.ClassDef) -> set[str]:
    names = set()
    for child in node.body:
        names.update(bound(child))
    for child in ast.walk(node):  # attributes set in methods: self.x = ...
        if (
            isinstance(child, ast.Attribute)
            and isinstance(child.value, ast.Name)
            and child.value.id == "self"
        ):
            names.add(child.attr)
    return names


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if cut < len(parts) and module_file(".".join(parts[: cut + 1])) is None:
            node = defined(path).get(rest[0], False)
            if node is False:
                return False
            for attr in rest[1:]:  # a class's attribute; past a function or a value, stop checking
                if not isinstance(node, ast.ClassDef):
                    return True
                if attr not in class_attributes(node):
                    return False
                node = None
            return True
    return False


@cache
def python_files() -> set[str]:
    skip = {".venv", ".git", "node_modules"}
    return {p.name for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)}


def path_exists(token: str) -> bool:
    token = token.rstrip("/")
    if any(token.startswith(w + "/") for w in WINGS) and not token.startswith(TOP):
        return (SRC / "lm" / token).exists() or (ROOT / token).exists()
    return (ROOT / token).exists()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def stale() -> list[str]:
    """Every name, path and link that does not resolve, as `where: what`."""
    problems = []
    for where, text in texts():
        for m in NAME.finditer(text):
            name = m.group(0)
            if not resolves(name):
                problems.append(f"{where}: {name}")
        for m in PATH.finditer(text):
            token = m.group(1)
            if PLACEHOLDER.search(text[m.start() : m.end() + 1]) or token.rstrip("/") in NOT_OURS:
                continue
            if not path_exists(token):
                problems.append(f"{where}: {token}")
        for m in BARE.finditer(text):
            if m.group(1) not in python_files() and m.group(1) not in NOT_OURS:
                problems.append(f"{where}: {m.group(1)}")
    for md in markdown_files():
        for m in LINK.finditer(FENCE.sub("", md.read_text())):
            target = m.group(1)
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            where = str(md.relative_to(ROOT))
            if not dest.exists():
                problems.append(f"{where}: link {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: link {target} (no such heading)")
    return problems


def test_every_name_path_and_link_resolves():
    problems = [re.sub(r":\d+:", ":", p) for p in stale()]  # line numbers move
    new = [p for p in problems if p not in KNOWN_STALE]
    assert not new, "names, paths or links that do not resolve:\n" + "\n".join(new)
    assert sorted(KNOWN_STALE - set(problems)) == [], "fixed: remove these from KNOWN_STALE"


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("lm.checkpoint.resume_check", True),
        ("lm.checkpoint.run_state.RunState", True),
        ("lm.numbers.batch_ramp.BatchRamp.steps_for_tokens", True),
        ("lm.config.DataConfig", True),  # re-exported
        ("lm.callbacks.resume_check", False),  # moved to lm.checkpoint
        ("lm.knobs", False),  # gone
        ("lm.checkpoint.run_state.RunState.no_such_field", False),
    ],
)
def test_resolver(name, ok):
    assert resolves(name) is ok
