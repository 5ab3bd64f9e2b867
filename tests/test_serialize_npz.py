"""NumpySerializer and NumpyData on real .npz files."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest

from bridgeflow import DataFromGenerator, DataFromList
from bridgeflow._errors import DatapointError
from bridgeflow.serialize._errors import (
    CorruptDataError,
    DatasetNotFoundError,
    TargetExistsError,
    UnsupportedFormatError,
)
from bridgeflow.serialize._npz_format import NumpyData, NumpySerializer
from bridgeflow.testing import assert_same_datapoints, check_dataflow


def every_kind(n=30):
    return [(np.full((3, 4), i, np.float32), i, f"n{i}é", b"\x00ab" * i, np.arange(i % 4, dtype=np.int16),
             1.5 * i, np.uint8(i), np.array(i), i % 2 == 0) for i in range(n)]


def save(tmp_path, dps, name="d.npz", **kw):
    path = tmp_path / name
    kw.setdefault("progress", False)
    assert NumpySerializer.save(DataFromList(dps, shuffle=False), path, **kw) == len(dps)
    return path


def test_roundtrip_every_kind_and_contract(tmp_path):
    dps = every_kind()
    path = save(tmp_path, dps)
    out = check_dataflow(NumpySerializer.load(path, shuffle=False), deterministic=True)
    assert_same_datapoints(dps, out)
    assert type(out[0]) is tuple and type(out[2][1]) is int and type(out[2][6]) is np.uint8
    shuffled = NumpyData(path, shuffle=True, seed=3)
    assert_same_datapoints(dps, check_dataflow(shuffled), ordered=False)
    with np.load(path, allow_pickle=False) as z:  # a plain npz, readable without bridgeflow and pickle
        assert z["c0"].shape == (30, 3, 4) and "c4.shapes" in z.files and "c3.offsets" in z.files
        assert json.loads(z["__bf_meta__"].tobytes())["count"] == 30


def test_dicts_random_access_and_empty(tmp_path):
    dps = [{"x": np.arange(3) + i, "y": str(i)} for i in range(5)]
    ds = NumpyData(save(tmp_path, dps), shuffle=False)
    assert len(ds) == 5 and ds[-1]["y"] == "4" and ds[2]["x"].tolist() == [2, 3, 4]
    with pytest.raises(IndexError):
        ds[5]
    assert check_dataflow(NumpyData(save(tmp_path, [], name="e.npz"))) == []


def test_refusals_and_atomicity(tmp_path):
    with pytest.raises(DatapointError, match="component '0'"):
        save(tmp_path, [[None]])
    path = save(tmp_path, [[1]])
    with pytest.raises(TargetExistsError, match="d.npz"):
        save(tmp_path, [[2]])

    def gen():
        yield [1]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        NumpySerializer.save(DataFromGenerator(gen), tmp_path / "x.npz", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["d.npz"]
    save(tmp_path, [[2]], overwrite=True)
    assert list(NumpyData(path, shuffle=False)) == [[2]]


def test_bad_files(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="none.npz"):
        NumpyData(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(os.urandom(300))
    with pytest.raises(CorruptDataError, match="junk.npz"):
        NumpyData(tmp_path / "junk.npz")
    np.savez(tmp_path / "plain.npz", a=np.arange(3))
    with pytest.raises(CorruptDataError, match="not written by NumpySerializer"):
        NumpyData(tmp_path / "plain.npz")
    np.savez(tmp_path / "obj.npz", a=np.array([{}], dtype=object))
    with pytest.raises(CorruptDataError, match="obj.npz"):  # object arrays are never unpickled
        NumpyData(tmp_path / "obj.npz")
    good = save(tmp_path, every_kind(10))
    data = good.read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDataError, match="cut.npz"):
        NumpyData(tmp_path / "cut.npz")
    with zipfile.ZipFile(good) as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(np.lib.format.read_array(io.BytesIO(members["__bf_meta__.npy"])).tobytes())
    for change, error in (({"version": 9}, UnsupportedFormatError), ({"count": 11}, CorruptDataError)):
        arrays = {n[:-4]: np.lib.format.read_array(io.BytesIO(b)) for n, b in members.items()}
        arrays["__bf_meta__"] = np.frombuffer(json.dumps({**meta, **change}).encode(), np.uint8)
        bad = tmp_path / "changed.npz"
        np.savez(bad, **arrays)
        with pytest.raises(error, match="changed.npz"):
            NumpyData(bad)


def _rewrite_member(src, dst, name, change):
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members[name] = change(members[name])
    with zipfile.ZipFile(dst, "w") as z:  # a valid zip (CRCs recomputed): only the npy header lies
        for n, b in members.items():
            z.writestr(n, b)


def test_a_huge_declared_shape_is_refused_before_allocating(tmp_path):
    good = save(tmp_path, [[np.zeros((3, 4), np.float32) + i] for i in range(200)])

    def lie(member: bytes) -> bytes:
        head = member[:128].replace(b"(200, 3, 4), }", b"(99999999999999, 3, 4), }")
        return head[:127].rstrip(b" \n").ljust(127) + b"\n" + member[128:]  # same header length

    _rewrite_member(good, tmp_path / "huge.npz", "c0.npy", lie)
    with pytest.raises(CorruptDataError, match=r"huge\.npz: .*declares shape \(99999999999999, 3, 4\)"):
        NumpyData(tmp_path / "huge.npz")  # np.load would ask for 4.4 PiB and raise MemoryError


def test_byte_order_is_kept(tmp_path):
    dps = [[(np.arange(3) + i).astype(">i4"), np.arange(i + 1, dtype=">f8")] for i in range(4)]
    out = check_dataflow(NumpyData(save(tmp_path, dps), shuffle=False), deterministic=True)
    assert_same_datapoints(dps, out)
    assert out[0][0].dtype.str == ">i4" and out[3][1].dtype.str == ">f8"


def test_flipped_and_cut_files_give_the_saved_data_or_a_library_error(tmp_path):
    """The zip CRC of every member is checked (the whole member is read), so no flip goes unnoticed."""
    import random

    from bridgeflow._errors import BridgeflowError

    dps = every_kind(20)
    good = save(tmp_path, dps)
    data = good.read_bytes()
    rng = random.Random(0)
    errors = 0
    for t in range(150):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if t % 4 == 0:
            b = b[:rng.randrange(len(b))]
        p = tmp_path / f"f{t}.npz"
        p.write_bytes(bytes(b))
        try:
            got = list(NumpyData(p, shuffle=False))
        except BridgeflowError as exc:
            assert isinstance(exc, ValueError) and f"f{t}.npz" in str(exc)
            errors += 1
        else:
            assert_same_datapoints(dps, got)
        p.unlink()
    assert errors > 140
