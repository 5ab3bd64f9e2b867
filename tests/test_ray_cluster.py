"""RayMapData as a user deploys it: a Ray cluster of two nodes on this machine, bridgeflow given to the workers as
the wheel built from this checkout through a runtime environment (py_modules), never through the source tree;
the map stage on both nodes, its datapoints those of the in-process run, and a node killed mid-epoch: recovered
when another node joins, a named error when none does. The driver is tests/ray_cluster_run.py, run from a folder
outside the checkout (see its doc)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from hangs import process_limit

from conftest import need, source_tree

# One test process for Ray (its start is ~45 s here), and a limit above the default 240 s: the cluster, the
# wheel's build and its install on each node take 2-5 minutes on a busy machine.
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(1200)]

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TASKS = 1500


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of this checkout, built as pip builds it (in a copy, so nothing is written into the checkout)."""
    need("build", import_it=False)
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(source_tree(), tmp / "src", ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "docs", "tests", "benchmarks", ".*_cache"))
    out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp / "dist"), str(tmp / "src")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("bridgeflow-*.whl")
    return str(whl)


def test_two_nodes_run_the_map_stage_from_the_wheel_and_a_lost_node_is_recovered_or_named(wheel, tmp_path):
    need("ray", import_it=False)
    shutil.copy(os.path.join(HERE, "ray_cluster_run.py"), tmp_path / "ray_cluster_run.py")
    # Ray's three nodes, their agents and workers: about 300 tasks (threads included) here. The bound keeps a
    # runaway (actors restarted without end, workers started for ever) to this test.
    with process_limit(MAX_TASKS) as enter:
        proc = subprocess.Popen([sys.executable, "ray_cluster_run.py", wheel, "out.json"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=enter)
        try:
            log, _ = proc.communicate(timeout=1100)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log[-5000:]
    out = json.loads((tmp_path / "out.json").read_text())
    print(json.dumps({k: v for k, v in out.items() if k != "driver_sys_path"}, indent=1))
    # nothing of the checkout on the driver's path, which Ray gives its workers (this venv may lie inside it)
    assert not any(p == source_tree() or p.startswith(source_tree() + os.sep) and not p.startswith(sys.prefix)
                   for p in out["driver_sys_path"]), out["driver_sys_path"]
    # bridgeflow came to the workers as the wheel, installed by Ray on each node, not from this checkout
    assert out["folders"] and all("runtime_resources" in f and not f.startswith(source_tree())
                                  for f in out["folders"]), out["folders"]
    assert out["nodes_before"] == ["head", "second"]  # the map stage placed on both nodes
    # the second node killed mid-epoch, a third joining: its actor restarted there, the epoch complete, in order
    assert out["datapoints"] == 160 and out["same_as_in_process"]
    assert "third" in out["nodes_after"] and "second" not in out["nodes_after"]
    # the third killed with nowhere to restart its actor: start_timeout ends the wait in a named error
    assert out["no_room"].startswith("WorkerError") and "did not come back within start_timeout=90" in out["no_room"]
    assert out["no_room_worker"] in (0, 1)
