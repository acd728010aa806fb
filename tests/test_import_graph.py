"""The import graph of `src/tessel`: no cycles, the planner side never imports the runtime, and no
module imports another module's private names.

The graph is read from the source with `ast`, not by importing: an import inside a function counts
(it runs when the function does), one under `if TYPE_CHECKING:` does not (it never runs). Relative
imports are resolved; `from pkg import name` where `pkg.name` is a module counts as importing that
module. Importing `a.b.c` is an edge to `a.b.c` only (not to the packages `a` and `a.b` that Python
also runs first), so a package's `__init__` re-exporting its modules is no cycle by itself.

The runtime side had offenders at the branch point of issue 43; its refactor removed them all, so
the lists of known offenders below are empty, and may get no entry: a new offender fails. (An entry
that no longer matches what the source does fails too.)
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "tessel"
PLANNER_PACKAGES = ("catalog", "cost", "plan", "chunk", "sim")
RUNTIME_PACKAGES = (
    "engine",
    "models",
    "layers",
    "kernels",
    "pipeline",
    "parallel",
    "server",
    "quant",
    "profiling",
    "example_models",
    "commands",
    "cli",
)

# Import cycles on the runtime side (each one strongly connected set of modules): none left.
KNOWN_RUNTIME_LOOPS: tuple[frozenset[str], ...] = ()

# `from X import _name` across modules on the runtime side: (importer, "X._name"), or a private
# module imported from outside its package: (importer, "pkg._module"). None left.
KNOWN_PRIVATE_IMPORTS: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    target: str  # a module of the tree
    line: int


@dataclass(frozen=True, slots=True)
class PrivateImport:
    importer: str
    name: str  # "module._name"
    line: int


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Every module of the tree by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _runtime_nodes(tree: ast.AST):
    """Every node that runs at some point: all of them except the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _base_module(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module lies in (a package's own name for a package)."""
    if modules[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0]


def read_imports(src: Path = SRC) -> tuple[list[Import], list[PrivateImport]]:
    """The import edges between modules of the tree, and the private names imported across them."""
    modules = module_files(src)
    edges: list[Import] = []
    private: list[PrivateImport] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target:
                        edges.append(Import(module, target, node.lineno))
                        if _crosses_private(module, target, modules):
                            private.append(PrivateImport(module, target, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _base_module(module, is_package, node)
                if base.split(".")[0] != ROOT:
                    continue
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        edges.append(Import(module, submodule, node.lineno))
                        if _crosses_private(module, submodule, modules):
                            private.append(PrivateImport(module, submodule, node.lineno))
                    elif base in modules:
                        edges.append(Import(module, base, node.lineno))
                        if _is_private(alias.name):
                            private.append(PrivateImport(module, submodule, node.lineno))
                        elif _crosses_private(module, base, modules):
                            private.append(PrivateImport(module, base, node.lineno))
    return [e for e in edges if e.importer != e.target], private


def _crosses_private(importer: str, target: str, modules: dict[str, Path]) -> bool:
    """Whether `target` is a private module (or lies in one) that `importer` is outside of."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            package = ".".join(parts[:i])  # the package that holds the private module
            return not (importer == package or importer.startswith(package + "."))
    return False


def strongly_connected(edges: list[Import]) -> list[frozenset[str]]:
    """The import cycles: each set of modules that reach one another (Tarjan), larger than one."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []

    for root in sorted(graph):
        if root in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def a_cycle(component: frozenset[str], edges: list[Import]) -> list[str]:
    """One cycle through a strongly connected set, as the modules in import order (the first again
    at the end), each with the line that imports the next."""
    graph: dict[str, dict[str, int]] = {}
    for e in edges:
        if e.importer in component and e.target in component:
            graph.setdefault(e.importer, {}).setdefault(e.target, e.line)
    start = min(component)
    # breadth-first from start back to start: the shortest cycle through it
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, {})):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    path.reverse()
                    path.append(start)
                    return [f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:], strict=False)] + [
                        start
                    ]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return sorted(component)


