"""Writes the API reference (``api/*.rst``) from the table in ``api_pages.py`` before Sphinx reads the pages.

The reference describes each public object once, under the name users import (``bridgeflow.LMDBSerializer``,
``bridgeflow.adapters.torch.DataLoader``), on the page of its concept; the entry lists the object's other
import paths (``bridgeflow.serialize.LMDBSerializer``, ``bridgeflow.dataflow.LMDBSerializer``). Modules
outside ``api_pages.NAMESPACES`` are internal: they get one line each in a module map for contributors
(``api/internals.rst``), not entries.

A docstring's cross-reference may name an object by any of its paths (``bridgeflow.serialize._lmdb_format.
LMDBSerializer``, ``._pinning.SlabPinner``, or a bare ``WorkerError``): :func:`setup` sends each to the entry
(or, for an internal object, to its module in the module map), and a reference that names a ``bridgeflow``
path and leads nowhere is a warning, so the ``-W`` build fails on it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from api_pages import NAMESPACES, PAGES

ROOTS = ("bridgeflow", "bridgeflow.adapters")
SKIP = {"bridgeflow.__main__"}  # running it is the command line


def key(obj: object, name: str) -> object:
    """What makes two exports the same entry: a class or function is one object wherever it is exported; a
    value (``1``, ``"lmdb"``) may be shared by unrelated names, so it is the same only under the same name."""
    return id(obj) if inspect.isclass(obj) or inspect.isroutine(obj) else (name.rsplit(".", 1)[-1], id(obj))


def exports(namespaces: tuple[str, ...]) -> dict[str, object]:
    """Every ``namespace.name`` of the namespaces' ``__all__`` (modules aside: they are namespaces), in order."""
    out = {}
    for ns in namespaces:
        module = importlib.import_module(ns)
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.ismodule(obj):
                out[f"{ns}.{name}"] = obj
    return out


def listed() -> list[tuple[str, str, str]]:
    """The table's names in page order: ``(page, section, path)``."""
    return [(page, section, path) for page, (_, _, sections) in PAGES.items()
            for section, paths in sections.items() for path in paths]


@dataclass
class Plan:
    """The reference's entries, each object's other import paths, and what is wrong with the table."""

    entries: dict[str, object] = field(default_factory=dict)  # path -> object, in the table's order
    page_of: dict[str, str] = field(default_factory=dict)  # path -> page
    aliases: dict[str, list[str]] = field(default_factory=dict)  # entry path -> its other public paths
    problems: list[str] = field(default_factory=list)


def plan(namespaces: tuple[str, ...] = NAMESPACES) -> Plan:
    """Check the table against the namespaces' ``__all__`` and pair each export with its entry.

    With fewer namespaces than ``NAMESPACES`` (an install without torch or TensorFlow), the table's names
    of the others are not checked.
    """
    out = Plan()
    exported = exports(namespaces)
    entry_of: dict[object, str] = {}
    for page, section, path in listed():
        ns = path.rsplit(".", 1)[0]
        if ns not in NAMESPACES:
            out.problems.append(f"{path} ({page}: {section}): {ns} is not one of the public NAMESPACES")
            continue
        if ns not in namespaces:
            continue
        if path in out.entries:
            out.problems.append(f"{path} is listed twice (page {out.page_of[path]!r} and page {page!r})")
            continue
        if path not in exported:
            out.problems.append(f"{path} ({page}: {section}) is not in {ns}.__all__")
            continue
        k = key(exported[path], path)
        if k in entry_of:
            out.problems.append(f"{path} ({page}: {section}) is listed twice: it is {entry_of[k]}")
            continue
        entry_of[k] = path
        out.entries[path], out.page_of[path], out.aliases[path] = exported[path], page, []
    for path, obj in exported.items():
        entry = entry_of.get(key(obj, path))
        if entry is None:
            out.problems.append(f"{path} is exported but not in docs/api_pages.py: add it to a page's section")
        elif entry != path:
            out.aliases[entry].append(path)
    return out


