"""The layering rule, enforced: a module of lm imports only modules of its own layer or below, and no chain
of imports (inside functions included) closes a cycle.

Layers, top to bottom (docs/architecture.md draws them):

  7 entry points   lm.cli (train.py at the repository root)
  6 verbs          bench, sweep, sky, supervise, planner, calibrate
  5 composition    lm.train: one run
  4 run services   doctor (every run's preflight), report (every run's last word), export
  3 run parts      callbacks, checkpointing
  2 machinery      module, kernels, activation checkpointing, runtime, parallel, generate, storage, remote, data,
                   hf, evaluate
  1 foundation     model, config, cost, memory, forecast, schedule, lossmodel, plan, exits, atomic, rundir,
                   runlock, tables, bench_results
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS = {
    1: [
        "lm", "lm.model", "lm.config", "lm.cost", "lm.memory", "lm.forecast", "lm.plan",
        "lm.schedule", "lm.lossmodel",
        "lm.exits", "lm.atomic", "lm.rundir", "lm.runlock", "lm.tables", "lm.bench_results",
    ],
    2: [
        "lm.module", "lm.kernels", "lm.activation_checkpointing", "lm.runtime", "lm.parallel", "lm.generate",
        "lm.storage", "lm.remote", "lm.data", "lm.hf", "lm.evaluate", "lm.optim",
    ],
    3: ["lm.callbacks", "lm.checkpointing"],
    4: ["lm.doctor", "lm.report", "lm.export"],
    5: ["lm.train"],
    6: ["lm.bench", "lm.sweep", "lm.sky", "lm.supervise", "lm.planner", "lm.calibrate"],
    7: ["lm.cli"],
}  # fmt: skip


def layer_of(module: str) -> int:
    """The layer of the longest listed prefix (`lm.data.shards` is `lm.data`'s unless listed itself)."""
    best = None
    for layer, names in LAYERS.items():
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                best is None or len(name) > len(best[1])
            ):
                best = (layer, name)
    if best is None:
        raise AssertionError(f"{module} has no layer: add it to LAYERS here and to docs/architecture.md")
    return best[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """(imported lm module, line) for every import in the file, inside functions too. `from pkg import x`
    counts as importing the submodule `pkg.x` when it is one, else the package itself."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "lm"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "lm":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else base, node.lineno))
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    """Each module's imports, with the packages Python runs on the way: importing `lm.data.manifest` from
    outside `lm.data` runs `lm/data/__init__.py` first, so it depends on everything that file imports."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    out = {}
    for m, p in files.items():
        targets = []
        for t, line in imports(p, set(files)):
            parts = t.split(".")
            packages = [".".join(parts[:i]) for i in range(1, len(parts))]
            targets += [(pkg, line) for pkg in packages if not (m == pkg or m.startswith(pkg + "."))]
            targets.append((t, line))
        out[m] = [(t, line) for t, line in targets if t != m]
    return out


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other in a circle (Tarjan's strongly connected components
    of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in edges.get(node, ()):
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def test_every_module_has_a_layer():
    for module in graph():
        layer_of(module)


def test_no_import_points_up_the_layers():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)}) at line {line}"
        for m, targets in graph().items()
        for t, line in targets
        if layer_of(t) > layer_of(m)
    ]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_cycle():
    edges: dict[str, set[str]] = {}
    for m, targets in graph().items():
        # A package's __init__ re-exports its modules; importing `lm.data` means importing them.
        edges.setdefault(m, set()).update(t for t, _ in targets)
    cycles = find_cycles(edges)
    assert not cycles, "modules that import each other in a circle: " + "; ".join(map(" <-> ".join, cycles))


@pytest.mark.parametrize(
    "cycle",
    [
        {"lm.bench": {"lm.cli"}, "lm.cli": {"lm.bench"}},
        {"lm.data.shards": {"lm.remote"}, "lm.remote": {"lm.data.shards"}},
        {"lm.module": {"lm.kernels"}, "lm.kernels": {"lm.module"}},
    ],
)
def test_the_cycle_finder_finds_the_cycles_this_layout_removed(cycle):
    assert find_cycles(cycle) == [sorted(cycle)]
