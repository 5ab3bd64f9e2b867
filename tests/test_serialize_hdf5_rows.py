"""HDF5 array rows read straight from the file (``_hdf5_rows``): the same rows h5py reads, a damaged row
named, a file cut while read an error, and any other layout left to h5py."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from bridgeflow import DataFromList, HDF5Serializer
from bridgeflow.serialize import CorruptDataError
from bridgeflow.serialize._hdf5_rows import DirectRows, direct_rows
from bridgeflow.serialize._pinned import PinnedFile

SHAPES = {"u1_image": ((3, 17, 5), np.uint8), "f4_vector": ((300,), np.float32), "i2_cube": ((2, 3, 4), np.int16),
          "c8_pair": ((2,), np.complex64)}


def _rows(kind: str, n: int) -> list:
    shape, dtype = SHAPES[kind]
    rng = np.random.default_rng(len(kind))
    return [[(rng.standard_normal(shape) * 100).astype(dtype), i] for i in range(n)]


def _direct(ds) -> list:
    return [column[1] for column in ds._datasets() if isinstance(column[1], DirectRows)]


@pytest.mark.parametrize("kind", list(SHAPES))
def test_rows_read_from_the_file_are_h5pys_rows(kind, tmp_path):
    n = 700
    rows = _rows(kind, n)
    path = str(tmp_path / "d.h5")
    HDF5Serializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with h5py.File(path, "r") as f:
        want = f["0"][...]
    for shuffle in (False, True):
        with HDF5Serializer.load(path, shuffle=shuffle, seed=4) as ds:
            ds.reset_state()
            assert len(_direct(ds)) == 1  # the array column is read straight from the file
            got = list(ds)
            order = list(ds._order.runs(0)[0])
            assert [dp[1] for dp in got] == order
            for i, dp in zip(order, got):
                assert dp[0].dtype == want.dtype and dp[0].shape == want.shape[1:]
                assert dp[0].tobytes() == want[i].tobytes()
            assert ds[n - 1][0].tobytes() == want[n - 1].tobytes()
            got[0][0][...] = 0  # writable, and the datapoint's own
            assert got[1][0].tobytes() == want[order[1]].tobytes()
            it = iter(ds)
            first = [next(it) for _ in range(333)]  # inside a sequential block
            state = ds.state_dict()
            rest = list(it)
            epoch = list(ds._order.runs(1)[0])
        with HDF5Serializer.load(path, shuffle=shuffle, seed=4) as again:
            again.load_state_dict(state)
            again.reset_state()
            resumed = list(again)
        assert [dp[1] for dp in first + rest] == epoch
        assert [dp[1] for dp in resumed] == epoch[333:]
        assert all(a[0].tobytes() == b[0].tobytes() for a, b in zip(rest, resumed))


@pytest.mark.parametrize("chunk_rows", [1, 2, 3])
def test_chunks_of_several_rows_and_a_partial_last_chunk(chunk_rows, tmp_path):
    data = np.arange(7 * 6, dtype=np.int32).reshape(7, 2, 3)
    path = str(tmp_path / "c.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(chunk_rows, 2, 3), maxshape=(None, 2, 3))
    pin = PinnedFile(path)
    try:
        with h5py.File(path, "r") as f:
            rows = direct_rows(f["x"], pin, path)
        assert rows is not None
        assert [rows.row(i).tolist() for i in range(7)] == data.tolist()
        for a in range(7):
            for b in range(a + 1, 8):
                assert rows.rows(a, b).tolist() == data[a:b].tolist()
    finally:
        pin.close()


@pytest.mark.parametrize("layout", ["gzip", "fletcher32", "contiguous", "chunk_splits_rows", "big_endian",
                                    "unwritten_chunks"])
def test_other_layouts_are_left_to_h5py(layout, tmp_path):
    data = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    path = str(tmp_path / "o.h5")
    with h5py.File(path, "w") as f:
        if layout == "gzip":
            f.create_dataset("x", data=data, chunks=(1, 4), compression="gzip")
        elif layout == "fletcher32":
            f.create_dataset("x", data=data, chunks=(1, 4), fletcher32=True)
        elif layout == "contiguous":
            f.create_dataset("x", data=data)
        elif layout == "chunk_splits_rows":
            f.create_dataset("x", data=data, chunks=(2, 2))
        elif layout == "big_endian":
            f.create_dataset("x", data=data.astype(">f4"), chunks=(1, 4))
        else:
            ds = f.create_dataset("x", shape=(8, 4), dtype=np.float32, chunks=(1, 4))
            ds[:4] = data[:4]  # chunks 4..7 never written: libhdf5 gives the fill value, no bytes lie in the file
    pin = PinnedFile(path)
    try:
        with h5py.File(path, "r") as f:
            assert direct_rows(f["x"], pin, path) is None
    finally:
        pin.close()


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x20]))


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_damaged_row_is_named(shuffle, tmp_path):
    path = str(tmp_path / "d.h5")
    HDF5Serializer.save(DataFromList(_rows("f4_vector", 400), shuffle=False), path, progress=False)
    with HDF5Serializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        at = int(_direct(ds)[0].at[313])
    _flip(path, at + 555)  # a byte inside row 313's array
    with HDF5Serializer.load(path, shuffle=shuffle, seed=0) as ds:
        ds.reset_state()
        seen = []
        with pytest.raises(CorruptDataError, match=r"d\.h5: datapoint 313, component '0': checksum mismatch"):
            for dp in ds:
                seen.append(dp[1])
        assert 313 not in seen
        if shuffle:
            assert seen == list(ds._order.runs(0)[0])[:len(seen)]
            assert len(seen) == list(ds._order.runs(0)[0]).index(313)
        with pytest.raises(CorruptDataError, match="datapoint 313"):
            ds[313]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_file_cut_while_read_is_an_error(shuffle, tmp_path):
    path = str(tmp_path / "d.h5")
    HDF5Serializer.save(DataFromList(_rows("f4_vector", 3000), shuffle=False), path, progress=False)
    with HDF5Serializer.load(path, shuffle=shuffle, seed=1) as ds:
        ds.reset_state()
        assert _direct(ds)
        it = iter(ds)
        next(it)
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(CorruptDataError, match=r"d\.h5: the file was cut to"):
            for _ in it:
                pass
