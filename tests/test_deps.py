"""A missing optional package is a MissingDependencyError naming its extra and a command that installs it, run as
printed from any folder: each case makes the import fail for real, in a subprocess whose import system refuses
the package, and goes through the public entry point a user calls."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from bridgeflow._deps import EXTRAS, install_hint
from conftest import source_tree

BLOCK = """
import sys

class Block:  # the package and its submodules cannot be imported, as when it is not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {top!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

for name in [m for m in sys.modules if m.split(".")[0] == {top!r}]:
    del sys.modules[name]
sys.meta_path.insert(0, Block())
import numpy as np
import bridgeflow as bf
"""

# (blocked module, the extra, what a user does)
CASES = [
    ("torch", "torch", "import bridgeflow.adapters.torch"),
    ("tensorflow", "tensorflow", "import bridgeflow.adapters.tensorflow"),
    ("lmdb", "lmdb", "bf.LMDBSerializer.save(bf.DataFromList([[1]]), 'x.lmdb')"),
    ("h5py", "hdf5", "bf.HDF5Serializer.save(bf.DataFromList([[np.zeros(2)]]), 'x.h5')"),
    ("msgpack", "msgpack", "from bridgeflow.serialize import decode_tensorpack; decode_tensorpack(b'\\x91\\x01')"),
    ("zmq", "zmq", "from bridgeflow.remote import RemoteDataZMQ; RemoteDataZMQ('tcp://127.0.0.1:9').reset_state()"),
    ("ray", "ray", "from bridgeflow.remote import RayMapData; RayMapData(bf.DataFromList([[1]]), lambda d: d)"
                   ".reset_state()"),
    ("cv2", "images", "from bridgeflow import imgaug; imgaug.Resize((4, 4)).augment(np.zeros((8, 8, 3), np.uint8))"),
    ("PIL", "images", "from bridgeflow.serialize import read_image; open('x.png', 'wb').close(); "
                      "read_image('x.png', decode=True)"),
]


@pytest.mark.parametrize("top, extra, code", CASES, ids=[c[0] for c in CASES])
def test_a_missing_package_is_named_with_a_command_that_installs_it(tmp_path, top, extra, code):
    script = BLOCK.format(top=top) + textwrap.dedent(f"""
        try:
            {code}
        except bf.MissingDependencyError as exc:
            print("MDE:", exc)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    message = out.stdout.partition("MDE: ")[2].strip()
    assert message, f"no MissingDependencyError: {out.stdout}{out.stderr}"
    assert f"needs {top}, which is not installed" in message and f'"{extra}" extra' in message, message
    command = message.partition("install it with: ")[2].partition("  (")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["pip", "install"], message
    assert "-e" not in argv and not any(a.startswith((".", "bridgeflow")) for a in argv), message  # any folder
    assert [a for a in argv[2:] if not a.startswith("-") and "://" not in a] == list(EXTRAS[extra])
    if top == "torch":  # the CPU build: a plain `pip install torch` pulls a multi-GB CUDA build on Linux
        assert argv[argv.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu", message


def test_a_package_that_fails_to_import_says_so(tmp_path):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        sys.modules["h5py"] = None  # what Python does with a package that is there but cannot be imported
        import bridgeflow as bf
        try:
            bf.HDF5Serializer.save(bf.DataFromList([[1]]), "x.h5")
        except bf.MissingDependencyError as exc:
            print(exc)
        """)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "needs h5py" in out.stdout and 'pip install "h5py>=3.6"' in out.stdout, out.stdout


def test_the_extras_are_setup_cfg_s():
    """The install hints name what setup.cfg's extras install, bounds included."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(source_tree(), "setup.cfg"))
    extras = cfg["options.extras_require"]
    for extra, requirements in EXTRAS.items():
        assert tuple(r.strip() for r in extras[extra].splitlines() if r.strip()) == requirements, extra
    in_all = {r.strip() for r in extras["all"].splitlines() if r.strip()}
    assert in_all == {r for rs in EXTRAS.values() for r in rs}


def test_an_unknown_module_gets_a_plain_hint():
    assert install_hint("somepackage.sub") == "pip install somepackage"
    assert re.fullmatch(r'pip install "pyzmq>=\d+"  \(bridgeflow\'s "zmq" extra\)', install_hint("zmq.auth"))
