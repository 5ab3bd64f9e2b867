"""Reading tensorpack's LMDB files safely: layouts, pickle consent, damage, one file per reader, raw pairs.

The well-formed files are the ones tensorpack 0.11 wrote (tests/data, see make_tensorpack_fixtures.py);
damaged and crafted ones are made here with lmdb and msgpack, in tensorpack's layout.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import warnings

import lmdb
import msgpack
import numpy as np
import pytest
from tensorpack_reference import DATA

from bridgeflow import LMDBData, LMDBDataPoint, LMDBDataset, LMDBSerializer, load_dataset
from bridgeflow._sources import DataFromList
from bridgeflow.serialize import (
    CorruptDataError,
    DatasetChangedError,
    PickleNotAllowedError,
    UnsupportedFormatError,
    decode_tensorpack,
)
from conftest import results_of_forked_children

MSGPACK = os.path.join(DATA, "tensorpack_msgpack.lmdb")
PICKLE_DIR = os.path.join(DATA, "tensorpack_pickle.lmdb")
EXTRA = os.path.join(DATA, "tensorpack_msgpack_extra.lmdb")


def copy(src: str, dst) -> str:
    dst = str(dst)
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, dst)
    return dst


def write_tp(path, values: dict[bytes, bytes] | list[bytes], keys_entry: bytes | None = b"msgpack") -> str:
    """An LMDB file in tensorpack's layout (a single file), values given already serialized."""
    path = str(path)
    items = values if isinstance(values, dict) else {b"%08d" % i: v for i, v in enumerate(values)}
    env = lmdb.open(path, subdir=False, map_size=1 << 24, lock=False)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
        if keys_entry is not None:
            keys = sorted(items)
            txn.put(b"__keys__", pickle.dumps(keys, -1) if keys_entry == b"pickle" else msgpack.dumps(keys))
    env.close()
    return path


def mp_array(a: np.ndarray, overrides: dict | None = None) -> dict:
    """msgpack-numpy's map for an array (what tensorpack's msgpack values hold), with fields overridden."""
    m = {b"nd": True, b"type": a.dtype.str, b"kind": b"", b"shape": list(a.shape), b"data": a.tobytes()}
    m.update(overrides or {})
    return m


def pack(x) -> bytes:
    return msgpack.dumps(x, use_bin_type=True)


# --- layouts and formats ------------------------------------------------------------------------------

def test_both_layouts_are_recognised_and_format_can_be_forced(tmp_path):
    with LMDBSerializer.load(MSGPACK, shuffle=False) as one_file, \
            LMDBSerializer.load(PICKLE_DIR, shuffle=False, allow_pickle=True, format="tensorpack") as folder:
        assert one_file.format == folder.format == "tensorpack" and len(one_file) == len(folder) == 12
        assert one_file.meta["codec"] == "msgpack" and folder.meta["codec"] == "pickle"
        assert one_file.classes is None and folder.meta["checksum"] is None
        one_file.reset_state()
        folder.reset_state()
        with warnings.catch_warnings():  # tensorpack's numpy 1 pickles read without numpy 2's numpy.core shim
            warnings.simplefilter("error", DeprecationWarning)
            for a, b in zip(one_file, folder):
                assert a[2] == b[2] and a[4] == b[4] and np.array_equal(a[0], b[0])
    assert isinstance(load_dataset(MSGPACK), LMDBDataset)
    with pytest.raises(CorruptDataError, match="not one written by LMDBSerializer"):
        LMDBSerializer.load(MSGPACK, format="bridgeflow")
    ours = tmp_path / "ours.lmdb"
    LMDBSerializer.save(DataFromList([[1]]), ours, progress=False)
    with pytest.raises(CorruptDataError, match="written by bridgeflow's LMDBSerializer"):
        LMDBSerializer.load(ours, format="tensorpack")
    with pytest.raises(ValueError, match="unknown format"):
        LMDBSerializer.load(MSGPACK, format="caffe")


