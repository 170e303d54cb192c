"""
The import graph of the ``tango_fairscale`` package, read from the sources (nothing is imported),
its cycles, and the backends' boundary.

Every import of a package module counts, module-level or inside a function, with no escape
hatch: a function-local import hides a cycle from Python but not from the reader, and one that
only runs later still ties the two modules together. Importing ``a.b`` also imports the package
``a`` (its ``__init__``), so such an edge counts too. ``importlib.import_module`` of a literal
name counts as an import; the backends' lookup names its modules as strings, which is how it
reaches them without being imported by them.

The boundary: everything that knows a backend's library lives in that backend's folder, behind
``Backend`` (``backends/base.py``). Outside ``backends/`` and ``compat/`` (the integration
boundary, which patches FairScale), no module imports ``fairscale`` or ``torch.distributed.fsdp``;
and neither backend's folder imports the other's. Here every import counts: module-level, inside
a function, under ``TYPE_CHECKING``, and ``importlib.import_module`` /
``__import__`` of a literal name. A lazy import still runs the library in that process.

    python scripts/import_graph.py            # prints the cycles (strongly connected components)
                                              # and the imports across the boundary
    python scripts/import_graph.py --edges    # and every edge
    python scripts/import_graph.py --layers   # and the folder-level graph (docs/architecture.md,
                                              # "Layers"): which folder imports which, how often

Exits 1 when there is a cycle or an import across the boundary; CI runs it through
``tests/test_architecture.py``.
"""

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

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
    """The package modules ``path`` imports, at any depth of the file."""
    name = module_name(path, root)
    is_package = path.name == "__init__.py"
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
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
    ``(line, module)`` for every module ``path`` imports, of the package or not, at any depth,
    including ``importlib.import_module("x")`` and ``__import__("x")`` of a literal name.
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
    outside ``backends/`` and ``compat/`` importing a backend's library, or a backend's folder
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
                    f"{where}:{line} imports {target}: only backends/ and compat/ may import {library} "
                    "(reach a backend through backends/lookup.py and Backend)"
                )
                reported.add(line)
            elif own_folder and other:
                found.append(f"{where}:{line} imports {target}: a backend does not import another backend")
                reported.add(line)
    return found


#: Where a backend may be named: its own folder, and the lookup that chooses one (both in backends/).
NAMES_BACKENDS = f"{PACKAGE}.backends"


def backend_names(root: Path = ROOT) -> Set[str]:
    """The backends' names, read from ``backends/lookup.py``'s table (the keys of ``_IMPLEMENTATIONS``)."""
    tree = ast.parse((root / PACKAGE / "backends" / "lookup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_IMPLEMENTATIONS":
            assert isinstance(node.value, ast.Dict)
            return {
                key.value
                for key in node.value.keys
                if isinstance(key, ast.Constant) and isinstance(key.value, str)
            }
    raise SystemExit("backends/lookup.py has no _IMPLEMENTATIONS table")


def _mentions_backend(node: ast.AST) -> bool:
    """Whether ``node`` is a name, attribute or ``"backend"`` key that holds a backend's name."""
    if isinstance(node, ast.Name):
        return "backend" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "backend" in node.attr.lower()
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "backend"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "backend"
    return False


def _named(node: Optional[ast.AST], names: Set[str]) -> bool:
    """Whether ``node`` is a backend's name as a literal (or a tuple, list or set of them)."""
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_named(element, names) for element in node.elts)
    return False


def backend_name_uses(path: Path, names: Set[str]) -> Iterator[Tuple[int, str]]:
    """
    ``(line, what)`` for each place ``path`` decides on a backend's name: a comparison of a
    backend with a backend's literal name, a backend's name given as a default (``x.get("backend",
    "fairscale")``, ``backend: str = "fairscale"``, ``def f(backend="torch")``), or assigned to a
    backend.
    """
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_mentions_backend(side) for side in sides) and any(_named(side, names) for side in sides):
                yield node.lineno, "compares a backend with a backend's name"
        elif isinstance(node, ast.Call) and _mentions_backend(node) and len(node.args) > 1:
            if _named(node.args[1], names):
                yield node.lineno, "gives a backend's name as the default of a backend"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_mentions_backend(t) for t in targets) and _named(node.value, names):
                yield node.lineno, "assigns a backend's name to a backend"
        elif (
            isinstance(node, ast.keyword) and node.arg and "backend" in node.arg and _named(node.value, names)
        ):
            yield node.value.lineno, "passes a backend's name as a backend"
        elif isinstance(node, ast.arguments):
            positional = [*node.posonlyargs, *node.args]
            pairs = list(zip(positional[len(positional) - len(node.defaults) :], node.defaults))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            for argument, default in pairs:
                if "backend" in argument.arg and _named(default, names):
                    yield default.lineno, "gives a backend's name as the default of a backend"


