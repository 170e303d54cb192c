"""
The import graph of the ``tango_fairscale`` package, read from the sources (nothing is imported),
and its cycles.

Every import of a package module counts, module-level or inside a function: a function-local
import hides a cycle from Python but not from the reader. The only imports left out are those
marked ``# lazy: <why>`` on their line, kept off the import path on purpose (an optional heavy
dependency such as DCP). Importing ``a.b`` also imports the package ``a`` (its ``__init__``), so
such an edge counts too.

    python scripts/import_graph.py            # prints the cycles (strongly connected components)
    python scripts/import_graph.py --edges    # and every edge

Exits 1 when there is a cycle; CI runs it through ``tests/test_architecture.py``.
"""

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set

PACKAGE = "tango_fairscale"
ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str) -> str:
    """The absolute name of a relative import ``from <level dots><target> import ...`` in ``module``."""
    if level == 0:
        return target
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def imports_of(path: Path, modules: Set[str], root: Path = ROOT) -> Iterator[str]:
    """The package modules ``path`` imports (lines marked ``# lazy:`` left out)."""
    name = module_name(path, root)
    is_package = path.name == "__init__.py"
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if "# lazy:" in lines[node.lineno - 1]:
            continue
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _resolve(name, is_package, node.level, node.module or "")
            # ``from . import x`` may name a module or an attribute: both are tried.
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for target in targets:
            # The module itself and each enclosing package (whose __init__ runs first).
            parts = target.split(".")
            for end in range(1, len(parts) + 1):
                candidate = ".".join(parts[:end])
                if candidate in modules and candidate != name:
                    yield candidate


def graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    paths = sorted((root / PACKAGE).rglob("*.py"))
    modules = {module_name(path, root) for path in paths}
    edges: Dict[str, Set[str]] = {name: set() for name in modules}
    for path in paths:
        name = module_name(path, root)
        for target in imports_of(path, modules, root):
            # A package's __init__ importing its own submodules is how packages are built, and a
            # submodule importing its enclosing package runs no new code: neither is a cycle.
            if target.startswith(name + ".") or name.startswith(target + "."):
                continue
            edges[name].add(target)
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every edge too")
    args = parser.parse_args()
    edges = graph()
    if args.edges:
        for name in sorted(edges):
            for target in sorted(edges[name]):
                print(f"{name} -> {target}")
    found = cycles(edges)
    for component in found:
        print("cycle among: " + ", ".join(component))
    print(f"{len(edges)} modules, {sum(len(t) for t in edges.values())} imports, {len(found)} cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
