"""The type check: mypy on the package, as pyproject.toml's ``[tool.mypy]`` says, and ``mypy --strict`` on
tests/typing/public_api.py, bridgeflow's public API as a user's code sees it.

Both need torch and TensorFlow besides mypy: the adapters import them, and what mypy reports depends on the
installed stubs (numpy's, torch's), so the check runs where CI pins them (the full job) and skips, naming
what is missing, elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import need, source_tree

ROOT = source_tree()

need("mypy")

# One test process runs both, the package check first: they share .mypy_cache, which two mypy runs at once can
# corrupt or find locked (its SQLite cache).
# A time limit above the 900 s that bounds each mypy run: a cold cache on a busy machine takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mypy"), pytest.mark.timeout(960)]

# Packages whose errors the package check does not count yet (none now: the whole tree is checked). A package
# put here while it is being rewritten makes the test fail, saying so, as soon as it has no error left.
WAITING: tuple[str, ...] = ()

_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+: error: ", re.MULTILINE)


def _mypy(args: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def _frameworks() -> None:
    need("torch")
    need("tensorflow")


def test_the_package_type_checks_clean():
    _frameworks()
    out = _mypy([], ROOT)  # files and options: pyproject.toml's [tool.mypy]
    assert out.returncode in (0, 1), out.stdout + out.stderr  # 2: mypy itself failed (a bad config, a crash)
    paths = [m["path"] for m in _ERROR.finditer(out.stdout)]
    counted = [line for line in out.stdout.splitlines()
               if _ERROR.match(line) and not line.startswith(WAITING)]
    assert not counted, f"{len(counted)} mypy errors:\n" + "\n".join(counted)
    clean = [p for p in WAITING if not any(path.startswith(p) for path in paths)]
    assert not clean, f"{clean} type-check clean now: remove them from WAITING in {__file__}"


def _installed_layout(tmp: str) -> str:
    """A folder where ``bridgeflow.adapters`` is ``adapters/``, as a (non-editable) install lays it out: mypy
    cannot follow the editable install's import hook, which maps the name at run time."""
    pkg = os.path.join(tmp, "bridgeflow")
    os.mkdir(pkg)
    for entry in os.listdir(os.path.join(ROOT, "bridgeflow")):
        if entry != "__pycache__":
            os.symlink(os.path.join(ROOT, "bridgeflow", entry), os.path.join(pkg, entry))
    os.symlink(os.path.join(ROOT, "adapters"), os.path.join(pkg, "adapters"))
    return tmp


def _strict_header() -> tuple[str, list[str]]:
    """What ``--strict`` turns on, split as mypy applies it: an inline-configuration line (``# mypy: ...``) of
    the per-module flags, for the one file checked strictly, and the global flags as arguments. Everything
    else then reads with the package check's options, so the third-party modules' cache (torch's, numpy's:
    nearly all of a cold run's 25 s) written by the package check is valid here too: a whole-run ``--strict``
    would change every module's options and recheck them all."""
    from mypy.main import define_options
    from mypy.options import PER_MODULE_OPTIONS

    _, _, assignments = define_options()
    inline = [f"{name.replace('_', '-')}={value}" for name, value in assignments if name in PER_MODULE_OPTIONS]
    flags = [f"--{name.replace('_', '-')}" for name, value in assignments
             if name not in PER_MODULE_OPTIONS and value is True]
    assert "disallow-untyped-defs=True" in inline and "disallow-any-generics=True" in inline, assignments
    return "# mypy: " + ", ".join(inline) + "\n", flags


def test_the_public_api_type_checks_strict(tmp_path):
    _frameworks()
    site = _installed_layout(str(tmp_path))
    header, flags = _strict_header()
    with open(os.path.join(ROOT, "tests", "typing", "public_api.py")) as f:
        source = f.read()
    checked = tmp_path / "public_api.py"
    checked.write_text(header + source)  # line numbers in a report are the original's plus one
    # bridgeflow's own modules are read with the package's options, as any installed package a user's mypy
    # reads; their errors are the package check's (above), which finds none.
    out = _mypy(["--config-file", os.path.join(ROOT, "pyproject.toml"), *flags,
                 "--cache-dir", os.path.join(ROOT, ".mypy_cache"), str(checked)], site)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found in 1 source file" in out.stdout
