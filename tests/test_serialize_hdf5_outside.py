"""HDF5 files nobody vouches for: nothing outside the file is read (external links, soft links leading out
through them, external raw storage, virtual datasets), in every reader and in ``bridgeflow serialize``,
unless the caller opts in; and memory stays in proportion to the file whatever counts it declares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from bridgeflow import DataFromList
from bridgeflow.serialize import CorruptDataError, ExternalDataError, HDF5Serializer, load_dataset
from bridgeflow.serialize._hdf5_format import HDF5Data

ROW = 32


@pytest.fixture
def secret(tmp_path):
    """A file of the reader's that no dataset file may make it read."""
    path = tmp_path / "private" / "passwd"
    path.parent.mkdir()
    path.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)  # 4 rows of 32 bytes
    return path


def other_file(tmp_path, secret):
    path = tmp_path / "private" / "other.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f["data"] = np.frombuffer(secret.read_bytes(), np.uint8).reshape(-1, ROW)
    return path


def external_storage(tmp_path, secret):
    path = tmp_path / "ext_storage.h5"
    n = secret.stat().st_size
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("data", shape=(n // ROW, ROW), dtype="u1", external=[(str(secret), 0, n)])
    return path, f"stores its data in 1 other file(s): {secret}"


def external_link(tmp_path, secret):
    other = other_file(tmp_path, secret)
    path = tmp_path / "ext_link.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f["data"] = h5py.ExternalLink(str(other), "/data")
    return path, f"external link /data -> {other}:/data"


def soft_link_out(tmp_path, secret):
    other = other_file(tmp_path, secret)
    path = tmp_path / "soft_out.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f["inner/g"] = h5py.ExternalLink(str(other), "/")
        f["data"] = h5py.SoftLink("inner/g/data")  # relative, through a group, out through the external link
    return path, f"external link /inner/g -> {other}:/"


def virtual(tmp_path, secret):
    other = other_file(tmp_path, secret)
    path = tmp_path / "virtual.h5"
    rows = secret.stat().st_size // ROW
    with h5py.File(path, "w", libver="latest") as f:
        layout = h5py.VirtualLayout(shape=(rows, ROW), dtype="u1")
        layout[:] = h5py.VirtualSource(str(other), "data", shape=(rows, ROW))
        f.create_virtual_dataset("data", layout)
    return path, f"is a virtual dataset, read from 1 source(s): {other}:data"


CRAFTED = [external_storage, external_link, soft_link_out, virtual]


@pytest.mark.parametrize("craft", CRAFTED, ids=lambda c: c.__name__)
def test_a_dataset_pointing_outside_the_file_is_refused_naming_it(tmp_path, secret, craft):
    path, what = craft(tmp_path, secret)
    with pytest.raises(ExternalDataError) as info:
        HDF5Serializer.load(path, data_paths=["data"], shuffle=False)
    message = str(info.value)
    assert str(path) in message and "dataset 'data'" in message and what in message, message
    assert "allow_external=True" in message
    # the opt-in reads it: the file really points at the secret
    with HDF5Serializer.load(path, data_paths=["data"], shuffle=False, allow_external=True) as ds:
        ds.reset_state()
        assert bytes(ds[0][0]) == secret.read_bytes()[:ROW]


def test_links_inside_the_file_are_followed(tmp_path):
    path = tmp_path / "inside.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f["g/real"] = np.arange(12).reshape(6, 2)
        f["alias"] = h5py.SoftLink("/g/real")
        f["g/again"] = h5py.SoftLink("real")  # relative to its group
        f["hard"] = f["g/real"]
    for name in ("alias", "g/again", "hard"):
        with HDF5Serializer.load(path, data_paths=[name], shuffle=False) as ds:
            ds.reset_state()
            assert [int(dp[0][1]) for dp in ds] == [1, 3, 5, 7, 9, 11]


def test_a_soft_link_loop_is_an_error(tmp_path):
    path = tmp_path / "loop.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f["a"] = h5py.SoftLink("/b")
        f["b"] = h5py.SoftLink("/a")
    with pytest.raises(CorruptDataError, match="loop.h5: dataset 'a': more than 16 soft links"):
        HDF5Serializer.load(path, data_paths=["a"])


def format_1_with_external_images(path, secret):
    """A bridgeflow file of format version 1 (fixed-shape arrays carry no per-row CRC there) whose image
    column is stored in another file."""
    n = secret.stat().st_size
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("0", shape=(n // ROW, ROW), dtype="u1", external=[(str(secret), 0, n)])
        f["1"] = np.arange(n // ROW)
        columns = [{"name": "0", "kind": "array", "dtype": "|u1", "shape": [ROW]},
                   {"name": "1", "kind": "scalar", "dtype": "<i8", "pytype": "int"}]
        f.attrs.update({"bridgeflow_format": "bridgeflow-hdf5", "bridgeflow_version": 1, "count": n // ROW,
                        "structure": "list", "columns": json.dumps(columns)})
    return path


def test_format_1_files_are_checked_too(tmp_path, secret):
    path = format_1_with_external_images(tmp_path / "v1.h5", secret)
    with pytest.raises(ExternalDataError, match="v1.h5: dataset '0' stores its data in 1 other file"):
        load_dataset(path)
    with load_dataset(path, allow_external=True) as ds:
        ds.reset_state()
        assert bytes(ds[1][0]) == secret.read_bytes()[ROW:2 * ROW]


def test_bridgeflow_serialize_refuses_and_writes_nothing(tmp_path, secret):
    path = format_1_with_external_images(tmp_path / "v1.h5", secret)
    out = tmp_path / "copy.lmdb"
    proc = subprocess.run(["bridgeflow", "serialize", str(path), str(out), "--quiet"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert f"{path}: dataset '0' stores its data in 1 other file(s): {secret}" in proc.stderr, proc.stderr
    assert "--allow-external" in proc.stderr
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["private", "v1.h5"]
    proc = subprocess.run(["bridgeflow", "inspect", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "other file(s)" in proc.stderr, proc.stderr
    proc = subprocess.run(["bridgeflow", "serialize", str(path), str(out), "--quiet", "--allow-external"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with load_dataset(out) as ds:
        ds.reset_state()
        assert len(ds) == 4 and bytes(ds[0][0]) == secret.read_bytes()[:ROW]


MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys
    from bridgeflow.serialize import HDF5Serializer
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        ds = HDF5Serializer.load(sys.argv[1], shuffle=False, data_paths=sys.argv[2:] or None)
        ds.reset_state()
        print("read", len(ds), ds[len(ds) - 1])
    except Exception as exc:
        print(type(exc).__name__, exc)
    print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
""")


def declared_rows(path, n, *, bridgeflow=True):
    """A 1-2 KB file declaring ``n`` rows and storing none (libhdf5 reads fill values for them)."""
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("0", shape=(n,), dtype="<i8", chunks=(4096,), maxshape=(None,), fletcher32=True)
        if bridgeflow:
            f.create_dataset("__bf_crc__/0", shape=(n,), dtype="<u4", chunks=(4096,), maxshape=(None,))
            f.attrs.update({"bridgeflow_format": "bridgeflow-hdf5", "bridgeflow_version": 2, "count": n,
                            "structure": "list",
                            "columns": json.dumps([{"name": "0", "kind": "scalar", "dtype": "<i8"}])})
    return path


@pytest.mark.parametrize("bridgeflow", [True, False], ids=["bridgeflow", "foreign"])
def test_declared_rows_without_storage_cost_no_memory(tmp_path, bridgeflow):
    path = declared_rows(tmp_path / "huge.h5", 500_000_000, bridgeflow=bridgeflow)
    assert path.stat().st_size < 16 << 10
    args = [] if bridgeflow else ["0"]
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path), *args], capture_output=True, text=True,
                          timeout=120)
    first, grew = proc.stdout.splitlines()
    assert first.startswith("CorruptDataError") and "huge.h5: dataset '0" in first, proc.stdout + proc.stderr
    assert "declares shape (500000000,) (4000000000 bytes) but holds 0 bytes" in first or \
        "declares shape (500000000,) (2000000000 bytes) but holds 0 bytes" in first, first
    assert int(grew.split()[1]) < 64 << 10, grew  # KiB: not the 2-4 GB the declared rows would take


def test_a_sound_file_still_loads_under_the_storage_check(tmp_path):
    dps = [[np.full((300, 300), i, np.uint8), i, "x" * i] for i in range(40)]  # 3.6 MB of images
    path = tmp_path / "ok.h5"
    HDF5Serializer.save(DataFromList(dps, shuffle=False), path, progress=False)
    with HDF5Data(path, shuffle=False) as ds:
        ds.reset_state()
        assert [dp[1] for dp in ds] == list(range(40))
    compressed = tmp_path / "gz.h5"
    with h5py.File(compressed, "w", libver="latest") as f:  # a foreign file: zeros compress 1000-fold
        f.create_dataset("z", data=np.zeros((64, 1 << 16), np.uint8), chunks=(1, 1 << 16), compression="gzip")
    assert compressed.stat().st_size < 1 << 20
    with HDF5Serializer.load(compressed, data_paths=["z"], shuffle=False) as ds:
        ds.reset_state()
        assert len(ds) == 64 and not ds[63][0].any()