# -- the pages ------------------------------------------------------------------------------------------


def _heading(text: str, char: str) -> list[str]:
    return [text, char * len(text), ""]


def _is_value(obj: object) -> bool:
    return not (inspect.isclass(obj) or inspect.isroutine(obj))


def _entry(path: str, obj: object, aliases: list[str]) -> list[str]:
    """The directive that describes ``obj`` under ``path``, with its other import paths after the docstring."""
    if _is_value(obj):  # a constant: its value (autodoc would show its type's docstring)
        value = repr(obj)
        lines = [f".. py:data:: {path}", f"   :value: {value}" if len(value) <= 80 else
                 f"   :type: {type(obj).__name__}"]
    elif inspect.isclass(obj):
        directive = "autoexception" if issubclass(obj, BaseException) else "autoclass"
        lines = [f".. {directive}:: {path}", "   :members:", "   :show-inheritance:"]
    else:
        lines = [f".. autofunction:: {path}"]
    if aliases:
        lines += ["", "   *Also importable as* " + ", ".join(f"``{a}``" for a in aliases) + "."]
    return lines + [""]


def _summary(paths: list[str], entries: dict[str, object]) -> list[str]:
    named = [p for p in paths if not _is_value(entries[p])]
    if not named:
        return []
    return [".. autosummary::", "   :nosignatures:", ""] + [f"   ~{p}" for p in named] + [""]


def _renamed(paths: list[str], the_plan: Plan) -> list[str]:
    """A sentence naming the page's objects' other names (tensorpack's ``PrefetchData``...)."""
    pairs = dict.fromkeys((alias.rsplit(".", 1)[1], path) for path in paths for alias in the_plan.aliases[path]
                          if alias.rsplit(".", 1)[1] != path.rsplit(".", 1)[1])
    if not pairs:
        return []
    return ["Other names: " + "; ".join(f"``{alias}`` is :obj:`~{path}`" for alias, path in pairs) + ".", ""]


def namespace_homes(the_plan: Plan) -> dict[str, str]:
    """The page that introduces each namespace (where ``:mod:`bridgeflow.imgaug``` links): the page of its
    first entry; ``bridgeflow`` and ``bridgeflow.dataflow`` are the reference's index."""
    homes = {"bridgeflow": "index", "bridgeflow.dataflow": "index"}
    for path in list(the_plan.entries) + [a for aliases in the_plan.aliases.values() for a in aliases]:
        ns = path.rsplit(".", 1)[0]
        entry = path if path in the_plan.entries else next(e for e, al in the_plan.aliases.items() if path in al)
        homes.setdefault(ns, the_plan.page_of[entry])
    return homes


def concept_page(page: str, the_plan: Plan, homes: dict[str, str]) -> str:
    title, intro, sections = PAGES[page]
    lines = _heading(title, "=")
    lines += [f".. py:module:: {ns}" for ns, home in homes.items() if home == page] + [""]
    lines += [".. currentmodule:: None", ""]  # the entries name their namespace
    lines += [line.strip() for line in intro.strip().splitlines()] + [""]
    paths = [p for names in sections.values() for p in names if p in the_plan.entries]
    lines += _summary(paths, the_plan.entries) + _renamed(paths, the_plan)
    for section, names in sections.items():
        names = [p for p in names if p in the_plan.entries]
        if names:
            if len(sections) > 1:
                lines += _heading(section, "-")
            for path in names:
                lines += _entry(path, the_plan.entries[path], the_plan.aliases[path])
    if page == "errors":
        lines += _other_errors(the_plan)
    if page == "cli":
        lines += _cli_help()
    return "\n".join(lines).rstrip() + "\n"


def _other_errors(the_plan: Plan) -> list[str]:
    rows = [(path, PAGES[the_plan.page_of[path]][0]) for path, obj in the_plan.entries.items()
            if inspect.isclass(obj) and issubclass(obj, BaseException) and the_plan.page_of[path] != "errors"]
    lines = _heading("Errors and warnings of each area", "-") + [".. list-table::", "   :header-rows: 1", "",
                                                                  "   * - Error or warning", "     - Page"]
    for path, title in rows:
        lines += [f"   * - :exc:`~{path}`", f"     - :doc:`{title} <{the_plan.page_of[path]}>`"]
    return lines + [""]


