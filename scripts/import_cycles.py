"""Fail when the modules of ``src/octlm`` import each other in a cycle, import up the layers
of :data:`LAYERS`, import the lab from the product, or reach past a door.

Reads every module with ``ast`` (nothing is imported, so it runs without torch) and counts every
``import`` statement: at the top, inside functions and under ``TYPE_CHECKING`` alike, since
each one ties the two files together for a reader. ``from package import name`` points at the
submodule when ``name`` is one, else at the package's ``__init__``. A package's ``__init__``
imports what it imports, and also each module its text names in a string of its own (the
table of a lazy ``__getattr__``). A parent package that Python initialises on the way to a
submodule is not an edge of its own.

:data:`LAYERS` is the order of docs/design.md, 'Layout', from the leaves up to the command
line: a module imports its own layer and those below, never one above, and every module has a
layer. The lab (``octlm.lab``: benchmarks, report, verify) may import the product; no module
outside it may import the lab, but the command line (:data:`DOORS`), which is the door to both.
A module of :data:`PRIVATE` is imported only by the modules named beside it.

    python scripts/import_cycles.py [SRC]     # exit 0, or 1 and every fault found
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAB = "octlm.lab"
# The modules outside the lab that may import it: the command line reaches the lab's verbs.
DOORS = ("octlm.cli", "octlm.__main__")
# The layers, from the leaves up: each name is a module and every module below it. ``octlm``
# (the package's own names, each loaded on first use) stands for its ``__init__`` alone.
LAYERS = (
    (
        "octlm.equality", "octlm.files", "octlm.machine", "octlm.records", "octlm.memory",
        "octlm.signals", "octlm.progress", "octlm.context_parallel", "octlm.chatml",
    ),
    ("octlm.attention",),
    ("octlm.tokenizer",),
    ("octlm.integrations",),
    ("octlm.model",),
    ("octlm.training",),
    ("octlm.export", "octlm.chat"),
    ("octlm.lab",),
    ("octlm", "octlm.cli", "octlm.__main__"),
)  # fmt: skip
# module -> the only modules that may import it: the tiled engines sit behind their door.
PRIVATE = {
    "octlm.attention.tiled.whole": ("octlm.attention.tiled.engine",),
    "octlm.attention.tiled.walk": (
        "octlm.attention.tiled.engine",
        "octlm.attention.tiled.walk_backward",
    ),
    "octlm.attention.tiled.walk_backward": ("octlm.attention.tiled.engine",),
}


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
        if path.name == "__init__.py" and isinstance(node, ast.Constant):
            if isinstance(node.value, str) and node.value in known:  # a lazy table's entry
                targets.add(node.value)
        elif isinstance(node, ast.Import):
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


def layer(name: str) -> int | None:
    """The index in :data:`LAYERS` of the layer that holds module ``name``, if any."""
    for index, names in enumerate(LAYERS):
        for top in names:
            if name == top or (top != "octlm" and name.startswith(top + ".")):
                return index
    return None


def layer_faults(graph: dict[str, set[str]], named: set[tuple[str, str]]) -> list[str]:
    """Every module in no layer, and every import of a higher layer than the importer's but
    those ``named`` already."""
    faults = [f"{name} is in no layer of LAYERS" for name in sorted(graph) if layer(name) is None]
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if (name, target) in named or None in (layer(name), layer(target)):
                continue
            if layer(target) > layer(name):
                faults.append(f"{name} imports {target}, a higher layer")
    return faults


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a :data:`PRIVATE` module by a module not named beside it."""
    return [
        f"{name} imports {target}, which only {', '.join(PRIVATE[target])} may"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if target in PRIVATE and name not in PRIVATE[target]
    ]


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
    faults = private_imports(graph)
    if any(name.startswith("octlm.") for name in known):  # the layers are octlm's
        faults = layer_faults(graph, set(crossing)) + faults
    for fault in faults:
        print(fault, file=sys.stderr)
    if found or crossing or faults:
        return 1
    edges = sum(len(targets) for targets in graph.values())
    print(
        f"no import cycle among {len(known)} modules ({edges} imports), none up the "
        f"{len(LAYERS)} layers, none past a door"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
