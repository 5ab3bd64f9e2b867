"""LMDBSerializer and LMDBDataset on real LMDB files: round trips, random access, atomic saves, bad files."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import lmdb
import numpy as np
import pytest

from bridgeflow import DataFromGenerator, DataFromList, FakeData
from bridgeflow.serialize import (
    CorruptDataError,
    DatasetNotFoundError,
    PickleNotAllowedError,
    TargetExistsError,
    UnsupportedFormatError,
)
from bridgeflow.serialize import _lmdb_format as lmdb_format
from bridgeflow.serialize._lmdb_format import LMDBDataset, LMDBSerializer, read_lmdb_meta
from bridgeflow.testing import assert_same_datapoints, check_dataflow
from conftest import results_of_forked_children


def mixed(n=40):
    return [[np.full((i % 3, 4), i, np.float32), i, f"name{i}", {"box": np.arange(i, dtype=np.int16)}]
            for i in range(n)]


def save(tmp_path, dps, name="d.lmdb", **kw):
    path = tmp_path / name
    kw.setdefault("progress", False)
    LMDBSerializer.save(DataFromList(dps, shuffle=False), path, **kw)
    return path


def test_roundtrip_sequential_passes_contract(tmp_path):
    dps = mixed()
    path = save(tmp_path, dps, write_frequency=7)
    ds = LMDBSerializer.load(path, shuffle=False)
    out = check_dataflow(ds, deterministic=True)
    assert_same_datapoints(dps, out)
    assert sorted(os.listdir(tmp_path)) == ["d.lmdb"]  # no temp or -lock file left


def test_shuffled_is_a_permutation_reproducible_by_seed(tmp_path):
    dps = [[i] for i in range(200)]
    path = save(tmp_path, dps)
    ds = LMDBSerializer.load(path, shuffle=True, seed=5)
    check_dataflow(ds)
    orders = []
    for _ in range(2):
        d = LMDBDataset(path, shuffle=True, seed=5)
        d.reset_state()
        orders.append([[dp[0] for dp in d], [dp[0] for dp in d]])
        d.close()
    assert orders[0] == orders[1]  # same seed, same orders
    e1, e2 = orders[0]
    assert sorted(e1) == list(range(200)) and e1 != e2 and e1 != sorted(e1)


def test_random_access_and_len(tmp_path):
    dps = mixed(25)
    path = save(tmp_path, dps)
    with LMDBDataset(path, shuffle=False) as ds:
        assert len(ds) == 25
        assert_same_datapoints([dps[3], dps[-1], dps[0]], [ds[3], ds[-1], ds[np.int64(0)]])
        with pytest.raises(IndexError, match="25"):
            ds[25]
        with pytest.raises(TypeError):
            ds["a"]
        arr = ds[5][0]
        assert arr.flags.writeable  # copied out of the map once: writable, owned by the datapoint
    np.testing.assert_array_equal(arr, dps[5][0])  # still valid after close


def test_dict_datapoints_and_empty_flow(tmp_path):
    dps = [{"img": np.zeros((2, 2), np.uint8) + i, "label": i} for i in range(5)]
    ds = LMDBSerializer.load(save(tmp_path, dps), shuffle=False)
    assert_same_datapoints(dps, check_dataflow(ds, deterministic=True))
    empty = LMDBSerializer.load(save(tmp_path, [], name="e.lmdb"), shuffle=False)
    assert len(empty) == 0 and check_dataflow(empty) == []


def test_metadata_and_key_order(tmp_path):
    path = save(tmp_path, [[i] for i in range(300)])
    assert read_lmdb_meta(path) == {"format": "bridgeflow-lmdb", "codec": "bridgeflow", "version": 1,
                                    "count": 300, "checksum": "crc32", "classes": None}
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        keys = [k for k, _ in txn.cursor()]
    env.close()
    assert keys[:300] == [struct.pack(">Q", i) for i in range(300)]
    assert all(k.startswith(b"__bf__/") for k in keys[300:])


def test_map_grows_as_needed(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_format, "_INITIAL_MAP", 64 << 10)
    df = FakeData([[64, 1024]], size=40, dtype="uint8", seed=0)  # 40 x 64 KiB into a 64 KiB map
    path = tmp_path / "big.lmdb"
    assert LMDBSerializer.save(df, path, write_frequency=8, progress=False) == 40
    ds = LMDBSerializer.load(path, shuffle=False)
    ds.reset_state()
    assert_same_datapoints(list(FakeData([[64, 1024]], size=40, dtype="uint8", seed=0)), list(ds))
    ds.close()


def test_lmdb_directory_layout_is_read(tmp_path):
    path = save(tmp_path, [[1], [2]])
    folder = tmp_path / "dir_env"
    folder.mkdir()
    os.replace(path, folder / "data.mdb")
    ds = LMDBDataset(folder, shuffle=False)
    assert check_dataflow(ds, deterministic=True) == [[1], [2]]


class Boom(RuntimeError):
    pass


def failing_source(n, exc):
    def gen():
        for i in range(n):
            yield [np.zeros(1000, np.uint8), i]
        raise exc
    return DataFromGenerator(gen)


@pytest.mark.parametrize("exc", [Boom("source failed"), KeyboardInterrupt()])
def test_interrupted_save_leaves_directory_as_it_was(tmp_path, exc):
    (tmp_path / "other.txt").write_text("keep me")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(type(exc)):
        LMDBSerializer.save(failing_source(30, exc), tmp_path / "x.lmdb", write_frequency=10, progress=False)
    assert sorted(os.listdir(tmp_path)) == before


def test_existing_target_refused_unless_overwrite(tmp_path):
    path = save(tmp_path, [[1]])
    with pytest.raises(TargetExistsError, match=str(path)):
        save(tmp_path, [[2]])
    with pytest.raises(FileExistsError):
        save(tmp_path, [[2]])
    save(tmp_path, [[2], [3]], overwrite=True)
    with LMDBDataset(path, shuffle=False) as ds:
        assert list(ds) == [[2], [3]]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="write_frequency"):
        LMDBSerializer.save(DataFromList([[1]]), tmp_path / "a.lmdb", write_frequency=0)
    with pytest.raises(ValueError, match="codec"):
        LMDBSerializer.save(DataFromList([[1]]), tmp_path / "a.lmdb", codec="json")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        LMDBSerializer.save(DataFromList([[1]]), tmp_path / "nowhere" / "a.lmdb")
    assert os.listdir(tmp_path) == []


def test_pickle_codec_needs_allow_pickle(tmp_path):
    path = save(tmp_path, [[{1, 2}], [{3}]], codec="pickle")
    with pytest.raises(PickleNotAllowedError, match=str(path)):
        LMDBSerializer.load(path)
    ds = LMDBSerializer.load(path, shuffle=False, allow_pickle=True)
    assert check_dataflow(ds, deterministic=True) == [[{1, 2}], [{3}]]


def test_missing_garbage_truncated_and_wrong_format_files(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="nope.lmdb"):
        LMDBSerializer.load(tmp_path / "nope.lmdb")
    garbage = tmp_path / "garbage.lmdb"
    garbage.write_bytes(os.urandom(50_000))
    with pytest.raises(CorruptDataError, match="garbage.lmdb"):
        LMDBSerializer.load(garbage)
    npz = tmp_path / "arrays.npz"
    np.savez(npz, a=np.arange(3))
    with pytest.raises(CorruptDataError, match="arrays.npz"):
        LMDBSerializer.load(npz)
    good = save(tmp_path, mixed(30))
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 4096, 100):
        bad = tmp_path / f"cut{cut}.lmdb"
        bad.write_bytes(data[:cut])
        with pytest.raises(CorruptDataError, match=f"cut{cut}.lmdb"):
            ds = LMDBSerializer.load(bad, shuffle=False)
            ds.reset_state()
            list(ds)


def test_foreign_lmdb_and_unknown_version(tmp_path):
    foreign = tmp_path / "foreign.lmdb"
    env = lmdb.open(str(foreign), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"b")
    env.close()
    with pytest.raises(CorruptDataError, match="not one written by LMDBSerializer"):
        LMDBSerializer.load(foreign)
    path = save(tmp_path, [[1]])
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"__bf__/version", b"99")
    env.close()
    with pytest.raises(UnsupportedFormatError, match="version 99"):
        LMDBSerializer.load(path)


FLIP_SCRIPT = """
import os, random, struct, sys
from bridgeflow._errors import BridgeflowError
from bridgeflow.serialize._lmdb_format import LMDBSerializer
from bridgeflow.testing import assert_same_datapoints
path, folder, where, checksum = sys.argv[1:5]
data = open(path, "rb").read()
ref = LMDBSerializer.load(path, shuffle=False)
ref = [ref[i] for i in range(len(ref))]
silent = 0
spans, at = [], data.find(b"\\x93BFC")
while at >= 0:  # the stored values (and stale copies of them in freed pages)
    n = struct.unpack_from("<Q", data, at + 24)[0] if at + 32 <= len(data) else 0
    if n:  # not a length of 0: the 4 bytes that happened to look like a value's start elsewhere
        spans.append((at, n))
    at = data.find(b"\\x93BFC", at + 1)
rng = random.Random(0)
errors = 0
for t in range(250):
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        if where == "values":
            start, n = rng.choice(spans)
            b[start + rng.randrange(min(n, 80))] = rng.randrange(256)
        else:
            b[rng.randrange(len(b))] = rng.randrange(256)
    if t % 5 == 0:
        b = b[:rng.randrange(len(b))]
    p = os.path.join(folder, "c%d.lmdb" % t)
    open(p, "wb").write(b)
    try:
        ds = LMDBSerializer.load(p, shuffle=False)
        ds.reset_state()
        got = [list(ds), [ds[i] for i in range(len(ds))]]
        ds.close()
        try:
            for g in got:
                assert_same_datapoints(ref, g)
        except AssertionError:
            silent += 1  # read back without an error, but not what was saved
    except BridgeflowError as exc:
        assert isinstance(exc, ValueError), repr(exc)
        assert os.path.basename(p) in str(exc), str(exc)
        errors += 1
    os.unlink(p)
print("errors", errors, "silent", silent)
"""


@pytest.mark.parametrize(("where", "checksum"), [("values", False), ("anywhere", False), ("anywhere", True),
                                               ("values", True)])
def test_flipped_and_cut_files_raise_library_errors_never_crash(tmp_path, where, checksum):
    """Byte flips (in stored values, or anywhere: page headers, node offsets, meta pages) and cuts: each
    read succeeds or raises a bridgeflow error naming the file. In a child process, so a SIGBUS fails the
    test. Without checksum=True a flip inside array bytes or a string reads back changed; with it, a read
    that succeeds returns exactly what was saved."""
    path = save(tmp_path, mixed(40), checksum=checksum)
    proc = subprocess.run([sys.executable, "-c", FLIP_SCRIPT, str(path), str(tmp_path), where, str(checksum)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors, silent = int(proc.stdout.split()[-3]), int(proc.stdout.split()[-1])
    assert errors > 50  # the damage is noticed, not silently read
    if checksum:
        assert silent == 0


def test_a_deep_tree_is_walked_and_verify_is_deprecated(tmp_path):
    path = save(tmp_path, [[i, "x" * (i % 200)] for i in range(20000)], write_frequency=999)
    with pytest.warns(DeprecationWarning, match="verify= is deprecated and does nothing"):
        ds = LMDBDataset(path, shuffle=False, verify=False)
    assert len(ds) == 20000 and ds[12345] == [12345, "x" * 145]  # a 3-level tree passes the page check
    ds.reset_state()
    assert [dp[0] for dp in ds] == list(range(20000))
    ds.close()


def _read_all(path, q):
    ds = LMDBDataset(path, shuffle=True, seed=os.getpid())
    ds.reset_state()
    q.put(sorted(dp[0] for dp in ds))
    ds.close()


def test_readers_in_several_processes_after_fork(tmp_path, leak_check):
    path = save(tmp_path, [[i] for i in range(100)])
    parent = LMDBDataset(path, shuffle=False)
    parent.reset_state()  # an open handle in the parent, inherited by the children
    assert parent[7] == [7]
    results = results_of_forked_children(_read_all, (str(path),))
    assert results == [list(range(100))] * 3
    assert [dp[0] for dp in parent] == list(range(100))  # the parent's handle still works
    parent.close()


def test_flow_survives_pickling_before_reset(tmp_path):
    import pickle

    path = save(tmp_path, [[1], [2]])
    ds = LMDBDataset(path, shuffle=False)
    ds.reset_state()
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._pin.fd is None  # nothing of the original's: it opens the path again
    ds.close()
    assert check_dataflow(copy, deterministic=True) == [[1], [2]]


def test_two_flows_on_one_file_in_one_process(tmp_path):
    path = save(tmp_path, [[i] for i in range(10)])
    a, b = LMDBDataset(path, shuffle=False), LMDBDataset(path, shuffle=True, seed=1)
    a.reset_state()
    b.reset_state()
    assert sorted(dp[0] for dp in b) == [dp[0] for dp in a]
    assert a._index is b._index  # the tree is walked once per file and process
    a.close()
    assert b[3] == [3]  # b's own descriptor stays open until b closes
    b.close()


def _rewrite(path, puts=(), deletes=()):
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        for k in deletes:
            assert txn.delete(k)
        for k, v in puts:
            txn.put(k, v)
    env.close()


@pytest.mark.parametrize("count", [b"10", b"31"])
def test_a_damaged_count_is_an_error_not_a_partial_read(tmp_path, count):
    path = save(tmp_path, [[i] for i in range(30)])
    _rewrite(path, puts=[(b"__bf__/count", count)])  # one digit flipped: 30 -> 10 would read a third
    with pytest.raises(CorruptDataError, match=r"d\.lmdb: its metadata counts .* but the file holds 30"):
        LMDBSerializer.load(path)


def test_a_damaged_key_is_noticed_when_the_file_is_opened(tmp_path):
    path = save(tmp_path, [[i] for i in range(30)])
    env = lmdb.open(str(path), subdir=False, lock=False, readonly=True)
    with env.begin() as txn:
        value = txn.get(struct.pack(">Q", 5))
    env.close()
    # key 5 moved past the others: same count, same number of entries, but a reordered sequence
    _rewrite(path, deletes=[struct.pack(">Q", 5)], puts=[(struct.pack(">Q", 1 << 40), value)])
    for shuffle in (False, True):  # every key is checked when the file is opened, before anything is read
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 5: key .*\\x06' where key .*\\x05' belongs"):
            LMDBDataset(path, shuffle=shuffle)


def test_a_value_claiming_another_version_or_codec_is_damage_and_never_unpickled(tmp_path):
    from bridgeflow._codec import encode

    path = save(tmp_path, [[i] for i in range(5)], checksum=False)
    future = bytearray(encode([1]))
    future[4] += 1  # format version
    _rewrite(path, puts=[(struct.pack(">Q", 1), bytes(future)),
                         (struct.pack(">Q", 2), encode({"evil": {1, 2}}, codec="pickle"))])
    with LMDBDataset(path, shuffle=False, allow_pickle=True) as ds:  # a bridgeflow-codec file
        ds.reset_state()
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 1: .*version"):
            ds[1]
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 2 is a pickle, but the file's metadata "
                           r"says codec=bridgeflow.*not unpickled \(even with allow_pickle=True\)") as info:
            ds[2]  # the file says codec=bridgeflow: a pickle inside it is not run, even with allow_pickle
        assert "pass allow_pickle" not in str(info.value)
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 1"):
            list(ds)


def test_checksum_roundtrip_and_a_changed_array_byte(tmp_path):
    dps = [[np.arange(100, dtype=np.int32) + i, f"label{i}"] for i in range(10)]
    path = save(tmp_path, dps, checksum=True)
    assert read_lmdb_meta(path)["checksum"] == "crc32"
    for shuffle in (False, True):
        assert_same_datapoints(dps, check_dataflow(LMDBDataset(path, shuffle=shuffle, seed=0)), ordered=not shuffle)
    data = bytearray(path.read_bytes())
    at = data.find((np.arange(100, dtype=np.int32) + 6).tobytes())
    data[at + 40] ^= 1  # one bit of one array element: a valid value with another number in it
    path.write_bytes(bytes(data))
    with LMDBDataset(path, shuffle=False) as ds:
        ds.reset_state()
        assert_same_datapoints(dps[:6], [ds[i] for i in range(6)])
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 6: checksum mismatch"):
            ds[6]
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 6: checksum mismatch"):
            list(ds)


def test_unknown_checksum_kind_is_clear(tmp_path):
    path = save(tmp_path, [[1]], checksum=True)
    _rewrite(path, puts=[(b"__bf__/checksum", b"sha3")])
    with pytest.raises(UnsupportedFormatError, match="sha3"):
        LMDBSerializer.load(path)


def _overflow_nodes(data: bytes, psize: int = 4096) -> list[int]:
    """Byte offsets of the headers of leaf nodes whose value lives in overflow pages, in every leaf page
    (the live ones and the stale copies LMDB leaves behind)."""
    nodes = []
    for pgno in range(2, len(data) // psize):
        page = pgno * psize
        flags, lower = struct.unpack_from("<HH", data, page + 10)
        if flags & 0x02:  # a leaf page
            for k in range((lower - 16) // 2):
                node = page + struct.unpack_from("<H", data, page + 16 + 2 * k)[0]
                if struct.unpack_from("<H", data, node + 4)[0] & 0x01:  # F_BIGDATA
                    nodes.append(node)
    assert nodes, "no overflow value in the file"
    return nodes


CRAFTED_SCRIPT = """
import sys
from bridgeflow.serialize._lmdb_format import LMDBSerializer
try:
    ds = LMDBSerializer.load(sys.argv[1], shuffle=False)
    print("loaded", len(list(ds)))
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_claim_inside_the_file_cannot_switch_the_page_check_off(tmp_path):
    """Meta pages claiming 2^40 leaf pages (the old default skipped the check above 65,536) plus an
    overflow value claiming 1 GiB: an error naming the file, not a SIGBUS."""
    path = save(tmp_path, [[np.zeros(3000, np.uint8) + i] for i in range(20)])
    data = bytearray(path.read_bytes())
    for meta in (0, 4096):
        struct.pack_into("<Q", data, meta + 104, 1 << 40)  # the main DB's leaf-page count
    for node in _overflow_nodes(bytes(data)):
        struct.pack_into("<HH", data, node, 0, 1 << 14)  # a value's size: 1 GiB, far past the file
    path.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-c", CRAFTED_SCRIPT, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"the reader died (code {proc.returncode}): {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("CorruptDataError") and "d.lmdb" in proc.stdout, proc.stdout
    assert "overflow pages lie outside the file" in proc.stdout, proc.stdout


CUT_SCRIPT = """
import multiprocessing as mp, os, sys, threading, time
import lmdb, numpy as np
from bridgeflow.serialize import LMDBData, LMDBSerializer
from bridgeflow.serialize import CorruptDataError

mode, folder = sys.argv[1:3]
KINDS = {"large": (300, lambda i: [np.full(20000 + i, i % 251, np.uint8), i]),  # overflow pages
         "small": (3000, lambda i: [i, "x" * (i % 50)])}  # inside the leaf pages, read in blocks


def outcome(read):
    try:
        read()
        return "no error"
    except CorruptDataError as exc:
        return "CorruptDataError " + str(exc)
    except Exception as exc:
        return f"{type(exc).__name__} {exc}"


def forever(ds, started):
    for _ in range(100000):
        for _dp in ds if mode == "forked" else (ds[i] for i in range(len(ds))):  # threads share ds: ds[i]
            started.set()


def in_child(ds, q, started):  # a reader inherited through fork (or a thread) reading while the file is cut
    q.put(outcome(lambda: forever(ds, started)))


def save(path, n, make):
    if mode != "raw":
        LMDBSerializer.save([make(i) for i in range(n)], path, progress=False)
        return
    env = lmdb.open(path, subdir=False, lock=False, map_size=1 << 28)  # any LMDB file, for LMDBData
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(b"%08d" % i, repr(make(i)).encode())
    env.close()


for kind, (n, make) in KINDS.items():
    for frac in (0.5, 0.05, 0.0):
        path = os.path.join(folder, f"{kind}-{mode}-{int(frac * 100)}.lmdb")
        save(path, n, make)
        cut = int(os.path.getsize(path) * frac)
        ds = (LMDBData if mode == "raw" else LMDBSerializer.load)(path, shuffle=mode == "shuffled")
        ds.reset_state()
        if mode in ("sequential", "shuffled", "raw"):
            it = iter(ds)
            for _ in range(10):
                next(it)
            os.truncate(path, cut)  # the same file, cut in place: a mapped read would now die of SIGBUS
            outs = [outcome(lambda: [None for _ in it])]  # the epoch goes on
        elif mode == "index":
            ds[n - 1]
            os.truncate(path, cut)
            outs = [outcome(lambda: [ds[i] for i in range(len(ds))])]
        else:  # readers in forked children, or threads, reading while the file is cut
            if mode == "forked":
                ctx = mp.get_context("fork")
                q, started = ctx.Queue(), [ctx.Event() for _ in range(2)]
                workers = [ctx.Process(target=in_child, args=(ds, q, e)) for e in started]
            else:
                import queue
                q, started = queue.Queue(), [threading.Event() for _ in range(2)]
                workers = [threading.Thread(target=in_child, args=(ds, q, e)) for e in started]
            for w in workers:
                w.start()
            for e in started:
                e.wait(60)
            time.sleep(0.02)
            os.truncate(path, cut)
            outs = [q.get(timeout=60) for _ in workers]
            for w in workers:
                w.join(60)
            if mode == "forked":
                outs += [f"exit code {w.exitcode}" for w in workers if w.exitcode != 0]
        ds.close()
        for out in outs:
            print(os.path.basename(path), cut, "|", out.replace(chr(10), " "))
"""


@pytest.mark.parametrize("mode", ["sequential", "shuffled", "index", "forked", "threads", "raw"])
def test_a_file_cut_in_place_while_read_is_an_error_never_a_crash(tmp_path, mode):
    """The file cut in place (to 50%, 5% and 0% of its size) while readers read it: in the same epoch, by
    index, in forked readers and threads reading at that very moment, large values and small ones, and
    LMDBData's raw pairs. Every reader gets a CorruptDataError naming the file; none dies of SIGBUS (in a
    child process, so a crash fails the test instead of killing it)."""
    proc = subprocess.run([sys.executable, "-c", CUT_SCRIPT, mode, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"the reader died (code {proc.returncode}): {proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 6 * (2 if mode in ("forked", "threads") else 1), proc.stdout
    for line in lines:
        name, cut, out = line.split(" ", 2)
        assert out.startswith(f"| CorruptDataError {tmp_path / name}: the file was cut to {cut} bytes while open"), \
            line


def test_checksums_are_on_by_default_and_old_files_without_them_load(tmp_path):
    dps = [[np.arange(50, dtype=np.int32) + i, f"s{i}"] for i in range(8)]
    default = save(tmp_path, dps, name="default.lmdb")
    assert read_lmdb_meta(default)["checksum"] == "crc32"
    old = save(tmp_path, dps, name="old.lmdb", checksum=False)  # as files were written before
    assert read_lmdb_meta(old)["checksum"] is None
    for path in (default, old):
        assert_same_datapoints(dps, check_dataflow(LMDBDataset(path, shuffle=False), deterministic=True))
    # the one byte that differs between two values, changed: an error with the checksum, silent without
    for path, caught in ((default, True), (old, False)):
        data = bytearray(path.read_bytes())
        needle = (np.arange(50, dtype=np.int32) + 3).tobytes()
        at = data.find(needle)
        assert at > 0
        while at >= 0:  # every copy: the live value and stale copies in freed pages
            data[at + 40] ^= 0x10
            at = data.find(needle, at + 1)
        path.write_bytes(bytes(data))
        with LMDBDataset(path, shuffle=False) as ds:
            ds.reset_state()
            if caught:
                with pytest.raises(CorruptDataError, match=r"default\.lmdb: datapoint 3: checksum mismatch"):
                    list(ds)
            else:
                assert not np.array_equal(list(ds)[3][0], dps[3][0])