def _cli_help() -> list[str]:
    """Each command's ``--help``, as the installed parser prints it at 100 columns."""
    import argparse

    from bridgeflow import cli

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    try:
        parser = cli._build_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        blocks = [("bridgeflow", parser.format_help())]
        blocks += [(f"bridgeflow {name}", sub.format_help()) for name, sub in commands.items()]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    lines: list[str] = []
    for name, text in blocks:
        lines += _heading(f"``{name}``", "-") + [".. code-block:: text", ""]
        lines += [f"   {line}".rstrip() for line in text.rstrip().splitlines()] + [""]
    return lines


def index_page(the_plan: Plan, homes: dict[str, str]) -> str:
    lines = _heading("API reference", "=")
    lines += [f".. py:module:: {ns}" for ns, home in homes.items() if home == "index"] + [""]
    lines += [".. currentmodule:: None", ""]
    lines += [
        "Every public name under the path users import it from, on the page of its concept. Most names are "
        "exported by ``bridgeflow`` itself (``import bridgeflow as bf; bf.MapData``); the framework adapters by "
        "``bridgeflow.adapters.torch`` and ``bridgeflow.adapters.tensorflow`` (each imports its framework); "
        "the augmentors by ``bridgeflow.imgaug``. ``bridgeflow.dataflow`` is tensorpack's import path: it "
        "re-exports every name of ``bridgeflow`` and the ``imgaug`` and ``dataset`` packages, so "
        "``from tensorpack.dataflow import ...`` ports by changing the package name. An entry lists the other "
        "paths its object is importable from.", ""]
    for page, (_, _, sections) in PAGES.items():
        if page == "index":
            continue
        names = [p for paths in sections.values() for p in paths if p in the_plan.entries]
        links = ", ".join(f":obj:`~{p}`" for p in names) or "every command's options"
        lines += [f":doc:`{page}`", f"   {links}", ""]
    lines += [".. toctree::", "   :hidden:", ""] + [f"   {page}" for page in PAGES if page != "index"] + [""]
    for section, paths in PAGES["index"][2].items():
        lines += _heading(section, "-")
        for path in paths:
            if path in the_plan.entries:
                lines += _entry(path, the_plan.entries[path], the_plan.aliases[path])
    return "\n".join(lines).rstrip() + "\n"


# -- the internal modules -------------------------------------------------------------------------------


def all_modules() -> dict[str, ModuleType]:
    """Every module of bridgeflow and its adapters, private ones included, imported."""
    out = {}
    for root in ROOTS:
        package = importlib.import_module(root)
        out[root] = package
        for info in pkgutil.walk_packages(package.__path__, root + "."):
            if info.name not in SKIP:
                out[info.name] = importlib.import_module(info.name)
    return out


def internal_modules(modules: dict[str, ModuleType]) -> list[str]:
    """The modules that are neither a public namespace nor a package holding one (``bridgeflow.adapters``)."""
    return [m for m in sorted(modules) if m not in NAMESPACES and not any(ns.startswith(m + ".") for ns in NAMESPACES)]


