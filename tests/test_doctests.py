"""Every ``>>>`` example in ``bridgeflow`` and ``bridgeflow.adapters`` runs and gives what it shows.

``pytest --doctest-modules bridgeflow adapters`` runs the same examples, but names the adapters' modules by
their folder (``adapters.torch...``, a second copy of them); here every module is imported by its installed
name. Each module's examples run in a temporary working directory (examples that save a file write it there)
and must leave no process, thread or shared-memory segment behind. Examples that need a device or a network
are marked ``# doctest: +SKIP`` in the docstring itself.
"""

from __future__ import annotations

import doctest
import importlib
import io
import os
from pathlib import Path

import pytest

import bridgeflow
import bridgeflow.adapters
from conftest import need

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def modules_with_examples() -> list[str]:
    """Installed names of the modules whose source holds a ``>>>`` line (found without importing them)."""
    names = []
    for package in (bridgeflow, bridgeflow.adapters):
        root = Path(package.__path__[0])
        for path in sorted(root.rglob("*.py")):
            if path.name == "__main__.py" or ">>>" not in path.read_text(encoding="utf-8"):
                continue
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((package.__name__, *parts)))
    return names


MODULES = modules_with_examples()


def test_the_examples_are_found():
    # Without this, an empty list (a moved package) would make the test below pass by running nothing.
    assert {"bridgeflow._sources", "bridgeflow._codec",
            "bridgeflow.adapters.tensorflow._feed"} <= set(MODULES)
    assert len(MODULES) >= 30


@pytest.mark.parametrize("name", MODULES)
def test_examples(name, tmp_path, monkeypatch, leak_check):
    if name.startswith("bridgeflow.adapters."):
        need(name.split(".")[2])  # torch or tensorflow
    module = importlib.import_module(name)
    monkeypatch.chdir(tmp_path)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    assert tests, f"{name} has '>>>' in its source but no docstring example was found"
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=out.write)
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} examples of {name} failed:\n{out.getvalue()}"
    assert os.getcwd() == str(tmp_path), f"an example of {name} changed the working directory"
