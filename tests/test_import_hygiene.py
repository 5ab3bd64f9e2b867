"""The core imports neither the frameworks nor the optional backends, and works when they are absent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import need

HEAVY = ["torch", "tensorflow", "lmdb", "h5py", "zmq", "ray", "cv2", "PIL", "albumentations", "msgpack",
         "bridgeflow.adapters"]


def run_python(code: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize("module", ["bridgeflow", "bridgeflow.parallel", "bridgeflow.testing", "bridgeflow.cli",
                                    "bridgeflow.dataflow", "bridgeflow.serialize._tensorpack_codec",
                                    "bridgeflow.serialize._lmdb_raw", "bridgeflow._queues"])
def test_import_loads_no_heavy_module(module):
    out = run_python(f"""
        import json, sys
        import {module}
        heavy = {HEAVY!r}
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m in heavy)))
    """)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("module", ["torch", "tensorflow", "lmdb", "h5py"])
def test_heavy_modules_are_really_installed(module):
    # Without this, the test above could pass because the packages are simply missing: it says which of them
    # it checked (a skip names one it could not, off CI or in a CI job that leaves it out on purpose).
    assert need(module).__name__ == module


BLOCK = """
    import sys

    class Block:  # makes torch and tensorflow (and their submodules) unimportable
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "tensorflow"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the block did not work")
"""


def test_core_works_without_torch_and_tensorflow():
    out = run_python(BLOCK + """
    import io
    import numpy as np
    import bridgeflow as bf
    from bridgeflow.parallel import MultiThreadMapData
    from bridgeflow.testing import check_dataflow

    src = bf.DataFromList([[np.full((2, 2), i, np.uint8), i] for i in range(40)], shuffle=True, seed=0)
    df = bf.BatchData(bf.MapDataComponent(bf.LocallyShuffleData(src, 8, seed=0), lambda a: a * 2, 0), 8)
    batches = check_dataflow(df, deterministic=False)  # shuffled: batches differ between epochs
    assert len(batches) == 5 and batches[0][0].shape == (8, 2, 2) and batches[0][1].dtype == np.int64
    with bf.BatchData(MultiThreadMapData(bf.DataFromList([[i] for i in range(32)], shuffle=False), 2,
                                         lambda dp: [dp[0] + 1]), 4) as par:
        got = sorted(int(v) for b in par for v in b[0])
    assert got == list(range(1, 33)), got
    rate = bf.TestDataSpeed(df, size=10, progress=False, file=io.StringIO()).start()
    assert rate > 0
    assert "torch" not in sys.modules and "tensorflow" not in sys.modules
    print("ok")
    """)
    assert out.stdout.strip().endswith("ok")


def test_cli_works_without_torch_and_tensorflow():
    out = run_python(BLOCK + """
    from bridgeflow.cli import main
    code = main(["bench", "--fake", "3x8x8,1", "--size", "20", "--quiet", "--seconds", "0"])
    assert code == 0
    """)
    assert "20 datapoints in" in out.stdout


QUIET = """
    import numpy as np
    import bridgeflow as bf

    def load(i):
        if i == 37:
            raise KeyError("sample 37 is missing")
        return {"img": np.full((3, 40, 40), i % 256, np.uint8), "label": i, "ragged": np.arange(i % 3 + 1)}

    if __name__ == "__main__":
        src = bf.LocallyShuffleData(bf.DataFromList(list(range(64)), shuffle=True, seed=0), 8, seed=0)
        for start_method in ("fork", "spawn"):
            par = bf.MultiProcessMapData(bf.FilterData(src, lambda i: i != 37) if start_method == "fork" else
                                         bf.DataFromList([i for i in range(64) if i != 37], shuffle=False),
                                         2, load, start_method=start_method)
            df = bf.PrintData(bf.BatchData(bf.MapDataComponent(par, lambda v: v * 2, "label"), 8, pad_value=0))
            with df:
                df.reset_state()
                assert sum(1 for _ in df) == 7
            failing = bf.MultiProcessMapData(bf.DataFromList(list(range(64)), shuffle=False), 2, load,
                                             start_method=start_method)
            with failing:
                failing.reset_state()
                try:
                    list(failing)
                except KeyError:
                    pass
                else:
                    raise AssertionError("the worker's KeyError did not arrive")
                for dp in failing:
                    break
        with bf.MultiThreadRunner(lambda: bf.DataFromList([[1]] * 4), num_thread=2) as runner:
            runner.reset_state()
            assert len(list(runner)) == 4
"""


def test_the_core_prints_nothing(tmp_path):
    """Only the CLI and TestDataSpeed print. A pipeline that logs (PrintData), fails in a worker and stops
    early leaves stdout and stderr empty, in this process and in its workers, when logging is not set up."""
    script = tmp_path / "quiet.py"
    script.write_text(textwrap.dedent(QUIET))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (out.stdout, out.stderr) == ("", "")
