"""Sequential reads of small LMDB values decode a whole block at once (``codec.decode_many``): the same
datapoints as reading each value alone, writable and independent, and every damaged value still named."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridgeflow import DataFromList, LMDBSerializer
from bridgeflow._codec import decode_many, encode
from bridgeflow.serialize import CorruptDataError


def _same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert repr(a) == repr(b)


def read_all(path: str) -> list:
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        seq = list(ds)
        alone = [ds[i] for i in range(len(ds))]  # each value read and decoded alone
    return seq, alone


KINDS = {
    "vector_int": lambda i: [np.arange(i % 5, i % 5 + 300, dtype=np.uint8), i],
    "vector_float_label": lambda i: [np.full(60, i, np.float32), i / 3],
    "float64_vector": lambda i: [np.full(37, i, np.float64), -i],  # 8-byte items: misaligned in the block
    "matrix": lambda i: [np.full((3, 4), i, np.int16), i],
    "dict": lambda i: {"x": np.full(20, i, np.int32), "y": i},
    "tuple3": lambda i: (np.full(9, i, np.int64), i, 2.5),
    "strings": lambda i: [np.full(9, i % 100, np.int8), f"name{i}"],
    "ragged": lambda i: [np.zeros(i % 7, np.uint8), i],
    "mixed": lambda i: [np.zeros(4, np.uint8), i] if i % 3 else [np.zeros(4, np.uint16), float(i)],
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("checksum", [True, False])
def test_block_reads_give_what_single_reads_give(kind, checksum, tmp_path):
    rows = [KINDS[kind](i) for i in range(3000)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False, checksum=checksum)
    seq, alone = read_all(path)
    for got, single, want in zip(seq, alone, rows):
        _same(got, want)
        _same(single, want)
    arrays = [a for dp in seq for a in (dp.values() if isinstance(dp, dict) else dp) if isinstance(a, np.ndarray)]
    assert all(a.flags.writeable and a.flags.aligned for a in arrays)
    arrays[0][...] = 0  # independent: writing one changes no other datapoint
    _same(seq[1], rows[1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 300), length=st.integers(0, 40), dtype=st.sampled_from(["u1", "<i2", "<f4", "<f8", "<c8"]),
       label=st.sampled_from(["int", "float"]), data=st.data())
def test_decode_many_equals_decode(n, length, dtype, label, data):
    """Encodings laid out as LMDB lays them (at even offsets, gaps between), decoded together."""
    values = []
    for i in range(n):
        number = i - 5 if label == "int" else i * 0.25
        values.append(encode([(np.arange(i, i + length) % 250).astype(dtype), number]))
    gaps = data.draw(st.lists(st.sampled_from([0, 2, 6, 16, 30]), min_size=n, max_size=n))
    starts, at = [], data.draw(st.sampled_from([0, 2, 8]))
    for v, gap in zip(values, gaps):
        starts.append(at)
        at += len(v) + gap
    block = bytearray(at)
    for s, v in zip(starts, values):
        block[s:s + len(v)] = v
    got = decode_many(memoryview(block), np.array(starts, np.int64), len(values[0]))
    assert got is not None
    from bridgeflow._codec import decode

    for g, v in zip(got, values):
        _same(g, decode(bytearray(v)))


def test_unlike_encodings_are_left_to_decode_one_by_one():
    a, b = encode([np.zeros(4, np.uint8), 1]), encode([np.zeros(4, np.int8), 1])  # same length, other dtype
    assert len(a) == len(b)
    block = bytearray(a + b)
    assert decode_many(memoryview(block), np.array([0, len(a)]), len(a)) is None
    c = encode([np.zeros(2, np.uint16), 1])  # same bytes, other length in the values
    assert len(c) == len(a)
    assert decode_many(memoryview(bytearray(a + c)), np.array([0, len(a)]), len(a)) is None


@pytest.mark.parametrize("where", ["array", "header", "label", "crc"])
def test_a_damaged_value_in_a_block_is_named(where, tmp_path):
    rows = [[np.full(300, i % 250, np.uint8), i] for i in range(2000)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=False) as ds:
        off, size = int(ds._index.offsets[777]), int(ds._index.sizes[777])
    pos = {"array": off + size - 100, "header": off + 5, "label": off + size - 4 - 320, "crc": off + size - 2}[where]
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        with pytest.raises(CorruptDataError, match="datapoint 777"):
            for _ in ds:
                pass


def test_a_file_cut_under_a_sequential_reader_is_an_error(tmp_path):
    rows = [[np.full(300, i % 250, np.uint8), i] for i in range(5000)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        it = iter(ds)
        next(it)
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(CorruptDataError, match="d.lmdb"):
            for _ in it:
                pass


@pytest.mark.parametrize("kind", ["vector_int", "matrix", "strings", "ragged", "mixed"])
@pytest.mark.parametrize("checksum", [True, False])
def test_shuffled_batches_give_what_single_reads_give(kind, checksum, tmp_path):
    """Shuffled epochs read small values a batch at a time (``_lmdb_rows``), with checksums or without: each
    datapoint is the one its index names, resuming mid-batch hands out the rest of the order, and the arrays
    are independent."""
    rows = [KINDS[kind](i) for i in range(1200)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False, checksum=checksum)
    with LMDBSerializer.load(path, shuffle=True, seed=3) as ds:
        ds.reset_state()
        got = list(ds)
        order = ds._order.runs(0)[0]
        for i, dp in zip(order, got):
            _same(dp, rows[i])
        it = iter(ds)
        first = [next(it) for _ in range(300)]  # past one batch and into the next
        state = ds.state_dict()
        rest = list(it)
    with LMDBSerializer.load(path, shuffle=True, seed=3) as again:
        again.load_state_dict(state)
        again.reset_state()
        resumed = list(again)
    assert len(first) + len(rest) == len(rows) == 300 + len(resumed)
    for a, b in zip(rest, resumed):
        _same(a, b)
    arrays = [dp[0] if isinstance(dp, list) else dp["x"] for dp in got[:50]]
    arrays[0][...] = 0
    _same(got[1], rows[order[1]])


@pytest.mark.parametrize("where", ["array", "crc"])
def test_a_damaged_value_in_a_shuffled_batch_is_named_after_the_sound_ones(where, tmp_path):
    rows = [[np.full(300, i % 250, np.uint8), i] for i in range(1000)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=True, seed=0) as ds:
        ds.reset_state()
        off, size = int(ds._index.offsets[777]), int(ds._index.sizes[777])
        at = ds._order.runs(0)[0].index(777)
    pos = {"array": off + size - 100, "crc": off + size - 2}[where]
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x01]))
    with LMDBSerializer.load(path, shuffle=True, seed=0) as ds:
        ds.reset_state()
        seen = []
        with pytest.raises(CorruptDataError, match="datapoint 777: checksum mismatch"):
            for dp in ds:
                seen.append(dp[1])
    assert len(seen) == at and 777 not in seen  # every datapoint before it in the order, and not it


def test_a_file_cut_under_a_shuffled_reader_is_an_error(tmp_path):
    rows = [[np.full(300, i % 250, np.uint8), i] for i in range(5000)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=True, seed=1) as ds:
        ds.reset_state()
        it = iter(ds)
        next(it)
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(CorruptDataError, match="d.lmdb.*cut"):
            for _ in it:
                pass


@pytest.mark.parametrize("kind", ["vector_int", "dict", "ragged", "mixed"])
@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("region", [True, False])
def test_getitems_gives_what_single_reads_give(kind, checksum, region, tmp_path, monkeypatch):
    """``ds.__getitems__(indices)`` (what torch's DataLoader calls for a batch) reads small values as a batch,
    from the file's values held in memory or one ``preadv`` each: the datapoints of ``ds[i]``, negative
    indices and a shard's numbering included, independent arrays, and ``ds[i]``'s errors for bad indices."""
    from bridgeflow.serialize import _lmdb_rows

    if not region:
        monkeypatch.setattr(_lmdb_rows, "REGION_BYTES", 0)
    rows = [KINDS[kind](i) for i in range(700)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False, checksum=checksum)
    order = np.random.default_rng(0).permutation(700).tolist() + [-1, -700, 5, 5]
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        got = ds.__getitems__(order)
        assert (ds.__dict__.get("_values_region") is not None) == region
        for i, dp in zip(order, got):
            _same(dp, ds[i])
            _same(dp, rows[i])
        first = got[-2][0] if isinstance(got[-2], list) else got[-2]["x"]
        first[...] = 1
        _same(got[-1], rows[5])  # the same index twice: two datapoints of their own
        with pytest.raises(IndexError, match="index 700 out of range"):
            ds.__getitems__([1, 700])
        with pytest.raises(TypeError, match="integers"):
            ds.__getitems__([1, None])
    with LMDBSerializer.load(path, shuffle=False, shard=(1, 3)) as part:
        part.reset_state()
        _same(part.__getitems__([0, 5, -1]), [part[0], part[5], part[-1]])


@pytest.mark.parametrize("where", ["array", "crc"])
def test_a_damaged_value_read_by_getitems_is_named(where, tmp_path):
    rows = [[np.full(300, i % 250, np.uint8), i] for i in range(1000)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=False) as ds:
        off, size = int(ds._index.offsets[777]), int(ds._index.sizes[777])
    pos = {"array": off + size - 100, "crc": off + size - 2}[where]
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x01]))
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        assert [dp[1] for dp in ds.__getitems__([3, 776, 778])] == [3, 776, 778]
        with pytest.raises(CorruptDataError, match="datapoint 777: checksum mismatch"):
            ds.__getitems__([3, 777, 778])


def test_getitems_on_a_file_cut_or_committed_to_since_it_was_read_is_an_error(tmp_path):
    """The values ``__getitems__`` holds are the file as opened: a file cut or written since is an error at
    the next call, as for ``ds[i]``, never the held bytes."""
    import lmdb

    from bridgeflow.serialize import DatasetChangedError

    rows = [[np.full(300, i % 250, np.uint8), i] for i in range(3000)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        assert [dp[1] for dp in ds.__getitems__([0, 2999])] == [0, 2999]
        assert ds.__dict__.get("_values_region") is not None
        env = lmdb.open(path, subdir=False, lock=False, map_size=1 << 30)
        with env.begin(write=True) as txn:
            txn.put(b"other", b"x")
        env.close()
        with pytest.raises(DatasetChangedError, match="being written"):
            ds.__getitems__([1, 2])
    cut = str(tmp_path / "cut.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), cut, progress=False)
    with LMDBSerializer.load(cut, shuffle=False) as ds:
        ds.reset_state()
        ds.__getitems__([0])
        os.truncate(cut, os.path.getsize(cut) // 2)
        with pytest.raises(CorruptDataError, match="cut.lmdb.*cut"):
            ds.__getitems__([1, 2])


def test_rows_crc_is_the_crc_of_sound_rows_end_to_end_and_catches_one_flipped_bit():
    import zlib

    from bridgeflow.serialize._lmdb_rows import rows_crc

    rng = np.random.default_rng(0)
    for s, k in [(4, 1), (5, 3), (384, 256), (1000, 7)]:
        bodies = [rng.integers(0, 256, s - 4, dtype=np.uint8).tobytes() for _ in range(k)]
        rows = bytearray(b"".join(b + zlib.crc32(b).to_bytes(4, "little") for b in bodies))
        assert zlib.crc32(rows) == rows_crc(k, s)
        for bit in rng.integers(0, 8 * len(rows), 20).tolist():
            rows[bit // 8] ^= 1 << (bit % 8)
            assert zlib.crc32(rows) != rows_crc(k, s)
            rows[bit // 8] ^= 1 << (bit % 8)


# --- large values: read one by one, the writer's watch read once a batch (``LMDBDataset._read_each``) ----

def _large(i: int) -> list:
    return [np.full(20_000 + i % 7, i % 251, np.uint8), i]  # overflow pages: read one value at a time


@pytest.mark.parametrize("shuffle", [False, True])
def test_large_values_read_a_batch_at_a_time_resume_mid_batch_exactly(shuffle, tmp_path):
    """Large values come a batch of ~4 MiB (about 200 of these) at a time: each is the one its index names,
    a state taken mid-batch resumes with the next one, and the arrays are the datapoints' own."""
    from bridgeflow.serialize import _lmdb_format as lmdb_format

    n = 500
    rows = [_large(i) for i in range(n)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    per_batch = lmdb_format._EACH_BYTES // 20_000
    assert 2 < per_batch < n // 2  # the epoch spans several batches
    with LMDBSerializer.load(path, shuffle=shuffle, seed=5) as ds:
        assert not ds._index.small
        ds.reset_state()
        got = list(ds)
        order = list(ds._order.runs(0)[0])
        assert [dp[1] for dp in got] == order
        for i, dp in zip(order, got):
            _same(dp, rows[i])
        it = iter(ds)
        stop = per_batch + 7  # inside the second batch
        first = [next(it) for _ in range(stop)]
        state = ds.state_dict()
        rest = list(it)
        epoch_order = list(ds._order.runs(1)[0])
    with LMDBSerializer.load(path, shuffle=shuffle, seed=5) as again:
        again.load_state_dict(state)
        again.reset_state()
        resumed = list(again)
    assert [dp[1] for dp in first + rest] == epoch_order
    assert [dp[1] for dp in resumed] == epoch_order[stop:]
    for a, b in zip(rest, resumed):
        _same(a, b)
    got[0][0][...] = 7  # independent: writing one changes no other datapoint
    _same(got[1], rows[order[1]])


@pytest.mark.parametrize("where", ["array", "crc", "header"])
def test_a_damaged_large_value_is_named_after_the_sound_ones_of_its_batch(where, tmp_path):
    n = 400
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList([_large(i) for i in range(n)], shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=True, seed=0) as ds:
        ds.reset_state()
        off, size = int(ds._index.offsets[277]), int(ds._index.sizes[277])
        at = ds._order.runs(0)[0].index(277)
    pos = {"array": off + size // 2, "crc": off + size - 2, "header": off + 3}[where]
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x04]))
    for shuffle in (True, False):
        with LMDBSerializer.load(path, shuffle=shuffle, seed=0) as ds:
            ds.reset_state()
            seen = []
            with pytest.raises(CorruptDataError, match="d.lmdb: datapoint 277: checksum mismatch"):
                for dp in ds:
                    seen.append(dp[1])
        want = at if shuffle else 277
        assert len(seen) == want and 277 not in seen  # every datapoint before it in the order, not it


def test_a_commit_while_large_values_are_read_is_an_error_at_the_next_batch(tmp_path):
    """The watch is read once a batch, after the batch's values and before any is handed out: what is handed
    out was read from the file as opened, and the first batch read after a commit raises."""
    import lmdb

    from bridgeflow.serialize import DatasetChangedError

    n = 600
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList([_large(i) for i in range(n)], shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=True, seed=2) as ds:
        ds.reset_state()
        it = iter(ds)
        seen = [next(it) for _ in range(10)]
        with lmdb.open(path, subdir=False, lock=False, map_size=1 << 30) as env, env.begin(write=True) as txn:
            txn.put((3).to_bytes(8, "big"), b"x" * 50)  # another value where datapoint 3's lay
        with pytest.raises(DatasetChangedError, match="being written"):
            for dp in it:
                seen.append(dp)
    assert len(seen) < n
    for dp in seen:
        _same(dp, _large(dp[1]))
