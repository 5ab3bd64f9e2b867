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
from bridgeflow.serialize import (
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


# --- compression: decoders bounded by what the file declares ------------------------------------------

sys_path_fuzz = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz")


def _crafted():
    import sys

    if sys_path_fuzz not in sys.path:
        sys.path.insert(0, sys_path_fuzz)
    import crafted

    return crafted


@pytest.mark.parametrize("method", ["deflate", "bzip2", "lzma"])
def test_a_member_that_inflates_past_its_declared_size_is_refused_naming_it(tmp_path, method):
    """A member whose stream goes on past the size it declares (its CRC is that of the declared bytes): zipfile
    inflated a bzip2 or LZMA chunk whole and cut it to size afterwards, so a 3.7 KB file cost 4.3 GB and
    loaded without error. The reader stops one byte past the declared size."""
    path = tmp_path / f"{method}.npz"
    _crafted().npz_bomb(str(path), method, extra=64 << 20)
    with pytest.raises(CorruptDataError, match=rf"{method}\.npz: .*member 'c0\.npy': its compressed data runs past "
                                               r"the \d+ bytes it declares"):
        NumpyData(path)


@pytest.mark.parametrize("method", ["stored", "deflate", "bzip2", "lzma"])
def test_members_of_every_method_read_back_and_lies_about_sizes_are_refused(tmp_path, method):
    crafted = _crafted()
    good = save(tmp_path, every_kind(12))
    members = crafted._members(str(good))
    honest = tmp_path / "honest.npz"
    import zlib

    crafted.write_zip(str(honest), [(n, method, len(d), zlib.crc32(d), crafted._compress(method, [d]))
                                    for n, d in members])
    assert_same_datapoints(list(NumpyData(good, shuffle=False)), list(NumpyData(honest, shuffle=False)))
    short = tmp_path / "short.npz"  # a stream that ends before the declared size
    n, d = members[0]
    crafted.write_zip(str(short), [(n, method, len(d), zlib.crc32(d), crafted._compress(method, [d[:-5]]))]
                      + [(m, "stored", len(e), zlib.crc32(e), e) for m, e in members[1:]])
    with pytest.raises(CorruptDataError, match=r"short\.npz: .*(ends after \d+ of|more than its \d+ stored bytes)"):
        NumpyData(short)
    huge = tmp_path / "huge.npz"  # 4 GB declared: more than the bytes can give (bzip2 could: the npy header cannot)
    crafted.write_zip(str(huge), [(n, method, 0xFFFF_FFF0, zlib.crc32(d), crafted._compress(method, [d]))]
                      + [(m, "stored", len(e), zlib.crc32(e), e) for m, e in members[1:]])
    with pytest.raises(CorruptDataError, match=r"huge\.npz: .*(declares 4294967280 bytes, more than its \d+ |"
                                               r"but it holds 4294967\d+ bytes)"):
        NumpyData(huge)


def test_a_name_two_members_share_is_refused_as_ambiguous(tmp_path):
    path = tmp_path / "dup.npz"
    _crafted().npz_duplicate(str(path))
    with pytest.raises(CorruptDataError, match=r"dup\.npz: .*member 'c0\.npy' appears twice: which one to read is "
                                               "ambiguous"):
        NumpyData(path)


MEMORY_SCRIPT = """
import sys
from bridgeflow.serialize._npz_format import NumpyData

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10

open("/proc/self/clear_refs", "w").write("5")
before = hwm()
ds = NumpyData(sys.argv[1], shuffle=False)
print(hwm() - before, ds[0][0].nbytes)
"""


def test_a_deflate_member_costs_its_array_once(tmp_path):
    """A deflate npz of a 64 MiB array: zipfile's reader handed the member over as one bytes object before it
    was copied into the array (twice the array: 1,074 MB for a 522 KB file of 512 MiB); pieces of 1 MiB go
    straight into the array now."""
    import subprocess
    import sys
    import zlib

    crafted = _crafted()
    src = save(tmp_path, [[np.zeros(64 << 20, np.uint8)]], name="big.npz")
    members = crafted._members(str(src))
    path = tmp_path / "deflate.npz"
    crafted.write_zip(str(path), [(n, "deflate", len(d), zlib.crc32(d), crafted._compress("deflate", [d]))
                                  for n, d in members])
    assert path.stat().st_size < 1 << 20
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    grew, nbytes = map(int, proc.stdout.split())
    assert nbytes == 64 << 20 and grew < nbytes + (16 << 20), (grew, proc.stderr[-2000:])
