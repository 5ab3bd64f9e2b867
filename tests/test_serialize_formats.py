"""Which paths the readers open and what format they take a file for (bridgeflow.serialize._pinned,
_common.sniff, _formats): only regular files, never waited on; each format by its signature at its real
place, so HDF5 files with user blocks (even one holding a zip) load as HDF5."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from bridgeflow import DataFromList
from bridgeflow.serialize import CorruptDataError, HDF5Serializer, NumpySerializer, detect_format, load_dataset
from conftest import PROMPTLY_S

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import crafted

LOAD = textwrap.dedent("""
    import sys, time
    from bridgeflow.serialize import HDF5Serializer, LMDBSerializer, NumpySerializer, load_dataset
    loaders = {"lmdb": LMDBSerializer.load, "hdf5": HDF5Serializer.load, "npz": NumpySerializer.load,
               "any": load_dataset}
    for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
        for loader in loaders:
            t0 = time.monotonic()
            try:
                loaders[loader](path)
                out = "loaded"
            except BaseException as exc:
                out = f"{type(exc).__name__}: {exc}"
            print(f"{name} {loader} {time.monotonic() - t0:.2f} {out}", flush=True)
""")


def test_a_path_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """A FIFO hung every loader (an open for reading waits for a writer), /dev/zero ran NumpyData out of
    memory and /dev/urandom read as LMDB said "cut to 0 bytes". Each is refused at once by every loader,
    saying what it is (one process for all: a loader that hangs makes it time out)."""
    fifo, sock, folder = tmp_path / "data.fifo", tmp_path / "data.sock", tmp_path / "folder"
    os.mkfifo(fifo)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    folder.mkdir()
    kinds = {"fifo": (str(fifo), "a FIFO (named pipe)"), "socket": (str(sock), "a socket"),
             "folder": (str(folder), "a folder"), "zero": ("/dev/zero", "a character device"),
             "urandom": ("/dev/urandom", "a character device")}
    try:
        proc = subprocess.run([sys.executable, "-c", LOAD, *[x for k, (p, _) in kinds.items() for x in (k, p)]],
                              capture_output=True, text=True, timeout=PROMPTLY_S)
    finally:
        s.close()
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 * len(kinds), proc.stdout + proc.stderr[-2000:]
    for line in lines:
        what, loader, seconds, out = line.split(" ", 3)
        path, kind = kinds[what]
        assert float(seconds) < 5, line
        if what == "folder" and loader in ("lmdb", "any"):  # an LMDB folder is what these take: no data.mdb here
            assert out.startswith(("CorruptDataError", "DatasetNotFoundError")) and path in out, line
        else:
            assert out.startswith("CorruptDataError") and f"{path} is {kind}, not a regular file" in out, line


def _sample_hdf5(path, rows=12):
    HDF5Serializer.save(DataFromList([[np.full((2, 3), i, np.int32), i] for i in range(rows)], shuffle=False), path,
                        progress=False)


@pytest.mark.parametrize("size", [512, 1024, 4096])
@pytest.mark.parametrize("zip_inside", [False, True])
def test_hdf5_files_with_a_user_block_load_as_hdf5(tmp_path, size, zip_inside):
    """h5py reads a file whose superblock follows a user block; it was refused as truncated (the end of the
    file libhdf5 records counts the user block), and one whose user block holds a zip was taken for an npz."""
    path = tmp_path / "ub.h5"
    crafted.hdf5_userblock(str(path), size, zip_inside=zip_inside, rows=16)
    assert (path.read_bytes()[:4] == b"PK\x03\x04") == zip_inside
    assert detect_format(str(path)) == "hdf5"
    ds = load_dataset(path)
    assert [int(dp[1]) for dp in ds] == list(range(16))
    assert int(ds[7][0][0, 0]) == 7
    with pytest.raises(CorruptDataError, match="is an HDF5 file, not an npz"):
        NumpySerializer.load(path)


def test_a_zip_is_an_npz_only_when_its_end_record_ends_the_file(tmp_path):
    good = tmp_path / "d.npz"
    NumpySerializer.save(DataFromList([[i] for i in range(5)], shuffle=False), good, progress=False)
    members = crafted._members(str(good))
    rows = [(n, "stored", len(d), zlib.crc32(d), d) for n, d in members]
    prefixed = tmp_path / "prefixed.bin"  # a zip behind other bytes (a self-extracting archive's shape)
    crafted.write_zip(str(prefixed), rows, prefix=b"#!/bin/sh\n" + bytes(600))
    assert detect_format(str(prefixed)) == "npz"  # by its end record: no signature at byte 0
    assert [dp[0] for dp in NumpySerializer.load(prefixed, shuffle=False)] == list(range(5))
    assert detect_format(str(good)) == "npz"
    cut = tmp_path / "cut.data"  # starts like a zip, its end record gone and no HDF5 inside: a damaged npz
    cut.write_bytes(good.read_bytes()[:-30])
    assert detect_format(str(cut)) == "npz"
    with pytest.raises(CorruptDataError, match="cut.data"):
        load_dataset(cut)
    h5 = tmp_path / "plain.h5"
    _sample_hdf5(h5)
    assert detect_format(str(h5)) == "hdf5"