@cache
def _source_graph() -> tuple[list[Import], list[PrivateImport]]:
    """The imports of `src/tessel`, read once for all the tests below."""
    return read_imports()


def _side(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    if parts[1] in PLANNER_PACKAGES:
        return "planner"
    if parts[1] in RUNTIME_PACKAGES:
        return "runtime"
    return None


def test_no_import_cycles() -> None:
    edges, _ = _source_graph()
    offences = []
    for component in strongly_connected(edges):
        if any(component <= known for known in KNOWN_RUNTIME_LOOPS):
            continue
        offences.append(" -> ".join(a_cycle(component, edges)))
    assert not offences, "import cycles:\n" + "\n".join(sorted(offences))


def test_known_runtime_loops_still_exist() -> None:
    """Each allowed loop is still exactly a cycle of the source: when one is broken or shrinks, its
    entry goes or shrinks with it."""
    edges, _ = _source_graph()
    components = strongly_connected(edges)
    stale = [sorted(known) for known in KNOWN_RUNTIME_LOOPS if known not in components]
    now = [sorted(c) for c in components if any(c <= known for known in KNOWN_RUNTIME_LOOPS)]
    assert not stale, f"KNOWN_RUNTIME_LOOPS entries no longer cycles: {stale}; the cycles now: {now}"
    assert all(_side(m) == "runtime" for known in KNOWN_RUNTIME_LOOPS for m in known)


def test_planner_side_imports_no_runtime() -> None:
    edges, _ = _source_graph()
    offences = [
        f"{e.importer} (line {e.line}) imports {e.target}"
        for e in edges
        if _side(e.importer) == "planner" and _side(e.target) == "runtime"
    ]
    assert not offences, "the planner side imports the runtime:\n" + "\n".join(offences)


def test_no_private_imports_across_modules() -> None:
    _, private = _source_graph()
    offences = [
        f"{p.importer} (line {p.line}) imports {p.name}"
        for p in private
        if (p.importer, p.name) not in KNOWN_PRIVATE_IMPORTS
    ]
    assert not offences, "private names imported from another module:\n" + "\n".join(sorted(offences))


def test_known_private_imports_still_exist() -> None:
    _, private = _source_graph()
    present = {(p.importer, p.name) for p in private}
    stale = sorted(KNOWN_PRIVATE_IMPORTS - present)
    assert not stale, f"KNOWN_PRIVATE_IMPORTS entries no longer in the source: {stale}"
    assert all(_side(importer) == "runtime" for importer, _ in KNOWN_PRIVATE_IMPORTS)


# -- the reader itself, on small trees ---------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_reader_counts_function_imports_not_type_checking(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from tessel import b\n",
            "b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tessel.a import f\n"
                "else:\n    import tessel.c\n"
            ),
            "c.py": "from .a import f\n",
        },
    )
    edges, _ = read_imports(src)
    assert {(e.importer, e.target) for e in edges} == {
        ("tessel.a", "tessel.b"),
        ("tessel.b", "tessel.c"),
        ("tessel.c", "tessel.a"),
    }
    (component,) = strongly_connected(edges)
    assert component == {"tessel.a", "tessel.b", "tessel.c"}
    cycle = a_cycle(component, edges)
    assert cycle[0].startswith("tessel.a ") and cycle[-1] == "tessel.a" and len(cycle) == 4


def test_reader_private_names_and_modules(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "k/__init__.py": "",
            "k/_utils.py": "X = 1\n",
            "k/op.py": "from tessel.k import _utils\nfrom ._utils import X\n",
            "p/__init__.py": "",
            "p/m.py": "_hidden = 1\n__version__ = 2\n",
            "p/n.py": "from tessel.p.m import _hidden, __version__\nfrom tessel.k._utils import X\n",
        },
    )
    _, private = read_imports(src)
    assert {(p.importer, p.name) for p in private} == {
        ("tessel.p.n", "tessel.p.m._hidden"),
        ("tessel.p.n", "tessel.k._utils"),
    }
