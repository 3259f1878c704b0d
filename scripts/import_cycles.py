"""Fail when the modules of ``src/octlm`` import each other in a cycle, or the product imports
the lab.

Reads every module with ``ast`` (nothing is imported, so it runs without torch) and counts every
``import`` statement: at the top, inside functions and under ``TYPE_CHECKING`` alike, since
each one ties the two files together for a reader. ``from package import name`` points at the
submodule when ``name`` is one, else at the package's ``__init__``. A parent package that
Python initialises on the way to a submodule is not an edge of its own.

The lab (``octlm.lab``: benchmarks, report, verify) may import the product; no module outside
it may import the lab, but the command line (:data:`DOORS`), which is the door to both.

    python scripts/import_cycles.py [SRC]     # exit 0, or 1 and every cycle or lab import
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAB = "octlm.lab"
# The modules outside the lab that may import it: the command line reaches the lab's verbs.
DOORS = ("octlm.cli", "octlm.__main__")


def modules(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (the folder that holds the top package), by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return {target for target in targets if target in known and target != name}


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module: each is a set
    of modules that reach each other through imports (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def lab_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(module, lab module)`` for every import of the lab from outside it."""

    def in_lab(name: str) -> bool:
        return name == LAB or name.startswith(LAB + ".")

    return sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if in_lab(target) and not in_lab(name) and name not in DOORS
    )


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "src"
    known = modules(root)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found = knots(graph)
    for component in found:
        print("import cycle among: " + ", ".join(component), file=sys.stderr)
    crossing = lab_imports(graph)
    for name, target in crossing:
        print(f"{name} imports the lab: {target}", file=sys.stderr)
    if found or crossing:
        return 1
    edges = sum(len(targets) for targets in graph.values())
    print(f"no import cycle among {len(known)} modules ({edges} imports)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