def defined_names(module: ModuleType) -> list[str]:
    """Names the module's own source binds at its top level (classes, functions, assignments)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names += [t.id for t in elts if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def _first_paragraph(module: ModuleType) -> str:
    doc = inspect.getdoc(module) or ""
    return doc.split("\n\n", 1)[0].strip()


def internals_page(modules: dict[str, ModuleType]) -> str:
    repo = Path(__file__).resolve().parent.parent
    lines = _heading("Module map", "=") + [
        "For contributors: the modules behind the :doc:`public names <index>`, each with the first paragraph of "
        "its docstring (the rest, and the code, are in the file). None of them is imported by users; a name "
        "that users need is exported by a public namespace and described in the reference. "
        ":doc:`../architecture` follows one record through them.", ""]
    package = None
    names = internal_modules(modules)
    for name in sorted(names, key=lambda m: (m.startswith("bridgeflow.adapters"), m.count("."), m)):
        module, parent = modules[name], name.rsplit(".", 1)[0]
        if parent != package:
            package = parent
            lines += _heading(f"``{package}``", "-")
        try:
            where = Path(inspect.getsourcefile(module) or "").resolve().relative_to(repo)
        except ValueError:
            where = Path(name.replace(".", "/") + ".py")
        lines += [f".. _internals-{name}:", "", f".. currentmodule:: {name}", "", f"``{name}``",
                  f"   ``{where}``. " + _first_paragraph(module).replace("\n", "\n   "), ""]
    lines += [".. currentmodule:: None", ""]
    return "\n".join(lines).rstrip() + "\n"


# -- cross-references -----------------------------------------------------------------------------------


@dataclass
class Targets:
    """Where each name a docstring may use leads: an entry (``public``) or an internal module (``internal``)."""

    public: dict[str, str] = field(default_factory=dict)  # any path or bare name -> entry path
    internal: dict[str, str] = field(default_factory=dict)  # module, module.name or bare name -> module
    known: list[str] = field(default_factory=list)  # every full path, for '.relative' references


def targets(the_plan: Plan, modules: dict[str, ModuleType]) -> Targets:
    out = Targets()
    entry_of = {key(obj, path): path for path, obj in the_plan.entries.items()}
    for entry, aliases in the_plan.aliases.items():
        for alias in aliases:
            out.public[alias] = entry
    bare: dict[str, set[str]] = {}
    for name, module in modules.items():  # where the objects are defined or imported: bridgeflow._base.DataFlow
        for attr in defined_names(module) + list(getattr(module, "__all__", [])):
            obj = getattr(module, attr, None)
            entry = entry_of.get(key(obj, attr)) if obj is not None else None
            path = f"{name}.{attr}"
            if entry is not None:
                out.public.setdefault(path, entry)
            elif name not in NAMESPACES and not attr.startswith("__"):
                out.internal[path] = name
                bare.setdefault(attr, set()).add(name)
    for name in internal_modules(modules):
        out.internal[name] = name
    public_bare: dict[str, set[str]] = {}
    for path in list(the_plan.entries) + list(out.public):
        public_bare.setdefault(path.rsplit(".", 1)[1], set()).add(out.public.get(path, path))
    out.public.update({name: entries.pop() for name, entries in public_bare.items() if len(entries) == 1})
    out.internal.update({name: mods.pop() for name, mods in bare.items()
                         if len(mods) == 1 and name not in public_bare})
    out.known = sorted(set(the_plan.entries) | set(out.public) | set(out.internal))
    return out


def exists(path: str) -> bool:
    """Whether Python has ``path``: a module, or an attribute (class annotations count) of one."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if attr in getattr(obj, "__annotations__", {}):
                return True
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                return False
        return True
    return False


def write_pages(out_dir: Path) -> Targets:
    """Write the reference's pages into ``out_dir``; raise when the table does not match the exports."""
    the_plan = plan()
    if the_plan.problems:
        raise RuntimeError("docs/api_pages.py does not match the public names:\n  " + "\n  ".join(the_plan.problems))
    modules = all_modules()
    homes = namespace_homes(the_plan)
    wanted = {f"{page}.rst": concept_page(page, the_plan, homes) for page in PAGES if page != "index"}
    wanted["index.rst"] = index_page(the_plan, homes)
    wanted["internals.rst"] = internals_page(modules)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.rst"):
        if stale.name not in wanted:
            stale.unlink()
    for file_name, text in wanted.items():
        path = out_dir / file_name
        if not path.exists() or path.read_text() != text:  # unchanged pages keep their time: no rebuild
            path.write_text(text)
    return targets(the_plan, modules)


