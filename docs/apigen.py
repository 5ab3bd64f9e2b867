"""Writes the API reference pages (``api/*.rst``) from the packages' ``__all__`` before Sphinx reads them.

One page per public module (no part of its name starts with ``_``) of ``bridgeflow`` and
``bridgeflow.adapters``. A name is described once, on the page of the module that defines it (or, for a
name defined in a private module, of the first public module that exports it); the other modules that
export it list it in a table linking there. So ``bridgeflow.MapData`` is described on the
``bridgeflow.transforms`` page and linked from the ``bridgeflow`` page, and nothing is described twice. A
docstring's reference to an exported name (``bridgeflow.MapData``, or ``MapData`` alone) links there too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from types import ModuleType

PACKAGES = ("bridgeflow", "bridgeflow.adapters")
SKIP = {"bridgeflow.__main__"}


def _private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split("."))


def public_modules() -> list[str]:
    names = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            if info.name not in SKIP and not _private(info.name):
                names.append(info.name)
    return names


def defined_names(module: ModuleType) -> set[str]:
    """Names the module's own source binds at its top level (classes, functions, assignments)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def exported(module: ModuleType) -> list[str]:
    return [n for n in getattr(module, "__all__", []) if not inspect.ismodule(getattr(module, n, None))]


def _key(obj: object, name: str) -> object:
    """Classes and functions are the same object wherever exported; a value (``1``, ``"lmdb"``) may be
    shared by unrelated names, so it counts as the same only under the same name."""
    return id(obj) if inspect.isclass(obj) or inspect.isroutine(obj) else (name, id(obj))


def homes(modules: list[str]) -> dict[tuple[str, str], str]:
    """For each (module, name) exported, the public module whose page describes the name."""
    loaded = {m: importlib.import_module(m) for m in modules}
    defined = {m: defined_names(module) for m, module in loaded.items()}
    home_of: dict[object, str] = {}
    for m, module in loaded.items():  # where the public source defines it
        for name in exported(module):
            obj = getattr(module, name)
            if name in defined[m] and getattr(obj, "__name__", name) == name:  # not an alias (load = ...)
                home_of.setdefault(_key(obj, name), f"{m}.{name}")
    for m in sorted(loaded, key=lambda m: (m.count("."), m)):  # defined in a private module: its first exporter
        for name in exported(loaded[m]):
            home_of.setdefault(_key(getattr(loaded[m], name), name), f"{m}.{name}")
    result = {}
    for m, module in loaded.items():
        for name in exported(module):
            here = name in defined[m]
            result[(m, name)] = f"{m}.{name}" if here else home_of[_key(getattr(module, name), name)]
    return result


def _directive(obj: object) -> str:
    """The autodoc directive that describes ``obj``."""
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    return "autofunction" if inspect.isroutine(obj) else "autodata"


def module_page(name: str, home: dict[tuple[str, str], str]) -> str:
    module = importlib.import_module(name)
    here = [n for n in exported(module) if home[(name, n)] == f"{name}.{n}"]
    elsewhere = [home[(name, n)] for n in exported(module) if home[(name, n)] != f"{name}.{n}"]
    lines = [name, "=" * len(name), "", f".. automodule:: {name}", ""]
    for n in here:
        obj = getattr(module, n)
        directive = _directive(obj)
        if directive == "autodata":  # a constant: its value (autodoc would show its type's docstring)
            value = repr(obj)
            lines += [f".. py:data:: {n}", f"   :value: {value}" if len(value) <= 80 else
                      f"   :type: {type(obj).__name__}"]
        else:
            lines += [f".. {directive}:: {n}"]
        if directive in ("autoclass", "autoexception"):
            lines += ["   :members:", "   :show-inheritance:"]
        lines += [""]
    if elsewhere:
        lines += [".. rubric:: Exported here, described where they are defined", "",
                  ".. currentmodule:: None", "", ".. autosummary::", ""]
        lines += [f"   ~{target}" for target in elsewhere]
    return "\n".join(lines) + "\n"


def index_page(modules: list[str]) -> str:
    lines = ["API reference", "=============", "",
             "Generated from the docstrings: one page per public module, the names of its ``__all__``. "
             "Most names are also exported by ``bridgeflow`` itself (and, under tensorpack's names, by "
             "``bridgeflow.dataflow``).", ""]
    groups: dict[str, list[str]] = {}
    for m in modules:
        parts = m.split(".")
        key = ".".join(parts[:3]) if parts[1:2] == ["adapters"] else ".".join(parts[:2])
        groups.setdefault(key, []).append(m)
    lines += [".. toctree::", "   :maxdepth: 1", ""]
    for key in sorted(groups, key=lambda k: (k != "bridgeflow", k.startswith("bridgeflow.adapters"), k)):
        lines += [f"   {m}" for m in groups[key]]
    return "\n".join(lines) + "\n"


def write_pages(out_dir: Path) -> dict[str, str]:
    """Write ``index.rst`` and one page per module into ``out_dir``; returns :func:`aliases`."""
    modules = public_modules()
    home = homes(modules)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = {f"{m}.rst": module_page(m, home) for m in modules}
    wanted["index.rst"] = index_page(modules)
    for stale in out_dir.glob("*.rst"):
        if stale.name not in wanted:
            stale.unlink()
    for file_name, text in wanted.items():
        path = out_dir / file_name
        if not path.exists() or path.read_text() != text:  # unchanged pages keep their time: no rebuild
            path.write_text(text)
    return aliases(home)


def aliases(home: dict[tuple[str, str], str]) -> dict[str, str]:
    """Other names of the described objects: ``bridgeflow.WorkerError`` (an export) and ``WorkerError`` (the
    bare name, when only one object has it), each mapped to the name it is described under."""
    out = {f"{m}.{name}": target for (m, name), target in home.items() if f"{m}.{name}" != target}
    bare: dict[str, set[str]] = {}
    for target in set(home.values()):
        bare.setdefault(target.rsplit(".", 1)[1], set()).add(target)
    out.update({name: targets.pop() for name, targets in bare.items() if len(targets) == 1})
    return out


def setup(app):  # a Sphinx extension: the pages exist before Sphinx looks for source files
    found: dict[str, str] = {}

    def generate(app, config) -> None:
        found.update(write_pages(Path(app.srcdir) / "api"))

    def resolve(app, env, node, contnode):
        """Docstrings name objects as users import them (``:class:`~bridgeflow.WorkerError```, or bare):
        send such a reference to where the object is described."""
        target = found.get(node.get("reftarget", ""))
        if node.get("refdomain") != "py" or target is None:
            return None
        node["reftarget"] = target
        return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"], target,
                                                 node, contnode)

    app.connect("config-inited", generate)
    app.connect("missing-reference", resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
