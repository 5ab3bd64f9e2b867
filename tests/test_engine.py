"""The engine seam (``bridgeflow.engine``): its names are the core's own objects, and the ``seam`` contract of
``pyproject.toml`` forbids every private module of the core, so a new one cannot be imported around the seam."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import bridgeflow
from bridgeflow import engine
from conftest import source_tree


def private_modules() -> set[str]:
    """The core's private modules outside remote, found on disk: a module or package with a ``_name`` part."""
    root = Path(source_tree())  # the checkout: the installed package may lack a module the tree has
    out = set()
    for path in (root / "bridgeflow").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts[1:2] != ["remote"] and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
            out.add(".".join(parts))
    return out


def seam_contract() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((Path(source_tree()) / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "seam"]
    return contract


def test_the_seam_contract_forbids_every_private_module_of_the_core():
    listed = set(seam_contract()["forbidden_modules"])
    uncovered = sorted(m for m in private_modules()
                       if not any(m == f or m.startswith(f + ".") for f in listed))
    assert uncovered == [], f"add these to the seam contract's forbidden_modules in pyproject.toml: {uncovered}"
    assert sorted(f for f in listed if f not in private_modules()) == []  # no stale name either
    assert set(seam_contract()["source_modules"]) == {"adapters", "bridgeflow.remote"}


def test_the_finder_sees_nested_private_modules():
    found = private_modules()
    assert {"bridgeflow._base", "bridgeflow._background", "bridgeflow.parallel._transport",
            "bridgeflow.parallel._transport.pool", "bridgeflow.serialize._lmdb_format"} <= found
    public = {"bridgeflow.engine", "bridgeflow.parallel", "bridgeflow.remote._zmq_flow", "bridgeflow.__main__"}
    assert not public & found


def test_every_name_of_the_seam_is_the_cores_own_object():
    assert len(engine.__all__) == len(set(engine.__all__))
    for name in engine.__all__:
        obj = getattr(engine, name)
        module = getattr(obj, "__module__", None)
        if module is not None and isinstance(obj, type | type(len) | type(private_modules)):
            assert getattr(importlib.import_module(module), obj.__name__) is obj, name
        if name in bridgeflow.__all__:  # a public name handed on for remote is the same object
            assert getattr(bridgeflow, name) is obj, name


def test_the_background_thread_through_the_seam():
    assert list(engine.BackgroundIterator(range(4), lambda x: x * 2, depth=2)) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="max_restarts"):
        engine.check_max_restarts(-1, "test")