def backend_knowledge_outside_backends(root: Path = ROOT) -> Tuple[List[str], int]:
    """
    One line per place outside ``backends/`` that names a backend (compares or defaults a
    backend's name, see :func:`backend_name_uses`) or imports a backend's folder; and how many
    modules the rule left out (those under ``backends/``, where a backend is named on purpose).
    """
    names = backend_names(root)
    found: List[str] = []
    exempt = 0
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = module_name(path, root)
        if _within(name, NAMES_BACKENDS):
            exempt += 1
            continue
        where = path.relative_to(root)
        for line, what in backend_name_uses(path, names):
            found.append(f"{where}:{line} {what}: ask the backend (backends/lookup.py, Backend)")
        reported: Set[int] = set()
        for line, target in all_imports_of(path, root):
            folder = next((f for f in BACKEND_FOLDERS if _within(target, f)), None)
            if folder and line not in reported:
                found.append(f"{where}:{line} imports {target}: reach a backend through backends/lookup.py")
                reported.add(line)
    return found, exempt


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


#: The group of every module directly in the package (engine, options, wrapping, ...): not a folder.
CORE = "core"


def group_of(name: str, root: Path = ROOT) -> str:
    """The folder under the package that holds module ``name``, or :data:`CORE` for a top-level one."""
    parts = name.split(".")
    if len(parts) > 1 and (root / PACKAGE / parts[1]).is_dir():
        return parts[1]
    return CORE


LayerEdges = Dict[Tuple[str, str], List[Tuple[str, str]]]


def layers(edges: Optional[Dict[str, Set[str]]] = None, root: Path = ROOT) -> LayerEdges:
    """
    The folder-level graph: for each pair of groups (:func:`group_of`) with an import from one to
    the other, the module imports that make it, ``(importer, imported)`` without the package name.
    Importing ``p.x`` also imports ``p``: that edge is left out where the same module imports
    ``p.x``, so that one import statement counts once. Imports within a group are not listed.
    """
    edges = graph(root) if edges is None else edges
    found: LayerEdges = {}
    for name in sorted(edges):
        targets = edges[name]
        for target in sorted(targets):
            if any(other.startswith(target + ".") for other in targets):
                continue  # the enclosing package of another module it imports
            pair = (group_of(name, root), group_of(target, root))
            if pair[0] != pair[1]:
                short = (name[len(PACKAGE) + 1 :], target[len(PACKAGE) + 1 :])
                found.setdefault(pair, []).append(short)
    return dict(sorted(found.items()))


def format_layers(found: LayerEdges, root: Path = ROOT) -> List[str]:
    """
    :func:`layers` as stable text: the top-level modules that make up :data:`CORE`, then one line
    per group edge with its count of module imports, naming the core modules on the core side.
    """
    core = sorted(
        name[len(PACKAGE) + 1 :] for name in graph(root) if name != PACKAGE and group_of(name, root) == CORE
    )
    lines = [f"{CORE} = {', '.join(core)}"]
    for (source, target), imports in found.items():
        line = f"{source} -> {target}: {len(imports)}"
        if CORE in (source, target):
            side = 0 if source == CORE else 1
            named = sorted({pair[side] for pair in imports})
            line += (" by " if side == 0 else " of ") + ", ".join(named)
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every edge too")
    parser.add_argument("--layers", action="store_true", help="print the folder-level graph too")
    args = parser.parse_args()
    edges = graph()
    if args.edges:
        for name in sorted(edges):
            for target in sorted(edges[name]):
                print(f"{name} -> {target}")
    if args.layers:
        for line in format_layers(layers(edges)):
            print(line)
    found = cycles(edges)
    for component in found:
        print("cycle among: " + ", ".join(component))
    violations = boundary_violations()
    for violation in violations:
        print(violation)
    named, exempt = backend_knowledge_outside_backends()
    for line in named:
        print(line)
    print(
        f"{len(edges)} modules, {sum(len(t) for t in edges.values())} imports, {len(found)} cycle(s), "
        f"{len(violations)} import(s) across the backends' boundary, {len(named)} use(s) of a backend's "
        f"name or module outside backends/ ({exempt} modules under backends/ not checked)"
    )
    return 1 if found or violations or named else 0


if __name__ == "__main__":
    sys.exit(main())
