"""
The import graph of the ``tango_fairscale`` package, read from the sources (nothing is imported),
its cycles, and the backends' boundary.

Every import of a package module counts, module-level or inside a function: a function-local
import hides a cycle from Python but not from the reader. The only imports left out are those
marked ``# lazy: <why>`` on their line, kept off the import path on purpose (an optional heavy
dependency such as DCP). Importing ``a.b`` also imports the package ``a`` (its ``__init__``), so
such an edge counts too.

The boundary: everything that knows a backend's library lives in that backend's folder, behind
``Backend`` (``backends/base.py``). Outside ``backends/`` and ``compat.py`` (the integration
boundary, which patches FairScale), no module imports ``fairscale`` or ``torch.distributed.fsdp``;
and neither backend's folder imports the other's. Here every import counts: module-level, inside
a function, under ``TYPE_CHECKING``, marked ``# lazy:`` or not, and ``importlib.import_module`` /
``__import__`` of a literal name. A lazy import still runs the library in that process.

    python scripts/import_graph.py            # prints the cycles (strongly connected components)
                                              # and the imports across the boundary
    python scripts/import_graph.py --edges    # and every edge

Exits 1 when there is a cycle or an import across the boundary; CI runs it through
``tests/test_architecture.py``.
"""

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

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


#: Libraries only a backend (and compat, which patches them) may import.
BACKEND_LIBRARIES = ("fairscale", "torch.distributed.fsdp")
#: The modules allowed to import :data:`BACKEND_LIBRARIES` (and everything under them).
MAY_IMPORT_BACKEND_LIBRARIES = (f"{PACKAGE}.backends", f"{PACKAGE}.compat")
#: Each backend's folder; none imports another's.
BACKEND_FOLDERS = (f"{PACKAGE}.backends.fairscale_fsdp", f"{PACKAGE}.backends.torch_fsdp2")


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def all_imports_of(path: Path, root: Path = ROOT) -> Iterator[Tuple[int, str]]:
    """
    ``(line, module)`` for every module ``path`` imports, of the package or not, ``# lazy:`` or
    not, including ``importlib.import_module("x")`` and ``__import__("x")`` of a literal name.
    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a module).
    """
    name = module_name(path, root)
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module or "")
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def boundary_violations(root: Path = ROOT) -> List[str]:
    """
    One line per import across the backends' boundary (see the module's docstring): a module
    outside ``backends/`` and ``compat.py`` importing a backend's library, or a backend's folder
    importing another backend's.
    """
    found: List[str] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = module_name(path, root)
        where = path.relative_to(root)
        own_folder = next((folder for folder in BACKEND_FOLDERS if _within(name, folder)), None)
        may_import_libraries = any(_within(name, allowed) for allowed in MAY_IMPORT_BACKEND_LIBRARIES)
        reported: Set[int] = set()  # one line per import statement (``from a import b`` yields a and a.b)
        for line, target in all_imports_of(path, root):
            library = next((lib for lib in BACKEND_LIBRARIES if _within(target, lib)), None)
            other = next((f for f in BACKEND_FOLDERS if f != own_folder and _within(target, f)), None)
            if line in reported:
                continue
            if library and not may_import_libraries:
                found.append(
                    f"{where}:{line} imports {target}: only backends/ and compat.py may import {library} "
                    "(reach a backend through backends/lookup.py and Backend)"
                )
                reported.add(line)
            elif own_folder and other:
                found.append(f"{where}:{line} imports {target}: a backend does not import another backend")
                reported.add(line)
    return found


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
    violations = boundary_violations()
    for violation in violations:
        print(violation)
    print(
        f"{len(edges)} modules, {sum(len(t) for t in edges.values())} imports, {len(found)} cycle(s), "
        f"{len(violations)} import(s) across the backends' boundary"
    )
    return 1 if found or violations else 0


if __name__ == "__main__":
    sys.exit(main())
