"""``bridgeflow serve`` in a real subprocess, read back by RemoteDataZMQ."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from bridgeflow import DataFromList
from bridgeflow._cli_remote import DEFAULT_ADDR, register
from bridgeflow.remote import RemoteDataZMQ
from bridgeflow.serialize._lmdb_format import LMDBSerializer
from bridgeflow.testing import assert_same_datapoints

# Runs the real ``bridgeflow`` main with the serve command registered (a no-op once the CLI lists it).
MAIN = ("import sys, bridgeflow.cli as c; m = 'bridgeflow._cli_remote'; "
        "c._COMMAND_MODULES += () if m in c._COMMAND_MODULES else (m,); sys.exit(c.main(sys.argv[1:]))")


def datapoints(n: int = 12) -> list:
    return [[np.arange(6, dtype=np.float32).reshape(2, 3) + i, i] for i in range(n)]


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", MAIN, "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def read_all(addr: str) -> list:
    with RemoteDataZMQ(addr, timeout=20) as df:
        df.reset_state()
        return list(df)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_serve_a_python_function(tmp_path, leak_check):
    src = tmp_path / "flows.py"
    src.write_text(textwrap.dedent("""
        import numpy as np
        from bridgeflow import DataFromList

        def train():
            return DataFromList([[np.arange(6, dtype=np.float32).reshape(2, 3) + i, i] for i in range(12)],
                                shuffle=False)
    """))
    addr = f"ipc://{tmp_path}/serve.sock"
    proc = serve(f"{src}:train", "--addr", addr, "--epochs", "2", "--heartbeat", "0.2")
    first, second = None, None
    with RemoteDataZMQ(addr, timeout=20) as df:
        df.reset_state()
        first, second = list(df), list(df)
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert_same_datapoints(first, datapoints(), ordered=True)
    assert_same_datapoints(second, datapoints(), ordered=True)
    assert "served 24 datapoints" in out
    assert f"serve {addr}" in err and "24/24" in err  # the progress line


def test_serve_with_keys_reaches_only_a_consumer_with_the_keys(tmp_path, leak_check):
    from bridgeflow.remote import ProducerLostError, generate_keys

    src = tmp_path / "flows.py"
    src.write_text("import numpy as np\nfrom bridgeflow import DataFromList\n\ndef train():\n"
                   "    return DataFromList([[np.arange(6, dtype=np.float32).reshape(2, 3) + i, i] for i in range(12)],"
                   " shuffle=False)\n")
    keys = str(generate_keys(tmp_path / "keys").source)
    addr = f"ipc://{tmp_path}/serve.sock"
    proc = serve(f"{src}:train", "--addr", addr, "--keys", keys, "--heartbeat", "0.2", "--quiet")
    try:
        with RemoteDataZMQ(addr, timeout=1.5) as plain:  # no keys: the handshake fails, nothing is read
            plain.reset_state()
            with pytest.raises(ProducerLostError, match="sent nothing"):
                list(plain)
        with RemoteDataZMQ(addr, timeout=20, keys=keys) as df:
            df.reset_state()
            got = list(df)
    finally:
        rc, out, err = finish(proc)
    assert rc == 0, err
    assert_same_datapoints(got, datapoints(), ordered=True)


@pytest.fixture
def lmdb_path(tmp_path):
    # made before leak_check starts watching: tqdm starts its monitor thread even for a disabled bar
    path = tmp_path / "data.lmdb"
    LMDBSerializer.save(DataFromList(datapoints(), shuffle=False), str(path), progress=False)
    return path


def test_serve_an_lmdb_file(tmp_path, lmdb_path, leak_check):
    path = lmdb_path
    addr = f"ipc://{tmp_path}/lmdb.sock"
    proc = serve(str(path), "--addr", addr, "--quiet")
    got = read_all(addr)
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert_same_datapoints(got, datapoints(), ordered=True)
    assert err == ""  # --quiet: no progress line


@pytest.mark.parametrize("source, message", [
    ("no_such_file.lmdb", "no such file: no_such_file.lmdb"),
    ("math:pi", "not a DataFlow"),
    ("bridgeflow:NoSuchThing", "NoSuchThing"),
])
def test_bad_sources_are_named(source, message, tmp_path):
    proc = serve(source, "--addr", f"ipc://{tmp_path}/x.sock", "--quiet")
    rc, _, err = finish(proc)
    assert rc == 1 and message in err


def test_bad_address_is_named(tmp_path):
    src = tmp_path / "one.py"
    src.write_text("from bridgeflow import DataFromList\n\ndef flow():\n    return DataFromList([[1]])\n")
    rc, _, err = finish(serve(f"{src}:flow", "--addr", "udp://127.0.0.1:1"))
    assert rc == 1 and "udp://127.0.0.1:1" in err and "tcp://" in err


def test_register_defaults_to_loopback():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "mod:fn"])
    assert args.addr == DEFAULT_ADDR and DEFAULT_ADDR.startswith("tcp://127.0.0.1:")
    assert args.epochs == 1 and args.hwm == 50 and callable(args.func)


def test_an_address_other_machines_reach_needs_keys_or_allow_insecure(tmp_path):
    """Without --keys, serve binds only loopback or ipc://: any peer that can connect could read the stream.
    The error names both ways out; --allow-insecure binds (here, a wildcard) for a network you trust."""
    import socket

    src = tmp_path / "one.py"
    src.write_text("from bridgeflow import DataFromList\n\ndef flow():\n    return DataFromList([[1]])\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://0.0.0.0:{port}"
    rc, _, err = finish(serve(f"{src}:flow", "--addr", addr, "--quiet"))
    assert rc == 1 and addr in err
    assert "keys=FOLDER" in err and "bridgeflow keys FOLDER" in err and "--allow-insecure" in err, err
    proc = serve(f"{src}:flow", "--addr", addr, "--quiet", "--allow-insecure", "--send-timeout", "20")
    got = read_all(f"tcp://127.0.0.1:{port}")
    rc, out, err = finish(proc)
    assert rc == 0 and [int(dp[0]) for dp in got] == [1], err
