"""The layering rule, enforced: a module of lm imports only modules of its own wing or a wing below, and no
chain of imports (inside functions included) closes a cycle.

The wings of `src/lm`, bottom to top (docs/architecture.md draws the tree, one line per file):

  lm.base         exit codes and their exceptions, the doctor's `Finding`, Markdown tables (imports nothing of lm)
  lm.model        the architecture (imports nothing of lm)
  lm.store        atomic writes, run-directory files, the run lock, bench.json, object storage
  lm.config       the typed config schemas and their composition
  lm.numbers      cost, the run's plan in numbers, memory, the LR schedule, the fitter and the loss laws
  lm.data         sources, tokenizer, shards, the mixture, the data modules
  lm.checkpoint   checkpoint files: names and reading, local saves and resume, the bucket, the save callback
  lm.engine       the LightningModule, optimizers, kernels, parallelism, runtime, activation checkpointing
  lm.interop      the model's interfaces to other tools: Hugging Face (export, import), lm-eval, generation
  lm.evals        benchmarks: CORE and the @olmo sets scored by lm, lm-eval driven, one entry, the bundle fetch
  lm.callbacks    the run's Lightning callbacks
  lm.run          one run: preflight (doctor), composition (train), a sweep's summary, the report
  lm.tools        the verbs around runs: bench, plan, calibrate, sky, supervise, export, ablate
  lm.cli          the entry point (train.py at the repository root calls lm.run.train)
"""

import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

WINGS = [
    "lm", "lm.base", "lm.model", "lm.store", "lm.config", "lm.numbers", "lm.data", "lm.checkpoint", "lm.engine",
    "lm.interop", "lm.evals", "lm.callbacks", "lm.run", "lm.tools", "lm.cli",
]  # fmt: skip
LAYERS = {i: [wing] for i, wing in enumerate(WINGS)}
ROOT_FILES_AT_MOST = 6


def layer_of(module: str) -> int:
    """The layer of the longest listed prefix (`lm.data.shards` is `lm.data`'s unless listed itself). The
    package root `lm` is a wing of one module, its `__init__`: as a prefix it would hold every module."""
    best = None
    for layer, names in LAYERS.items():
        for name in names:
            prefix = name != "lm" and module.startswith(name + ".")
            if (module == name or prefix) and (best is None or len(name) > len(best[1])):
                best = (layer, name)
    if best is None:
        raise AssertionError(f"{module} is in no wing: put it in one of {WINGS} (docs/architecture.md)")
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


@pytest.mark.parametrize("module", ["lm.stray", "lm.newwing", "lm.newwing.part", "lmx.data"])
def test_a_module_outside_every_wing_is_flagged(module):
    """The check above can fail: a root file or a folder that no wing lists has no layer."""
    with pytest.raises(AssertionError, match="is in no wing"):
        layer_of(module)
    assert layer_of("lm.data.shards") == layer_of("lm.data") and layer_of("lm") == 0


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
        {"lm.tools.bench": {"lm.cli"}, "lm.cli": {"lm.tools.bench"}},
        {"lm.data.shards": {"lm.checkpoint.remote"}, "lm.checkpoint.remote": {"lm.data.shards"}},
        {"lm.engine.module": {"lm.engine.kernels"}, "lm.engine.kernels": {"lm.engine.module"}},
    ],
)
def test_the_cycle_finder_finds_the_cycles_this_layout_removed(cycle):
    assert find_cycles(cycle) == [sorted(cycle)]


def test_the_package_root_holds_a_handful_of_files():
    root = sorted(p.name for p in (SRC / "lm").glob("*.py"))
    assert len(root) <= ROOT_FILES_AT_MOST, f"src/lm/ holds {root}: put each new module in its wing"


OPTIONAL = (
    "lm.numbers.loss_prior",  # forecast models other than the schedule law, and shape priors
    "lm.numbers.reference",  # the reference-curve forecast
    "lm.run.references",
    "lm.interop.harness",  # lm-evaluation-harness (evals= with its tasks)
    "lm.evals",  # benchmarks at milestones (evals=)
    "lm.callbacks.milestone_evals",
    "lm.interop.hf",  # model.init_from (and export, eval, sample)
    "lm.tools",  # the verbs around runs: planner, calibration, ablation, SkyPilot, bench, export
)
"""What the training core loads only when a config or verb asks for it (function-local imports where the
config says so); a plain run's process never imports these."""


def test_the_training_core_loads_optional_features_only_when_asked():
    code = "import sys, lm.run.train, lm.run.build, lm.run.doctor; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    found = [m for m in loaded.stdout.split() if m.startswith(OPTIONAL)]
    assert found == [], f"the training core imports optional features at module level: {found}"


BENCHMARKS = ("lm.evals", "lm.interop.harness", "lm.interop.hf", "lm_eval")
"""What a run without `evals=` never imports: the benchmark wing, lm's lm-eval and transformers adapters and
lm-evaluation-harness (not transformers itself: Lightning's torchmetrics imports it wherever it is installed)."""


def test_a_plain_smoke_run_imports_no_benchmark_module(tmp_path, data_cache):
    """A whole tiny run (train, checkpoints, samples, phases, report) in a fresh process: none of the
    benchmark code is loaded, since the report and the phase table read CORE records through lm.base.scores."""
    from .conftest import CONF, TINY

    overrides = [*TINY, f"run.root={tmp_path}", f"data.cache_dir={data_cache}", "trainer.max_steps=2"]
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from lm.config import register_configs\n"
        "from lm.run.train import main\n"
        "register_configs()\n"
        f"with initialize_config_dir(config_dir={str(CONF)!r}, version_base='1.3'):\n"
        f"    cfg = compose('train', overrides={overrides!r})\n"
        "main(cfg)\n"
        "print('MODULES', ' '.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "smoke" / "report.md").is_file()
    modules = next(line for line in done.stdout.splitlines() if line.startswith("MODULES")).split()[1:]
    assert [m for m in modules if m.startswith(BENCHMARKS)] == []


def test_every_data_file_of_the_package_ships_in_its_wheel():
    """A file under src/lm that is not Python is read at run time (the CORE testbed, the selftest task): a
    regular install carries only what [tool.setuptools.package-data] names, so each must be named there."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((SRC.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["lm"]
    package = SRC / "lm"
    data = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    missing = [f for f in data if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert data and not missing, f"add to [tool.setuptools.package-data] lm in pyproject.toml: {missing}"
