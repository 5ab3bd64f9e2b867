"""A file replaced under its readers (``save(overwrite=True)`` renames a new file over the path): each
reader reads the old or the new version, whole; never a prefix, a mix, a stale old version on a new load,
or a false damage error. For LMDB, HDF5 and npz, with real writer and reader processes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from bridgeflow import DataFromList
from bridgeflow.serialize import (
    DatasetChangedError,
    HDF5Serializer,
    LMDBSerializer,
    NumpySerializer,
    load_dataset,
)
from conftest import PROMPTLY_S

SAVERS = {"lmdb": LMDBSerializer.save, "hdf5": HDF5Serializer.save, "npz": NumpySerializer.save}
SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5", "npz": ".npz"}


def version(v: int) -> list:
    """Version ``v`` of the dataset: 300 or 500 datapoints, each naming its version and index."""
    return [[np.full(8, v * 1_000_000 + i, np.int64), i, v] for i in range(300 if v % 2 else 500)]


def save(fmt: str, path, v: int) -> None:
    SAVERS[fmt](DataFromList(version(v), shuffle=False), path, overwrite=True, progress=False)


def version_of(dps: list) -> int:
    """The version ``dps`` is, whole, or AssertionError."""
    assert dps, "no datapoints"
    v = int(dps[0][2])
    assert len(dps) == len(version(v)), f"{len(dps)} datapoints of version {v}, which has {len(version(v))}"
    for i, (arr, index, w) in enumerate(dps):
        assert (index, w) == (i, v) and (arr == v * 1_000_000 + i).all(), f"datapoint {i} is not of version {v}"
    return v


WRITER = """
import os, sys, time
sys.path.insert(0, {tests!r})
from test_serialize_replace import save
fmt, path, stop = sys.argv[1], sys.argv[2], sys.argv[3]
end, v = time.monotonic() + 120, 2  # the test says when to stop; 120 s if it never does
while not os.path.exists(stop) and time.monotonic() < end:
    save(fmt, path, v)
    v += 1
print(v - 2)
"""

READER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_serialize_replace import version_of
from bridgeflow.serialize import load_dataset
path, seconds, most = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
long_lived = load_dataset(path, shuffle=False)  # kept open across every replacement
kept = version_of(list(long_lived))
start, passes, seen, problems = time.monotonic(), 0, [], []
# reads for `seconds`, and on until it read 5 times and 3 versions (a busy machine writes and reads slower)
while time.monotonic() - start < seconds or (passes < 5 or len(set(seen)) < 3) and time.monotonic() - start < most:
    try:
        ds = load_dataset(path, shuffle=passes % 3 == 2, seed=passes)
        n = len(ds)
        if passes % 3 == 0:
            dps = list(ds)
        elif passes % 3 == 1:
            dps = [ds[i] for i in range(n)]
        else:
            dps = sorted(ds, key=lambda dp: dp[1])
        seen.append(version_of(dps))
        if passes % 2:
            ds.close()  # every other reader is dropped without close()
        del ds
        if passes % 5 == 0:
            assert version_of(list(long_lived)) == kept, "the long-lived reader changed version"
    except Exception as exc:
        problems.append(f"{{type(exc).__name__}}: {{exc}}")
    passes += 1
print(passes, len(set(seen)), int(seen == sorted(seen)), len(problems))
for p in problems[:5]:
    print(p)
"""


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "npz"])
def test_two_readers_while_a_writer_replaces_the_file(tmp_path, fmt):
    path = str(tmp_path / f"d{SUFFIX[fmt]}")
    save(fmt, path, 1)
    tests = os.path.dirname(os.path.abspath(__file__))
    stop = tmp_path.parent / f"{tmp_path.name}-stop"  # outside tmp_path, whose listing is checked below
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=tests), fmt, path, str(stop)],
                              stdout=subprocess.PIPE, text=True)
    readers = [subprocess.Popen([sys.executable, "-c", READER.format(tests=tests), path, "3", str(PROMPTLY_S)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = [r.communicate(timeout=120) for r in readers]
    finally:
        stop.touch()  # the writer replaces the file for as long as anyone reads it
        written = int(writer.communicate(timeout=120)[0])
    assert written >= 2, "the writer replaced the file too rarely to test anything"
    for (out, err), r in zip(outs, readers):
        assert r.returncode == 0, err[-3000:]
        passes, versions, ordered, problems = map(int, out.split("\n")[0].split())
        assert problems == 0, out  # no prefix, no mix of versions, no false damage error
        assert passes >= 5 and versions >= 3, out  # it read while the file was being replaced, twice at least
        assert ordered == 1, out  # a new load never reads an older file than an earlier load did
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temporary file left


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "npz"])
@pytest.mark.parametrize("pattern", ["full loop", "early break", "index", "exception", "nothing"])
def test_a_reader_dropped_without_close_holds_nothing_back(tmp_path, fmt, pattern):
    """A reader dropped without close() (after a loop, a break, ds[i], an exception) leaves no handle that
    a later load of the path would reuse: that load reads the file now at the path."""
    path = str(tmp_path / f"d{SUFFIX[fmt]}")
    save(fmt, path, 1)
    gc.collect()
    before = _open_fds()

    def use_and_drop() -> None:
        ds = load_dataset(path, shuffle=False)
        ds.reset_state()
        if pattern == "full loop":
            assert version_of(list(ds)) == 1
        elif pattern == "early break":
            for _dp in ds:
                break
        elif pattern == "index":
            assert ds[7][1] == 7
        elif pattern == "exception":
            try:
                for _dp in ds:
                    raise KeyError("boom")
            except KeyError:
                pass

    use_and_drop()
    gc.collect()
    assert _open_fds() == before  # the finalizer closed what the dropped reader held
    save(fmt, path, 2)
    with load_dataset(path, shuffle=False) as ds:
        assert version_of(list(ds)) == 2


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_one_reader_reads_one_file_for_its_lifetime(tmp_path, fmt):
    path = str(tmp_path / f"d{SUFFIX[fmt]}")
    save(fmt, path, 1)
    ds = load_dataset(path, shuffle=False)  # opened before the replacement, read after it
    save(fmt, path, 2)
    ds.reset_state()
    assert version_of(list(ds)) == 1 and len(ds) == 300
    assert version_of([ds[i] for i in range(len(ds))]) == 1
    # a copy sent to another process, or the reader used after close(), cannot read that file any more:
    # it says so instead of reading the new one under the old length
    import pickle

    copy = pickle.loads(pickle.dumps(ds))
    with pytest.raises(DatasetChangedError, match="replaced after this reader opened it"):
        copy.reset_state()
        list(copy)
    ds.close()
    with pytest.raises(DatasetChangedError, match="replaced"):
        ds[0]
    with load_dataset(path, shuffle=False) as fresh:
        assert version_of(list(fresh)) == 2


def _read_in_child(ds, q):
    q.put(version_of(list(ds)))


def test_forked_children_read_the_parents_file_not_the_new_one(tmp_path, leak_check):
    from conftest import results_of_forked_children

    path = str(tmp_path / "d.lmdb")
    save("lmdb", path, 1)
    ds = load_dataset(path, shuffle=False)
    save("lmdb", path, 2)  # replaced before the children start: they inherit the open file
    assert results_of_forked_children(_read_in_child, (ds,), n=2) == [1, 1]
    ds.close()
