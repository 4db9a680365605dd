"""The house limits of issue 35, measured on src/lm with the standard library only: modules over 600 lines and
functions (methods and nested functions included, def line to last line) over 70.

    python experiments/2026-11-25-house/measure.py [REPO_ROOT] > experiments/2026-11-25-house/before.txt

REPO_ROOT (default: this checkout) is any tree with src/lm, e.g. `git archive <commit> src | tar -x -C /tmp/t`.
"""

import ast
import sys
from pathlib import Path

MODULE_LINES = 600
FUNCTION_LINES = 70
ROOT = Path(__file__).resolve().parents[2]


def measure(root: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int, str, int]], int, int]:
    """(long modules as (path, lines), long functions as (path, line, name, lines), modules, functions)."""
    modules, functions, n_modules, n_functions = [], [], 0, 0
    for path in sorted((root / "src" / "lm").rglob("*.py")):
        rel, text = str(path.relative_to(root)), path.read_text()
        n_modules += 1
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            modules.append((rel, lines))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n_functions += 1
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    functions.append((rel, node.lineno, node.name, length))
    return modules, sorted(functions), n_modules, n_functions


def main() -> int:
    modules, functions, n_modules, n_functions = measure(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print(f"modules over {MODULE_LINES} lines ({len(modules)} of {n_modules}):")
    for rel, lines in sorted(modules, key=lambda m: -m[1]):
        print(f"  {rel}  {lines}")
    print(f"functions over {FUNCTION_LINES} lines ({len(functions)} of {n_functions}):")
    for rel, line, name, length in functions:
        print(f"  {rel}:{line}  {name}  {length}")
    print(
        f"counts: {len(modules)} modules over {MODULE_LINES}, {len(functions)} functions over {FUNCTION_LINES}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