def test_an_lmdb_file_of_another_writer_is_refused_with_a_pointer_to_lmdbdata(tmp_path):
    path = write_tp(tmp_path / "other.lmdb", {b"a": b"1", b"b": b"2"}, keys_entry=None)
    with pytest.raises(CorruptDataError, match=r"nor by tensorpack's LMDBSerializer.*LMDBData\(path\)"):
        LMDBSerializer.load(path)
    with pytest.raises(CorruptDataError, match="key b'a' where key b'00000000' belongs"):
        LMDBSerializer.load(path, format="tensorpack")


# --- pickle consent -------------------------------------------------------------------------------------

class _Boom:
    """Unpickling it would create ``marker``: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_values_are_refused_without_consent_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    path = write_tp(tmp_path / "evil.lmdb", [pickle.dumps([_Boom(str(marker))], -1)], keys_entry=b"pickle")
    with pytest.raises(PickleNotAllowedError, match="TENSORPACK_SERIALIZE=pickle.*allow_pickle=True"):
        LMDBSerializer.load(path)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        LMDBSerializer.load(PICKLE_DIR)
    with pytest.warns(DeprecationWarning), pytest.raises(PickleNotAllowedError):
        LMDBDataPoint(path)
    with pytest.warns(DeprecationWarning), pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        LMDBDataPoint(LMDBData(path))
    assert not marker.exists()
    raw = LMDBData(path, shuffle=False)  # raw bytes need no consent: nothing is decoded
    raw.reset_state()
    assert [k for k, _ in raw] == [b"00000000"] and raw.serializer == "pickle"
    raw.close()
    assert not marker.exists()


def test_a_pickle_inside_a_msgpack_file_is_damage_and_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    path = write_tp(tmp_path / "tampered.lmdb", [pack([1]), pickle.dumps(_Boom(str(marker)), -1)])
    for allow in (False, True):
        with LMDBSerializer.load(path, shuffle=False, allow_pickle=allow) as ds:
            ds.reset_state()
            assert ds[0] == [1]
            with pytest.raises(CorruptDataError, match=r"tampered.lmdb: key '00000001'.*not unpickled"):
                list(ds)
    assert not marker.exists()


def test_object_arrays_in_msgpack_need_consent(tmp_path):
    with LMDBSerializer.load(EXTRA, shuffle=False) as ds:
        ds.reset_state()
        assert ds[0][0]["b"].tolist() == [2.5, 4.5]  # a structured array needs no pickle
        with pytest.raises(PickleNotAllowedError, match=r"extra.lmdb: key '00000001'.*object array"):
            ds[1]
        assert ds[2] == [complex(2, -1), 2]
    with LMDBSerializer.load(EXTRA, shuffle=False, allow_pickle=True) as ds:
        assert ds[1][0].tolist() == [1, "a", None]


# --- damage -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, match", [
    (pack([1, "abc"])[:-2], "not a valid msgpack value"),
    (pack([mp_array(np.arange(6, dtype=np.int32), {b"shape": [7]})]), "needs 28 bytes, the value holds 24"),
    (pack([mp_array(np.arange(2), {b"shape": [-2]})]), "shape"),
    (pack([mp_array(np.zeros(2, np.int64), {b"type": "|O"})]), "holds Python objects"),
    (pack([mp_array(np.zeros(2), {b"type": "not a dtype"})]), "not a valid msgpack value"),
    (msgpack.dumps(msgpack.ExtType(5, b"xx")), "extension type 5"),
    (b"\xc1", "not a valid msgpack value"),
], ids=["cut", "size", "negative-shape", "object-dtype", "bad-dtype", "ext", "reserved-byte"])
def test_damaged_values_are_corrupt_data_naming_file_and_key(tmp_path, value, match):
    path = write_tp(tmp_path / "bad.lmdb", [pack([0]), value, pack([2])])
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        assert ds[0] == [0] and ds[2] == [2]
        with pytest.raises(CorruptDataError, match=rf"bad.lmdb: key '00000001' \(datapoint 1\).*{match}"):
            ds[1]
        with pytest.raises(CorruptDataError, match=match):
            list(ds)


def test_keys_out_of_place_or_missing_are_errors_not_silent_gaps(tmp_path):
    path = write_tp(tmp_path / "gap.lmdb", {b"00000000": pack([0]), b"00000001": pack([1]), b"00000003": pack([3])})
    with pytest.raises(CorruptDataError, match="gap.lmdb: .*key b'00000003' where key b'00000002' belongs"):
        LMDBSerializer.load(path)  # 3 entries: keys 0..2 expected
    path = write_tp(tmp_path / "gap2.lmdb", {b"00000000": pack([0]), b"00000001x": pack([9]), b"00000002": pack([2])})
    for shuffle in (False, True):  # every key is checked when the file is opened, before anything is read
        with pytest.raises(CorruptDataError, match="gap2.lmdb: .*key b'00000001x' where key b'00000001' belongs"):
            LMDBSerializer.load(path, shuffle=shuffle)


def test_past_the_sequential_limit_datapoints_are_found_by_number(tmp_path, monkeypatch):
    """Past 10**8 datapoints tensorpack's keys have 9 digits and sort among the 8-digit ones, so the reader
    finds each datapoint by the number in its key (the limit is lowered here: the path is the same)."""
    from bridgeflow.serialize import _tensorpack_lmdb as tensorpack_lmdb

    monkeypatch.setattr(tensorpack_lmdb, "TENSORPACK_SEQUENTIAL_LIMIT", 2)
    path = write_tp(tmp_path / "big.lmdb", [pack([i]) for i in range(5)])
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        assert [dp[0] for dp in ds] == list(range(5)) and ds[3] == [3]
    gap = write_tp(tmp_path / "gap.lmdb", {b"%08d" % i: pack([i]) for i in (0, 1, 2, 4)})
    with pytest.raises(CorruptDataError, match=r"gap.lmdb: .*keys are not b'00000000' to b'00000003'"):
        LMDBSerializer.load(gap)


def test_a_truncated_file_is_an_error_not_a_crash(tmp_path):
    path = copy(MSGPACK, tmp_path / "cut.lmdb")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CorruptDataError, match="cut.lmdb"):
        LMDBSerializer.load(path)
    with pytest.raises(CorruptDataError, match="cut.lmdb"):
        LMDBData(path)


# --- one file per reader ------------------------------------------------------------------------------

def test_a_reader_keeps_reading_the_file_it_opened(tmp_path):
    path = copy(MSGPACK, tmp_path / "d.lmdb")
    ds = LMDBSerializer.load(path, shuffle=False)
    ds.reset_state()
    copy(EXTRA, tmp_path / "new.lmdb")
    os.replace(tmp_path / "new.lmdb", path)  # another tensorpack file renamed over the path
    assert len(ds) == 12 and [dp[2] for dp in ds] == list(range(12))
    with LMDBSerializer.load(path, allow_pickle=True) as fresh:
        assert len(fresh) == 3
    clone = pickle.loads(pickle.dumps(ds))  # a copy for another process opens the path again
    with pytest.raises(DatasetChangedError, match="replaced"):
        clone.reset_state()
    ds.close()


def test_readers_share_one_index_and_release_their_file(tmp_path):
    path = copy(MSGPACK, tmp_path / "s.lmdb")
    a, b, c = LMDBSerializer.load(path), LMDBSerializer.load(path, shuffle=False), LMDBData(path)
    assert a._index is b._index  # the tree is walked once per file and process
    fds = [x._pin.fd for x in (a, b, c)]
    a.close()
    assert b[3][2] == 3  # b's own descriptor stays open until b closes
    del b, c
    gc.collect()  # a reader dropped without close() closes its descriptor
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def _read_in_child(ds, q):
    ds.reset_state()
    q.put([dp[2] for dp in ds])


def test_forked_readers_read_the_same_file():
    ds = LMDBSerializer.load(MSGPACK, shuffle=False)
    ds.reset_state()
    assert results_of_forked_children(_read_in_child, (ds,), n=3) == [list(range(12))] * 3
    ds.close()


# --- raw pairs (tensorpack's LMDBData) ---------------------------------------------------------------

def test_lmdbdata_refuses_bridgeflow_files_pointing_to_the_loader(tmp_path):
    path = tmp_path / "bf.lmdb"
    LMDBSerializer.save(DataFromList([[1], [2]]), path, progress=False)
    with pytest.raises(UnsupportedFormatError, match=r"LMDBSerializer.load\(path\).*raw \[key, value bytes\]"):
        LMDBData(path)


def test_lmdbdata_keys_argument_as_in_tensorpack(tmp_path):
    path = write_tp(tmp_path / "k.lmdb", [pack([i]) for i in range(5)])
    with LMDBData(path, shuffle=True, keys=["00000003", b"00000001"], seed=0) as ds:
        ds.reset_state()
        assert len(ds) == 2 and sorted(k for k, _ in ds) == [b"00000001", b"00000003"]
    with LMDBData(path, shuffle=True, keys="{:08d}", seed=0) as ds:  # a format string: 0 .. entries-1
        ds.reset_state()
        assert len(ds) == 5 and sorted(decode_tensorpack(v)[0] for _, v in ds) == list(range(5))
    with LMDBData(path, shuffle=False, keys=["00000003"]) as ds:  # keys are for shuffling only, as in tensorpack
        ds.reset_state()
        assert len(ds) == 5 and [k for k, _ in ds] == [b"%08d" % i for i in range(5)]
    with LMDBData(path, shuffle=True, keys=["00000009"]) as ds:
        ds.reset_state()
        with pytest.raises(KeyError, match="00000009"):
            list(ds)
    with pytest.raises(TypeError, match="keys"):
        LMDBData(path, keys=b"00000001")


def test_lmdbdata_reads_any_lmdb_file(tmp_path):
    items = {b"b": b"2", b"a": b"1", b"c": b"\x00" * 5000}
    path = write_tp(tmp_path / "any.lmdb", items, keys_entry=None)
    with LMDBData(path, shuffle=False) as ds:
        ds.reset_state()
        assert list(ds) == [[k, items[k]] for k in sorted(items)] and len(ds) == 3
        assert ds[1] == [b"b", b"2"] and ds.serializer is None
    with LMDBData(path, shuffle=True, seed=4) as ds:  # keys found by one pass over the file
        ds.reset_state()
        epochs = [list(ds) for _ in range(3)]
        assert all(sorted(e) == sorted([k, v] for k, v in items.items()) for e in epochs)
        assert len({tuple(k for k, _ in e) for e in epochs}) > 1


def test_decode_tensorpack_arguments():
    scalar = {b"nd": False, b"type": "|i1", b"data": b"\x03"}  # msgpack-numpy's numpy scalar
    (got,) = decode_tensorpack(pack([scalar]))
    assert type(got) is np.int8 and got == 3
    with pytest.raises(CorruptDataError, match="not a pickle"):
        decode_tensorpack(pack([1]), serializer="pickle", allow_pickle=True)
    with pytest.raises(ValueError, match="unknown tensorpack serializer"):
        decode_tensorpack(pack([1]), serializer="json")


# --- resuming and sharding ------------------------------------------------------------------------------

def test_tensorpack_files_resume_and_shard_like_bridgeflow_files(tmp_path):
    from bridgeflow.testing import check_resumable

    path = write_tp(tmp_path / "tp.lmdb", [pack([mp_array(np.full(3, i, np.int16)), i]) for i in range(11)])
    label = lambda dp: int(dp[1])
    assert [label(dp) for dp in LMDBSerializer.load(path, shuffle=False)] == list(range(11))
    check_resumable(lambda: LMDBSerializer.load(path, shuffle=False))
    check_resumable(lambda: LMDBSerializer.load(path, shuffle=True, seed=3))
    parts = [[label(dp) for dp in LMDBSerializer.load(path, shuffle=True, seed=4, shard=(r, 2), drop_last=True)]
             for r in range(2)]
    assert [len(p) for p in parts] == [5, 5] and not set(parts[0]) & set(parts[1])
    # a sequential shard reads its own contiguous run of keys by one cursor pass
    assert [label(dp) for dp in LMDBSerializer.load(path, shuffle=False, shard=(1, 2))] == [6, 7, 8, 9, 10, 0]


def test_raw_pairs_resume_by_count_and_skip(tmp_path):
    from bridgeflow.testing import check_resumable

    path = write_tp(tmp_path / "tp.lmdb", [pack([i]) for i in range(7)])
    for shuffle in (False, True):
        first = check_resumable(lambda s=shuffle: LMDBData(path, shuffle=s, seed=9))
        assert sorted(k for k, _ in first) == [b"%08d" % i for i in range(7)]
