"""The API reference's table (docs/api_pages.py) names every public name once, under a public path.

A name exported by one of the public namespaces but missing from the table, or listed twice (the same path,
or two paths of one object), fails here: a new export cannot drop out of the reference, and nothing is
described twice. The pages written from the table describe each entry once and name its other import paths.
The built site is checked by docs/check_site.py (reachability, code that fits), which needs a docs build.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

import bridgeflow
from conftest import docs_module, need, source_tree

DOCS = Path(source_tree()) / "docs"
FRAMEWORKS = {"bridgeflow.adapters.torch": "torch", "bridgeflow.adapters.tensorflow": "tensorflow"}


@pytest.fixture(scope="module")
def apigen():
    with docs_module("apigen") as module:
        yield module


def installed(namespaces) -> tuple[str, ...]:
    """The namespaces whose framework is installed (the adapters import torch and TensorFlow)."""
    return tuple(ns for ns in namespaces if ns not in FRAMEWORKS or importlib.util.find_spec(FRAMEWORKS[ns]))


def test_every_public_name_is_in_the_table_once(apigen):
    plan = apigen.plan(installed(apigen.NAMESPACES))
    assert plan.problems == []
    assert "bridgeflow.LMDBSerializer" in plan.entries and "bridgeflow.MultiProcessMapData" in plan.entries
    assert set(plan.aliases["bridgeflow.LMDBSerializer"]) == {"bridgeflow.serialize.LMDBSerializer",
                                                              "bridgeflow.dataflow.LMDBSerializer"}
    assert "bridgeflow.PrefetchData" in plan.aliases["bridgeflow.MultiProcessPrefetchData"]  # tensorpack's name


@pytest.mark.parametrize("namespace", list(FRAMEWORKS))
def test_the_adapters_names_are_in_the_table(apigen, namespace):
    need(FRAMEWORKS[namespace])  # the adapters import it; under CI, a job that installed it fails without
    plan = apigen.plan(("bridgeflow", namespace))
    assert plan.problems == []
    module = importlib.import_module(namespace)
    assert {f"{namespace}.{n}" for n in module.__all__} <= set(plan.entries)


def test_the_namespaces_are_what_the_docs_import(apigen):
    # Every namespace the guide pages and the README import from is public, and each is a package users
    # import (not a module of one of them).
    assert {"bridgeflow", "bridgeflow.serialize", "bridgeflow.imgaug", "bridgeflow.dataset", "bridgeflow.testing",
            "bridgeflow.remote", "bridgeflow.dataflow", "bridgeflow.adapters.torch",
            "bridgeflow.adapters.tensorflow"} <= set(apigen.NAMESPACES)
    for page, (_, _, sections) in apigen.PAGES.items():
        for section, paths in sections.items():
            assert paths, f"page {page!r}, section {section!r} lists no name"


def test_a_new_export_missing_from_the_table_fails(apigen, monkeypatch):
    class NewFlow(bridgeflow.DataFlow):
        pass

    monkeypatch.setattr(bridgeflow, "NewFlow", NewFlow, raising=False)
    monkeypatch.setattr(bridgeflow, "__all__", [*bridgeflow.__all__, "NewFlow"])
    problems = apigen.plan(("bridgeflow",)).problems
    assert problems == ["bridgeflow.NewFlow is exported but not in docs/api_pages.py: add it to a page's section"]


def test_a_name_listed_twice_fails(apigen, monkeypatch):
    monkeypatch.setitem(apigen.PAGES, "extra", ("Extra", "", {
        "again": ["bridgeflow.MapData", "bridgeflow.serialize.LMDBSerializer", "bridgeflow.PrefetchData"]}))
    problems = apigen.plan(("bridgeflow", "bridgeflow.serialize")).problems
    assert problems == [
        "bridgeflow.MapData is listed twice (page 'transforms' and page 'extra')",
        "bridgeflow.serialize.LMDBSerializer (extra: again) is listed twice: it is bridgeflow.LMDBSerializer",
        "bridgeflow.PrefetchData (extra: again) is listed twice: it is bridgeflow.MultiProcessPrefetchData",
    ]


def test_an_internal_or_unexported_path_in_the_table_fails(apigen, monkeypatch):
    monkeypatch.setitem(apigen.PAGES, "extra", ("Extra", "", {
        "inside": ["bridgeflow.parallel._transport.shm.SlabWriter", "bridgeflow.NoSuchThing"]}))
    problems = apigen.plan(("bridgeflow",)).problems
    assert problems == [
        "bridgeflow.parallel._transport.shm.SlabWriter (extra: inside): bridgeflow.parallel._transport.shm is not "
        "one of the public NAMESPACES",
        "bridgeflow.NoSuchThing (extra: inside) is not in bridgeflow.__all__",
    ]


def test_the_pages_describe_each_entry_once_and_name_its_other_paths(apigen):
    plan = apigen.plan(installed(apigen.NAMESPACES))
    homes = apigen.namespace_homes(plan)
    pages = {page: apigen.concept_page(page, plan, homes) for page in apigen.PAGES if page != "index"}
    pages["index"] = apigen.index_page(plan, homes)
    for path in plan.entries:
        described = [page for page, text in pages.items()
                     if any(line.split("::", 1)[-1].strip() == path for line in text.splitlines()
                            if line.startswith((".. auto", ".. py:data::")))]
        assert described == [plan.page_of[path]], f"{path} is described on {described}"
        for alias in plan.aliases[path]:
            assert f"``{alias}``" in pages[plan.page_of[path]], f"{alias} is not named beside {path}"
    toctree = pages["index"].split(".. toctree::", 1)[1]
    assert all(f"   {page}\n" in toctree for page in apigen.PAGES if page != "index")


def test_a_docstring_reference_by_any_path_leads_to_the_entry_or_the_module_map(apigen):
    for framework in FRAMEWORKS.values():
        pytest.importorskip(framework, reason="the module map imports every module, the adapters' too")
    plan = apigen.plan()
    targets = apigen.targets(plan, apigen.all_modules())
    assert targets.public["bridgeflow.serialize._lmdb_format.LMDBSerializer"] == "bridgeflow.LMDBSerializer"
    assert targets.public["bridgeflow._base.DataFlow"] == "bridgeflow.DataFlow"
    assert targets.public["bridgeflow.adapters.torch._loader.DataLoader"] == "bridgeflow.adapters.torch.DataLoader"
    assert targets.public["WorkerError"] == "bridgeflow.WorkerError"
    assert targets.public["PrefetchData"] == "bridgeflow.MultiProcessPrefetchData"
    assert targets.internal["bridgeflow.parallel._transport.shm.SlabWriter"] == "bridgeflow.parallel._transport.shm"
    assert targets.internal["bridgeflow.serialize._lmdb_tree"] == "bridgeflow.serialize._lmdb_tree"
    internal = set(apigen.internal_modules(apigen.all_modules()))
    assert not internal & set(apigen.NAMESPACES)
    assert {"bridgeflow.parallel._transport.wire", "bridgeflow.parallel._transport.pickling",
            "bridgeflow.serialize._lmdb_format",
            "bridgeflow.adapters.torch._loader"} <= internal
    assert apigen.exists("bridgeflow.DataFlow.state_dict") and not apigen.exists("bridgeflow.DataFlow.nope")


def test_no_property_docstring_opens_with_what_napoleon_reads_as_its_type(apigen):
    # Napoleon reads a property docstring's first line "X: Y" as type X, described by Y: "The start method
    # the workers use: ..." rendered as a "TYPE:" field. A property's first line is a sentence without a colon.
    docstring = need("sphinx.ext.napoleon.docstring")
    config = need("sphinx.ext.napoleon").Config(napoleon_numpy_docstring=False)
    plan = apigen.plan(installed(apigen.NAMESPACES))
    read_as_type = []
    for path, obj in plan.entries.items():
        for name, attr in vars(obj).items() if isinstance(obj, type) else ():
            if isinstance(attr, property) and attr.__doc__ and not name.startswith("_"):
                text = str(docstring.GoogleDocstring(inspect.cleandoc(attr.__doc__), config,
                                                     what="property", name=f"{path}.{name}"))
                if ":type:" in text:
                    read_as_type.append(f"{path}.{name}: {attr.__doc__.splitlines()[0]!r}")
    assert "bridgeflow.adapters.torch.DataLoader" in plan.entries or not importlib.util.find_spec("torch")
    assert read_as_type == []