def setup(app):  # a Sphinx extension: the pages exist before Sphinx looks for source files
    from sphinx.errors import ExtensionError
    from sphinx.util import logging
    from sphinx.util.nodes import make_refnode

    logger = logging.getLogger(__name__)
    found = Targets()

    def generate(app, config) -> None:
        try:
            found.__dict__.update(write_pages(Path(app.srcdir) / "api").__dict__)
        except RuntimeError as exc:
            raise ExtensionError(str(exc)) from None

    def lookup(env, builder, fromdoc, name, contnode, partial):
        """A reference node to ``name`` (an entry, an entry's member, an internal module), or None. With
        ``partial``, a member that has no entry of its own (``bridgeflow.DataFlow.attach_read_ahead``) leads
        to its class's entry, if Python has it."""
        py, std = env.get_domain("py"), env.get_domain("std")
        parts = name.split(".")
        for i in range(len(parts), 0, -1) if partial else (len(parts),):
            head, rest = ".".join(parts[:i]), parts[i:]
            for entry in (head, found.public.get(head)):
                if entry is None:
                    continue
                full = ".".join([entry, *rest])
                if full in py.objects or (rest and entry in py.objects and exists(full)):
                    obj = py.objects[full if full in py.objects else entry]
                    return make_refnode(builder, fromdoc, obj.docname, obj.node_id, contnode, full)
            module = found.internal.get(head)
            label = std.anonlabels.get(f"internals-{module}") if module else None
            path = head if module and (head == module or head.startswith(module + ".")) else f"{module}.{head}"
            if label and (not rest or exists(".".join([path, *rest]))):
                return make_refnode(builder, fromdoc, label[0], label[1], contnode, f"{module} (module map)")
        return None

    def resolve(app, env, node, contnode):
        """Docstrings name objects by where they are defined, where they are exported, or bare: send each
        reference to the entry (or the module map) and warn about a ``bridgeflow`` path that leads nowhere."""
        if node.get("refdomain") != "py":
            return None
        target = node.get("reftarget", "")
        module, cls = node.get("py:module"), node.get("py:class")
        relative = bool(node.get("refspecific")) or target.startswith(".")  # Sphinx strips the dot of '.name'
        name = target.lstrip(".~")
        in_context = [f"{module}.{cls}.{name}"] if module and cls else []
        if module:  # '._epoch' in bridgeflow.adapters.torch._pin_memory: a sibling module first
            parts = module.split(".")
            in_context += [".".join([*parts[:i], name]) for i in range(len(parts), 0, -1)]
        for candidate in in_context:
            if hit := lookup(env, app.builder, node["refdoc"], candidate, contnode, False):
                return hit
        candidates = [name] if not relative else [k for k in found.known if k.endswith("." + name)][:1]
        for candidate in candidates:
            if hit := lookup(env, app.builder, node["refdoc"], candidate, contnode, True):
                return hit
        if (relative or target.startswith("bridgeflow")) and re.fullmatch(r"[\w.]+", name):  # a path, not prose
            logger.warning("cross-reference to %s leads nowhere: no public entry or module has that name",
                           target, location=node, type="ref", subtype="bridgeflow")
        return None

    def bases(app, name, obj, options, bases_list) -> None:
        """Show base classes by their public name (``bridgeflow.DataFlow``, not ``bridgeflow._base.DataFlow``);
        an internal base gives way to its nearest public ancestors."""
        out: list = []

        def add(base: object) -> None:
            if not inspect.isclass(base):
                out.append(base)
                return
            entry = found.public.get(f"{base.__module__}.{base.__qualname__}")
            if entry is not None:
                out.append(f":py:class:`~{entry}`")
            elif base.__module__.split(".")[0] == "bridgeflow":
                for parent in base.__bases__:
                    add(parent)
            else:
                out.append(base)

        for base in bases_list:
            add(base)
        out = list(dict.fromkeys(out))
        bases_list[:] = [b for b in out if b is not object] or out

    app.connect("config-inited", generate)
    app.connect("missing-reference", resolve)
    app.connect("autodoc-process-bases", bases)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
