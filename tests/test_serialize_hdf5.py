"""HDF5Serializer and HDF5Data on real HDF5 files: every column kind, ragged upgrade, atomic saves, bad files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib

import h5py
import numpy as np
import pytest

from bridgeflow import DataFromGenerator, DataFromList
from bridgeflow._errors import DatapointError
from bridgeflow.serialize import (
    CorruptDataError,
    DatasetNotFoundError,
    TargetExistsError,
    UnsupportedFormatError,
)
from bridgeflow.serialize._hdf5_format import HDF5Data, HDF5Serializer
from bridgeflow.testing import assert_same_datapoints, check_dataflow
from conftest import results_of_forked_children


def every_kind(n=30):
    return [[np.full((3, 4), i, np.float32), i, f"n{i}é", b"\x00ab" * i, np.arange(i % 4, dtype=np.int16),
             1.5 * i, np.float32(i), np.array(i), np.zeros((0, 2)), i % 2 == 0, np.ones((2, i % 3 + 1), bool)]
            for i in range(n)]


def save(tmp_path, dps, name="d.h5", **kw):
    path = tmp_path / name
    kw.setdefault("progress", False)
    HDF5Serializer.save(DataFromList(dps, shuffle=False), path, **kw)
    return path


def test_every_column_kind_roundtrips(tmp_path):
    dps = every_kind()
    path = save(tmp_path, dps)
    out = check_dataflow(HDF5Serializer.load(path, shuffle=False), deterministic=True)
    assert_same_datapoints(dps, out)
    assert type(out[3][1]) is int and type(out[3][5]) is float and type(out[3][9]) is bool
    assert type(out[3][6]) is np.float32
    assert sorted(os.listdir(tmp_path)) == ["d.h5"]


def test_layout_chunked_datasets_and_attrs(tmp_path):
    path = save(tmp_path, every_kind(10), data_paths=[f"c{i}" for i in range(11)])
    # checksummed metadata: superblock version 2 or 3 (a read handle's f.libver is the reader's setting,
    # 'earliest' with h5py 3.16, not the file's), readable by HDF5 1.10 to 1.14 as well as 2.0
    assert path.read_bytes()[:9] in (b"\x89HDF\r\n\x1a\n\x02", b"\x89HDF\r\n\x1a\n\x03")
    with h5py.File(path, "r") as f:
        assert f["c0"].shape == (10, 3, 4) and f["c0"].chunks is not None
        # bulky data relies on the row CRCs (fletcher32 nearly doubled read time); small index datasets keep it
        assert not f["c0"].fletcher32 and not f["c2"].fletcher32 and not f["c4"].fletcher32
        assert f["c1"].fletcher32 and f["__bf_offsets__/c4"].fletcher32 and f["__bf_crc__/c0"].fletcher32
        # ragged: the values end to end, row offsets and shapes beside them; nothing variable-length
        assert f["c4"].dtype == np.int16 and f["c4"].shape == (sum(i % 4 for i in range(10)),)
        assert f["__bf_offsets__/c4"].shape == (11,) and f["__bf_shapes__/c4"].shape == (10, 1)
        assert f["c2"].dtype == np.uint8 and bytes(f["c2"][:4]) == "n0é".encode()
        assert all(f[f"__bf_crc__/c{i}"].shape == (10,) for i in range(11))  # a CRC per row of each

        def no_vlen(name, obj):
            assert h5py.check_vlen_dtype(obj.dtype) is None and h5py.check_string_dtype(obj.dtype) is None, name
        f.visititems(lambda name, obj: no_vlen(name, obj) if isinstance(obj, h5py.Dataset) else None)
        for key in f.attrs:
            assert f.attrs.get_id(key).dtype.kind in "Si", key  # fixed-length, in the checksummed header
        assert f.attrs["bridgeflow_format"] == b"bridgeflow-hdf5" and f.attrs["count"] == 10
        assert f.attrs["bridgeflow_version"] == 2
        kinds = [c["kind"] for c in json.loads(f.attrs["columns"])]
    assert kinds == ["array", "scalar", "str", "bytes", "ragged", "scalar", "scalar", "array", "array",
                     "scalar", "ragged"]


def test_shuffled_random_access_and_subset(tmp_path):
    dps = every_kind(40)
    path = save(tmp_path, dps, data_paths=[f"c{i}" for i in range(11)])
    ds = HDF5Serializer.load(path, shuffle=True, seed=2)
    assert_same_datapoints(dps, check_dataflow(ds), ordered=False)
    with HDF5Data(path, data_paths=["c2", "c0"], shuffle=False) as sub:
        assert len(sub) == 40
        assert sub[5][0] == "n5é" and sub[-1][1].shape == (3, 4)
        with pytest.raises(IndexError):
            sub[40]
    with pytest.raises(KeyError, match="nope"):  # ComponentNotFoundError is a KeyError
        HDF5Data(path, data_paths=["nope"])


def test_dict_datapoints_and_key_selection(tmp_path):
    dps = [{"img": np.zeros((2, 2), np.uint8) + i, "label": i, "name": str(i)} for i in range(7)]
    path = save(tmp_path, dps)
    assert_same_datapoints(dps, check_dataflow(HDF5Data(path, shuffle=False), deterministic=True))
    only = save(tmp_path, dps, name="only.h5", data_paths=["label", "img"])
    out = check_dataflow(HDF5Data(only, shuffle=False), deterministic=True)
    assert list(out[0]) == ["label", "img"]


def test_refusals_name_the_component(tmp_path):
    with pytest.raises(DatapointError, match="component '1'.*list"):
        save(tmp_path, [[1, [1, 2]]])
    with pytest.raises(DatapointError, match="component '0'.*object"):
        save(tmp_path, [[np.array([None])]])
    with pytest.raises(DatapointError, match="component 'x' of datapoint 1.*rank"):
        save(tmp_path, [{"x": np.zeros(3)}, {"x": np.zeros((3, 1))}])
    with pytest.raises(DatapointError, match="component '0' of datapoint 2"):
        save(tmp_path, [[1], [2], ["three"]])
    with pytest.raises(DatapointError, match="components"):
        save(tmp_path, [[1], [2, 3]])
    assert os.listdir(tmp_path) == []  # nothing half-written


def _failing(exc):
    def gen():
        for i in range(20):
            yield [np.zeros(100), i]
        raise exc
    return DataFromGenerator(gen)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_interrupted_save_leaves_directory_as_it_was(tmp_path, exc):
    (tmp_path / "keep.h5").write_bytes(b"x")
    with pytest.raises(type(exc)):
        HDF5Serializer.save(_failing(exc), tmp_path / "out.h5", progress=False)
    assert os.listdir(tmp_path) == ["keep.h5"]


def test_overwrite(tmp_path):
    path = save(tmp_path, [[1]])
    with pytest.raises(TargetExistsError, match="d.h5"):
        save(tmp_path, [[2]])
    save(tmp_path, [[2]], overwrite=True)
    assert check_dataflow(HDF5Data(path, shuffle=False)) == [[2]]


def test_foreign_hdf5_needs_data_paths(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f["x"] = np.arange(12).reshape(6, 2)
        f["y"] = np.arange(6)
        f["z"] = np.arange(5)
    with pytest.raises(CorruptDataError, match="data_paths"):
        HDF5Data(path)
    ds = HDF5Data(path, data_paths=["x", "y"], shuffle=False)
    out = check_dataflow(ds, deterministic=True)
    assert len(out) == 6 and out[2][0].tolist() == [4, 5] and out[2][1] == 2
    with pytest.raises(CorruptDataError, match="different lengths"):
        HDF5Data(path, data_paths=["x", "z"])


def test_hdf5_original_format_is_refused_unless_trusted(tmp_path):
    """h5py's default format has no metadata checksums: libhdf5 could loop on a damaged block."""
    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:  # libver="earliest": superblock version 0
        f["x"] = np.arange(6)
    with pytest.raises(CorruptDataError, match=r"old\.h5: written in HDF5's original file format .*verify=False"):
        HDF5Data(path, data_paths=["x"])
    with HDF5Serializer.load(path, data_paths=["x"], shuffle=False, verify=False) as ds:
        assert [dp[0] for dp in ds] == list(range(6))


