"""No import cycles among bridgeflow's modules, function-level imports included.

Every ``import`` and ``from ... import`` in every module under ``bridgeflow/`` and ``adapters/`` (installed as
``bridgeflow.adapters``) is read from the source, wherever it stands: at the top, in a function, in a
``try``. Only imports under ``if TYPE_CHECKING:`` are left out, since they never run. An import of a module
inside bridgeflow is an edge of a graph; a cycle in that graph is a cycle a reader has to untangle, and a
lazy import that hides one is still one. Lazy imports stay for optional dependencies only, which are not
bridgeflow's modules and so not in the graph.

Importing ``pkg.sub.mod`` first runs ``pkg/__init__`` and ``pkg/sub/__init__``: an import is also an edge to
each package above its target that the importer is not inside (the importer's own packages have started
before it runs). Without these edges, a function of ``bridgeflow._state`` that imported the codec from
``bridgeflow.serialize`` looked harmless, while it ran ``serialize/__init__``, whose readers import the flows,
which import ``_state``: a cycle of 24 modules.
"""

from __future__ import annotations

import ast
import os

import pytest

from conftest import source_tree

ROOT = source_tree()
PACKAGES = {"bridgeflow": os.path.join(ROOT, "bridgeflow"), "bridgeflow.adapters": os.path.join(ROOT, "adapters")}


def modules() -> dict[str, str]:
    """``{module name: path}`` of every module of the two trees."""
    out = {}
    for package, folder in PACKAGES.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
            rel = os.path.relpath(dirpath, folder)
            parts = [package] + ([] if rel == "." else rel.split(os.sep))
            for name in filenames:
                if name.endswith(".py"):
                    stem = name[:-3]
                    out[".".join(parts if stem == "__init__" else [*parts, stem])] = os.path.join(dirpath, name)
    return out


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str, path: str, known: set[str]) -> set[str]:
    """The bridgeflow modules ``module`` imports anywhere in its source."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if _type_checking_block(node):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # "from pkg import name": the module pkg.name if there is one, else pkg (name is defined there)
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "import a.b.c" or a name of a.b: the nearest module
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
                found.update(p for p in parents(target) if p != module and p not in parents(module))
    return found


def parents(module: str) -> list[str]:
    """The packages above ``module``, which Python runs before it (``a.b.c``: ``a``, ``a.b``)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_function_level_and_relative_imports():
    edges = graph()
    assert len(edges) > 100
    assert "bridgeflow._base" in edges["bridgeflow._transforms"]  # from .base import ...
    assert "bridgeflow.parallel._transport.pool" in edges["bridgeflow.parallel._stages"]  # from .pool import ...
    assert "bridgeflow._demo" in edges["bridgeflow.cli"]  # imported inside a function
    assert "bridgeflow.engine" in edges["bridgeflow.adapters.torch._loader"]  # the adapters, by their package name
    # the packages Python runs first: parallel/__init__ and parallel/_transport/__init__ before the pool...
    assert {"bridgeflow.parallel", "bridgeflow.parallel._transport"} <= edges["bridgeflow.engine"]
    # ...but not a package the importer is inside, which started before it
    assert "bridgeflow.parallel" not in edges["bridgeflow.parallel._stages"]


def test_parents():
    assert parents("bridgeflow.parallel._transport.pool") == ["bridgeflow", "bridgeflow.parallel",
                                                              "bridgeflow.parallel._transport"]
    assert parents("bridgeflow") == []


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("tree", ["bridgeflow", "bridgeflow.adapters"])
def test_no_import_cycles(tree):
    """The core (``bridgeflow/``, which never imports the adapters) and the adapters, each on its own."""
    edges = graph()
    adapters = tree == "bridgeflow.adapters"
    found = [c for c in cycles(edges) if all(m.startswith("bridgeflow.adapters.") for m in c) == adapters]
    described = ["\n  ".join(f"{m} -> {sorted(set(c) & edges[m])}" for m in c) for c in found]
    assert not found, f"{len(found)} import cycle(s):\n  " + "\n\n  ".join(described)
