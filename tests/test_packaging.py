"""The sdist and the wheel built from the checkout, as `pip install .`, Docker images and Ray runtime environments
build them: every module of the source tree is in both, under its import name (``adapters/`` as
``bridgeflow.adapters``, never a top-level ``adapters``), with ``py.typed``, the ``bridgeflow`` console script
and ``python -m bridgeflow``; and the wheel, unpacked outside the checkout, imports every one of them."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest

from conftest import need, source_tree

# two builds in an isolated environment: 15-40 s here, minutes on a busy machine (each bounded by 600 s)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]


def _modules(folder: str, package: str) -> set[str]:
    """The files ``package/...py`` that the source folder ``folder`` holds, as paths inside the wheel."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, folder)
        for name in filenames:
            if name.endswith(".py"):
                out.add("/".join(p for p in (package, "" if rel == "." else rel.replace(os.sep, "/"), name) if p))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(source, sdist, wheel)``: the checkout copied (so the build writes nothing into it) and built by
    ``python -m build``, the sdist first and the wheel from the unpacked sdist, as pip builds a package."""
    need("build", import_it=False)
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(source_tree(), src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "_build", ".ci-out", ".*_cache",
        ".hypothesis", "*.lmdb", "*.h5", "bench-out"))
    out = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (sdist,) = (tmp / "dist").glob("*.tar.gz")
    (wheel,) = (tmp / "dist").glob("*.whl")
    return str(src), str(sdist), str(wheel)


def test_the_wheel_holds_every_module_and_data_file(built):
    src, _, wheel = built
    want = _modules(os.path.join(src, "bridgeflow"), "bridgeflow") | \
        _modules(os.path.join(src, "adapters"), "bridgeflow/adapters")
    assert "bridgeflow/parallel/_transport/pool.py" in want and "bridgeflow/adapters/torch/_loader.py" in want
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert {n for n in names if n.endswith(".py")} == want
    assert {n for n in names if not n.endswith(".py") and not n.startswith(info)} == {"bridgeflow/py.typed"}
    assert not any(n.startswith("adapters/") for n in names)  # never a top-level `adapters` (another package's)
    assert "bridgeflow/__main__.py" in names  # python -m bridgeflow
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(src, "setup.cfg"))
    assert "[console_scripts]\nbridgeflow = bridgeflow.cli:main" in entry_points
    assert cfg["options.entry_points"]["console_scripts"].strip() == "bridgeflow = bridgeflow.cli:main"


def test_the_sdist_holds_the_sources_and_what_builds_them(built):
    src, sdist, _ = built
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = _modules(os.path.join(src, "bridgeflow"), "bridgeflow") | _modules(os.path.join(src, "adapters"), "adapters")
    assert {n for n in names if n.endswith(".py") and n.startswith(("bridgeflow/", "adapters/"))} == want
    assert {"bridgeflow/py.typed", "setup.cfg", "setup.py", "pyproject.toml", "README.md", "LICENSE"} <= names


def test_the_wheel_unpacked_elsewhere_imports_every_module_and_runs(built, tmp_path):
    """Imported from the unpacked wheel, in a folder outside the checkout: every module imports (or, for an extra
    this environment lacks, says which to install), and ``python -m bridgeflow`` runs."""
    _, _, wheel = built
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in z.namelist()
                         if n.endswith(".py") and not n.endswith("__main__.py"))
    code = textwrap.dedent(f"""
        import importlib, json, sys
        sys.path.insert(0, {str(site)!r})
        import bridgeflow
        failed, missing = [], []
        for name in {modules!r}:
            try:
                importlib.import_module(name)
            except bridgeflow.MissingDependencyError as exc:
                missing.append(name)
            except Exception as exc:
                failed.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
        print(json.dumps([bridgeflow.__file__, failed, missing]))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    where, failed, missing = json.loads(out.stdout.splitlines()[-1])
    assert where == str(site / "bridgeflow" / "__init__.py")
    assert failed == []
    assert len(modules) > 100 and len(missing) < len(modules) // 2, missing
    env = dict(os.environ, PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-m", "bridgeflow", "--version"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert run.returncode == 0 and run.stdout.startswith("bridgeflow "), run.stderr
