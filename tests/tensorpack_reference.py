"""Where the differential tests get tensorpack's own answers (a helper module, not a test file).

``BRIDGEFLOW_TENSORPACK_PYTHON`` names a Python with tensorpack 0.11 (``.ci/run`` makes one and exports
it). When set, tests run tensorpack code through it in a subprocess. When it is not set, they compare
against the files tests/data/make_tensorpack_fixtures.py committed, made by tensorpack the same way;
under CI (``CI`` set, as ``.ci/run`` exports it) a missing interpreter is a failure, never a skip.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

ENV = "BRIDGEFLOW_TENSORPACK_PYTHON"
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
SCRIPT = os.path.join(DATA, "make_tensorpack_fixtures.py")


def load_script():
    """tests/data/make_tensorpack_fixtures.py as a module (its cases, datapoints and JSON codec)."""
    spec = importlib.util.spec_from_file_location("make_tensorpack_fixtures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensorpack_python() -> str | None:
    """The tensorpack interpreter, or ``None`` off CI; a test failure under CI when it is missing."""
    exe = os.environ.get(ENV)
    if exe:
        if not os.access(exe, os.X_OK):
            pytest.fail(f"{ENV}={exe} is not an executable")
        return exe
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {ENV} is not: .ci/run must create the tensorpack venv and export {ENV} "
                    "(the differential tests would otherwise only see the committed fixtures)")
    return None


def run_tensorpack(args: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run ``args`` (after the interpreter) with the tensorpack Python; fails the test on a non-zero exit."""
    exe = tensorpack_python()
    assert exe is not None
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("PYTHONPATH", None)  # nothing of this checkout's environment in tensorpack's
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"tensorpack's Python failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc
