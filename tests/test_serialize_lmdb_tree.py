"""The LMDB B-tree walker (serialize/_lmdb_tree.py) on files nobody vouches for and files being written.

- against py-lmdb's own cursor over generated contents (hypothesis): keys of every length, small values
  and overflow values, deletes and updates over several write transactions; named sub-databases and
  duplicate keys refused;
- crafted files whose nodes share bytes or whose meta page claims absurd counts: refused, naming the
  file, in memory proportional to the file;
- a writer beside a reader (real processes): every value read is the one the file held when the reader
  opened it, or a DatasetChangedError saying the file is being written; never another key's value.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridgeflow import DataFromList
from bridgeflow.serialize import CorruptDataError, DatasetChangedError, LMDBData, LMDBSerializer
from bridgeflow.serialize._lmdb_tree import walk_lmdb
from bridgeflow.serialize._pinned import PinnedFile

PSIZE = 4096


def walked(path):
    pin = PinnedFile(str(path))
    try:
        tree = walk_lmdb(pin, str(path))
        return [(tree.key(j), pin.pread(int(tree.sizes[j]), int(tree.offsets[j]))) for j in range(len(tree))]
    finally:
        pin.close()


def value_of(size, seed):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


keys = st.one_of(st.binary(min_size=1, max_size=12), st.binary(min_size=100, max_size=511))
sizes = st.one_of(st.integers(0, 300), st.integers(1500, 3000), st.integers(4000, 40000))  # in page, over page
ops = st.lists(st.tuples(st.sampled_from(["put", "put", "put", "delete"]), keys, sizes), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(transactions=st.lists(ops, min_size=1, max_size=6), seed=st.integers(0, 2 ** 32 - 1))
def test_the_walk_sees_what_lmdbs_cursor_sees(tmp_path, transactions, seed):
    path = tmp_path / f"d{seed}.lmdb"
    env = lmdb.open(str(path), subdir=False, lock=False, map_size=1 << 28)
    put = 0
    try:
        for t in transactions:
            with env.begin(write=True) as txn:
                for op, key, size in t:
                    if op == "put":
                        put += 1
                        txn.put(key, value_of(size, seed + put))
                    else:
                        txn.delete(key)
        with env.begin() as txn:
            want = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()
    assert walked(path) == want
    path.unlink()


@pytest.mark.parametrize("kind", ["subdb", "dupsort"])
def test_named_subdatabases_and_duplicates_are_refused(tmp_path, kind):
    path = tmp_path / "sub.lmdb"
    with lmdb.open(str(path), subdir=False, lock=False, max_dbs=2) as env:
        db = env.open_db(b"sub", dupsort=kind == "dupsort")  # py-lmdb keeps the main database's flags
        with env.begin(write=True) as txn:
            txn.put(b"a", b"1")
            txn.put(b"k", b"x", db=db)
            txn.put(b"k", b"y", db=db)
    with pytest.raises(CorruptDataError, match=r"sub.lmdb: page \d+ has named sub-databases or duplicate keys"):
        walked(path)
    with pytest.raises(CorruptDataError, match="sub.lmdb"):
        LMDBData(path)


# --- crafted files: memory in proportion to the file --------------------------------------------------

def crafted(path, *, nodes_per_page, fix_count=True, pages=300):
    """Leaf pages of 511-byte keys whose node pointers all aim at the page's first node."""
    tmp = str(path) + ".tmp"
    with lmdb.open(tmp, subdir=False, lock=False, map_size=1 << 30) as env, env.begin(write=True) as txn:
        for i in range(pages * 7):
            txn.put(b"%0511d" % i, b"v")
    data = bytearray(open(tmp, "rb").read())
    os.unlink(tmp)
    total = 0
    for at in range(2 * PSIZE, len(data), PSIZE):
        if not data[at + 10] & 0x02:
            continue
        first = struct.unpack_from("<H", data, at + 16)[0]
        k = min((first - 16) // 2, nodes_per_page)
        struct.pack_into("<HH", data, at + 12, 16 + 2 * k, first)
        data[at + 16:at + 16 + 2 * k] = data[at + 16:at + 18] * k
        total += k
    if fix_count:
        for meta in (0, PSIZE):
            struct.pack_into("<Q", data, meta + 120, total)  # the main database's entries
    path.write_bytes(bytes(data))
    return path


MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys
    from bridgeflow.serialize import LMDBData
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        LMDBData(sys.argv[1])
        print("read")
    except Exception as exc:
        print(type(exc).__name__, exc)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
""")


@pytest.mark.parametrize(("nodes", "message"), [
    (10_000, "damaged meta page (.* entries, more than its .* pages can hold)"),
    (400, "page .* has a damaged header"),  # more pointers than node headers fit in the free space
    (60, "page .* has nodes overlapping each other"),  # the headers fit, the keys they claim do not
])
def test_nodes_sharing_bytes_cost_memory_in_proportion_to_the_file(tmp_path, nodes, message):
    path = crafted(tmp_path / "bomb.lmdb", nodes_per_page=nodes)
    size = path.stat().st_size
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path)], capture_output=True, text=True,
                          timeout=300)
    first, grew_kib = proc.stdout.splitlines()
    assert first.startswith("CorruptDataError") and "bomb.lmdb" in first, proc.stdout + proc.stderr
    assert __import__("re").search(message, first), first
    assert int(grew_kib) * 1024 < 2 * size + (32 << 20), (grew_kib, size)  # the base walker took 1-5 GB


# --- a writer beside a reader ----------------------------------------------------------------------

def value(key: bytes) -> bytes:
    return (key * 40)[:300]


WRITER = textwrap.dedent("""
    import lmdb, sys
    env = lmdb.open(sys.argv[1], subdir=sys.argv[2] == "dir", map_size=1 << 30)
    for r in range(int(sys.argv[3])):
        with env.begin(write=True) as txn:
            for i in range(int(sys.argv[4])):  # new keys (files of a layout keep theirs: none)
                txn.put(b"new%03d%05d" % (r, i), b"n" * 200)
            cursor = txn.cursor()
            for i, (k, v) in enumerate(list(cursor)):  # every old value rewritten: its page is copied
                if i % 7 == r % 7 and not k.startswith((b"new", b"__")):
                    txn.put(k, bytes(v))
    print("done", flush=True)
""")


def live_file(path, n=2000, layout="raw"):
    if layout == "bridgeflow":
        LMDBSerializer.save(DataFromList([[i, value(b"%08d" % i)] for i in range(n)], shuffle=False), path,
                            progress=False)
        return
    with lmdb.open(str(path), subdir=False, map_size=1 << 30) as env, env.begin(write=True) as txn:
        for i in range(n):
            txn.put(b"%08d" % i, value(b"%08d" % i))
        if layout == "tensorpack":
            import msgpack

            for i in range(n):
                txn.put(b"%08d" % i, msgpack.dumps([i, value(b"%08d" % i)], use_bin_type=True))
            txn.put(b"__keys__", msgpack.dumps([b"%08d" % i for i in range(n)], use_bin_type=True))


def check(layout, dp, i=None):
    """Whether a datapoint read is the one the file held when it was opened."""
    if layout == "raw":
        key, v = dp
        return v == value(key)
    return dp[1] == value(b"%08d" % dp[0]) and (i is None or dp[0] == i)


def open_reader(path, layout, shuffle=False):
    if layout == "raw":
        return LMDBData(path, shuffle=shuffle, seed=0)
    return LMDBSerializer.load(path, shuffle=shuffle, seed=0)


@pytest.mark.parametrize("layout", ["raw", "bridgeflow", "tensorpack"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_commit_since_opening_is_an_error_never_another_keys_value(tmp_path, layout, shuffle):
    path = tmp_path / "live.lmdb"
    live_file(path, layout=layout)
    with open_reader(path, layout, shuffle) as ds:
        ds.reset_state()
        it = iter(ds)
        for _ in range(10):
            assert check(layout, next(it))
        appended = "100" if layout == "raw" else "0"
        subprocess.run([sys.executable, "-c", WRITER, str(path), "file", "20", appended], check=True, timeout=120)
        with pytest.raises(DatasetChangedError, match="live.lmdb is being written: another process committed "
                                                      "LMDB transaction"):
            for dp in it:
                assert check(layout, dp)  # what was read before the error is the file as opened
        with pytest.raises(DatasetChangedError, match="being written"):
            ds[5]
    with open_reader(path, layout) as again:  # opened again: the file as it is now
        again.reset_state()
        assert all(check(layout, dp) for dp in again if layout != "raw" or not dp[0].startswith(b"new"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["raw", "bridgeflow"])
def test_reading_while_a_writer_commits(tmp_path, layout):
    """A writer process committing while readers open and read: each value read is right, or the read
    raises DatasetChangedError; opening again reads on."""
    path = tmp_path / "live.lmdb"
    live_file(path, layout=layout)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "file", "300",
                               "100" if layout == "raw" else "0"], stdout=subprocess.PIPE, text=True)
    read = changed = opened = 0
    try:
        while writer.poll() is None or opened < 2:
            try:
                with open_reader(path, layout, shuffle=True) as ds:
                    opened += 1
                    ds.reset_state()
                    for dp in ds:
                        assert check(layout, dp) or (layout == "raw" and dp[0].startswith(b"new")), dp[0]
                        read += 1
            except DatasetChangedError as exc:
                assert "being written" in str(exc)
                changed += 1
    finally:
        writer.kill()
        writer.wait()
    assert read > 0 and opened >= 2
