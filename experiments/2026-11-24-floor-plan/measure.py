"""The floor-plan issue's done-when numbers, read from the tree with `ast`.

    python experiments/2026-11-24-floor-plan/measure.py [src/lm]

Prints the package root's Python files, every module over 600 lines, every function over 70 lines, and the
modules where a function parameter or a field is annotated `LMConfig` (import cycles and upward imports are
tests/test_layers.py's).
"""

import ast
import sys
from pathlib import Path


def main(root: Path) -> None:
    print("root files:", sorted(p.name for p in root.glob("*.py")))
    reach: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 600:
            print("module over 600 lines:", path, len(text.splitlines()))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 > 70:
                    print("function over 70 lines:", path, node.name, node.end_lineno - node.lineno + 1)
                for a in node.args.args + node.args.kwonlyargs:
                    if a.annotation is not None and "LMConfig" in ast.unparse(a.annotation):
                        reach[str(path)] = reach.get(str(path), 0) + 1
            elif isinstance(node, ast.AnnAssign) and "LMConfig" in ast.unparse(node.annotation):
                reach[str(path)] = reach.get(str(path), 0) + 1
    print("LMConfig reaches (module: parameters and fields):", reach)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "src/lm"))