def test_missing_garbage_wrong_format_truncated_and_future_version(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="missing.h5"):
        HDF5Serializer.load(tmp_path / "missing.h5")
    (tmp_path / "garbage.h5").write_bytes(os.urandom(4096))
    with pytest.raises(CorruptDataError, match="garbage.h5"):
        HDF5Serializer.load(tmp_path / "garbage.h5")
    lmdb_like = tmp_path / "wrong.lmdb"
    lmdb_like.write_bytes(b"\x00" * 8192)
    with pytest.raises(CorruptDataError, match="wrong.lmdb"):
        HDF5Serializer.load(lmdb_like)
    good = save(tmp_path, every_kind(20))
    data = good.read_bytes()
    for cut in (len(data) // 3, len(data) - 100):
        bad = tmp_path / f"cut{cut}.h5"
        bad.write_bytes(data[:cut])
        with pytest.raises(CorruptDataError, match=f"cut{cut}.h5"):
            ds = HDF5Serializer.load(bad, shuffle=False)
            list(ds)
    with h5py.File(good, "a") as f:
        f.attrs["bridgeflow_version"] = 7
    with pytest.raises(UnsupportedFormatError, match="version 7"):
        HDF5Serializer.load(good)


def test_flipped_bytes_never_crash_the_process(tmp_path):
    """Random flips anywhere in the file: the saved datapoints or a bridgeflow error, never other values,
    in a child process (variable-length rows are covered by their CRC, the rest by HDF5's checksums)."""
    path = save(tmp_path, every_kind(25))
    script = textwrap.dedent(f"""
        import os, random
        from bridgeflow._errors import BridgeflowError
        from bridgeflow.serialize._hdf5_format import HDF5Serializer
        from bridgeflow.testing import assert_same_datapoints
        data = open({str(path)!r}, "rb").read()
        ref = list(HDF5Serializer.load({str(path)!r}, shuffle=False))
        rng = random.Random(1)
        errors = 0
        for t in range(120):
            b = bytearray(data)
            for _ in range(rng.randint(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            p = os.path.join({str(tmp_path)!r}, "c%d.h5" % t)
            open(p, "wb").write(b)
            try:
                ds = HDF5Serializer.load(p, shuffle=False)
                got = list(ds)
                by_index = [ds[i] for i in range(len(ds))]
                ds.close()
                assert_same_datapoints(ref, got)  # read without an error: then exactly what was saved
                assert_same_datapoints(ref, by_index)
            except BridgeflowError:
                errors += 1
            os.unlink(p)
        print("errors", errors)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 0


def vlen_rows(n=12):
    return [[b"row%03d" % i * 10, f"text{i:03d}", np.arange(i, i + 3 + i % 2, dtype=np.int32) * 1000003]
            for i in range(n)]


@pytest.mark.parametrize(("needle", "component"), [(b"row007" * 10, "0"), (b"text007", "1"),
                                                     ((np.arange(7, 11, dtype=np.int32) * 1000003).tobytes(), "2")])
def test_damaged_variable_length_rows_are_detected(tmp_path, needle, component):
    path = save(tmp_path, vlen_rows())
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at > 0 and data.find(needle, at + 1) < 0  # one copy of that row in the file
    data[at + 1] ^= 0x01
    path.write_bytes(bytes(data))
    with HDF5Data(path, shuffle=False) as ds:
        ds.reset_state()
        with pytest.raises(CorruptDataError, match=r"d\.h5: .*(filter|checksum)"):
            list(ds)
        with pytest.raises(CorruptDataError, match=r"d\.h5"):
            ds[7]


@pytest.mark.parametrize(("column", "first_changed"), [("0", 0), ("1", 1), ("2", 0), ("3", 0)])
def test_a_chunk_that_passes_fletcher32_fails_the_row_crc(tmp_path, column, first_changed):
    """fletcher32 takes a chunk zeroed whole, its checksum too, for sound: the per-row CRC does not."""
    dps = [[np.full(8, 255, np.uint8), i, b"\xff\xff" * 4, np.full(2, -1, np.int32)] for i in range(6)]
    path = save(tmp_path, dps)
    with h5py.File(path, "r+") as f:
        ds = f[column]
        raw = ds.id.read_direct_chunk((0,) * ds.ndim)[1]
        ds.id.write_direct_chunk((0,) * ds.ndim, bytes(len(raw)))
        assert not ds[...].any()  # HDF5 itself reads zeros without complaint
    with HDF5Data(path, shuffle=False) as ds:
        ds.reset_state()
        match = rf"d\.h5: datapoint {first_changed}, component '{column}': checksum"
        with pytest.raises(CorruptDataError, match=match):
            list(ds)
        with pytest.raises(CorruptDataError, match=match):
            [ds[i] for i in range(len(ds))]


def save_v1(path, n=12):
    """A file laid out as HDF5Serializer wrote them before format version 2: variable-length rows and
    string attributes (in HDF5's global heaps), a CRC-32 per variable-length row."""
    rows = vlen_rows(n)
    with h5py.File(path, "w", libver="latest") as f:
        b = f.create_dataset("0", (n,), dtype=h5py.vlen_dtype(np.uint8), chunks=(1024,), maxshape=(None,))
        s = f.create_dataset("1", (n,), dtype=h5py.string_dtype("utf-8"), chunks=(1024,), maxshape=(None,))
        g = f.create_dataset("2", (n,), dtype=h5py.vlen_dtype(np.int32), chunks=(1024,), maxshape=(None,))
        for i, (raw, text, arr) in enumerate(rows):
            b[i], s[i], g[i] = np.frombuffer(raw, np.uint8), text, arr
        f.create_dataset("__bf_shapes__/2", data=np.array([[len(r[2])] for r in rows]), fletcher32=True,
                         chunks=(1024, 1), maxshape=(None, 1))
        for k, crcs in enumerate(([zlib.crc32(r[0]) for r in rows], [zlib.crc32(r[1].encode()) for r in rows],
                                  [zlib.crc32(r[2].astype("<i4").tobytes()) for r in rows])):
            f.create_dataset(f"__bf_crc__/{k}", data=np.array(crcs, np.uint32), fletcher32=True, chunks=(4096,),
                             maxshape=(None,))
        columns = [{"name": "0", "kind": "bytes"}, {"name": "1", "kind": "str"},
                   {"name": "2", "kind": "ragged", "dtype": "<i4", "shape": [4]}]
        f.attrs.update({"bridgeflow_format": "bridgeflow-hdf5", "bridgeflow_version": 1, "count": n,
                        "structure": "list", "columns": json.dumps(columns)})
    return path


def test_format_version_1_files_still_load(tmp_path):
    path = save_v1(tmp_path / "v1.h5")
    with h5py.File(path) as f:  # what made version 1 files hang when damaged
        assert h5py.check_string_dtype(f.attrs.get_id("columns").dtype) is not None
    assert_same_datapoints(vlen_rows(), check_dataflow(HDF5Data(path, shuffle=False), deterministic=True))
    with HDF5Data(path, shuffle=True, seed=0) as ds:
        assert_same_datapoints(vlen_rows(), [ds[i] for i in range(len(ds))])


HEAP_SCRIPT = """
import sys
from bridgeflow.serialize._hdf5_format import HDF5Data
try:
    HDF5Data(sys.argv[1], shuffle=False, verify=sys.argv[2] == "1")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_damaged_global_heap_is_an_error_not_a_hang(tmp_path):
    """A zeroed object header inside a global heap collection makes libhdf5 1.14 loop forever; the
    collections are walked before libhdf5 reads them."""
    path = save_v1(tmp_path / "v1.h5")
    data = bytearray(path.read_bytes())
    at = data.find(b"GCOL\x01")
    assert at > 0
    data[at + 16:at + 32] = bytes(16)  # the first object: index 0, size 0
    path.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, str(path), "1"], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.startswith("CorruptDataError"), proc.stdout + proc.stderr[-2000:]
    assert "v1.h5: damaged global heap collection at byte" in proc.stdout
    with pytest.raises(subprocess.TimeoutExpired):  # what the check prevents
        subprocess.run([sys.executable, "-c", HEAP_SCRIPT, str(path), "0"], capture_output=True, timeout=5)


def test_nul_characters_in_text_roundtrip(tmp_path):
    dps = [["a\x00b", b"\x00"], ["", b""]]
    path = save(tmp_path, dps)
    assert check_dataflow(HDF5Data(path, shuffle=False), deterministic=True) == dps


@pytest.mark.parametrize(("dps", "message"), [
    ([["ok"], ["\ud800"]], "component '0' of datapoint 1: .* is not valid UTF-8"),
    ([[2 ** 64]], "component '0' of datapoint 0: the int 18446744073709551616 does not fit in 64 bits"),
    ([{"": 1}], "component '' cannot be stored as HDF5 dataset"),
    ([{".": 1}], "component '.' cannot be stored"),
    ([{"a": 1, "a/b": 2}], "component 'a/b' cannot be stored"),
    ([{"__bf_crc__": b"x"}], "component '__bf_crc__': names starting with '__bf_' are reserved"),
])
def test_what_hdf5_cannot_hold_is_refused_naming_the_component(tmp_path, dps, message):
    with pytest.raises(DatapointError, match=message):
        save(tmp_path, dps)
    assert os.listdir(tmp_path) == []


def test_encoded_bytes_are_flushed_by_size_not_count(tmp_path):
    from bridgeflow.serialize import _hdf5_write

    with h5py.File(tmp_path / "w.h5", "w") as f:
        writer = _hdf5_write.HDF5Writer(f, None)
        for i in range(20):  # 20 x 1 MiB "images": flushed before 16 MiB pile up in memory
            writer.add([bytes(1 << 20), i], i)
            assert writer.pending_bytes < _hdf5_write._FLUSH_BYTES + (2 << 20)
        assert writer.count > 0


def _read_all(path, q):
    ds = HDF5Data(path, shuffle=True, seed=os.getpid())
    ds.reset_state()
    q.put(sorted(dp[1] for dp in ds))
    ds.close()


def test_readers_in_several_processes_after_fork(tmp_path, leak_check):
    path = save(tmp_path, vlen_rows(40))
    parent = HDF5Data(path, shuffle=False)
    parent.reset_state()  # an open h5py handle in the parent, inherited by the children
    assert parent[7][1] == "text007"
    results = results_of_forked_children(_read_all, (str(path),))
    assert results == [[f"text{i:03d}" for i in range(40)]] * 3
    assert_same_datapoints(vlen_rows(40), list(parent))  # the parent's handle still works
    parent.close()
