"""A batch read into its rows (bridgeflow/_stacked.py): while a batch is collated, LMDBDataset reads each
value's arrays straight into their rows of one array per component, and the collation takes that array as the
batch instead of stacking copies. The datapoints are those of single reads; a damaged or cut value is still
named; only a block made for this batch, once, in order, is taken."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_serialize_lmdb_blocks import _same

from bridgeflow import DataFromList, LMDBSerializer
from bridgeflow._stacked import collating, new_block, take_block
from bridgeflow.serialize import CorruptDataError

KINDS = {  # values of 16 KiB and more: read one by one, each into its rows
    "image_int": lambda i: [np.full((3, 80, 80), i % 251, np.uint8), i],
    "two_arrays_dict": lambda i: {"x": np.full((70, 70), i, np.float32), "y": np.arange(5, dtype=np.int16) + i,
                                  "id": i},
    "strings_vary": lambda i: [np.full(20000, i % 7, np.uint8), "s" * (i % 5)],  # the parts lie elsewhere
    "shapes_vary": lambda i: [np.full((100, 200) if i % 2 else (200, 100), i, np.uint8), i],  # one size
}
UNIFORM = {"image_int": [0], "two_arrays_dict": ["x", "y"]}  # the components stacked as one block


def test_take_block_takes_its_own_rows_in_order_once():
    assert new_block(2, (3,), np.dtype(np.int16)) is None  # no batch is being collated
    with collating():
        block = new_block(4, (3,), np.dtype(np.int16))
        block[...] = np.arange(12).reshape(4, 3)
        rows = [block[k] for k in range(4)]
        assert take_block(rows[::-1]) is None and take_block(rows[:3]) is None  # not in order; not all of them
        assert take_block([block[0], block[1], block[2], block[3].copy()]) is None  # one of them elsewhere
        assert take_block(rows) is block
        assert take_block(rows) is None  # taken once
        lookalike = np.zeros((2, 3), np.int16)  # shaped as a batch, but not made for one
        assert take_block([lookalike[0], lookalike[1]]) is None
    with collating(lambda shape, dtype: np.zeros(shape, dtype)):  # the allocator given, e.g. a worker's slab
        made = new_block(2, (5,), np.dtype(np.float32))
        assert made.shape == (2, 5) and not made.any()
    assert take_block([made[0], made[1]]) is None  # outside the batch it was made for


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("checksum", [True, False])
def test_values_read_into_rows_are_the_datapoints_of_single_reads(kind, checksum, tmp_path):
    rows = [KINDS[kind](i) for i in range(60)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False, checksum=checksum)
    order = np.random.default_rng(0).permutation(60).tolist()[:20] + [-1, 5, 5]
    with LMDBSerializer.load(path, shuffle=False) as ds:
        ds.reset_state()
        assert not ds._index.small
        with collating():
            got = ds.__getitems__(order)
            for i, dp in zip(order, got):
                _same(dp, ds[i])
                _same(dp, rows[i])
            for key in UNIFORM.get(kind, []):
                parts = [dp[key] for dp in got]
                block = take_block(parts)
                assert block is not None, key  # read straight into the rows of one array
                assert block.tobytes() == np.stack([rows[i][key] for i in order]).tobytes()
            if kind not in UNIFORM:  # arrays of their own (another layout, or shape): stacked by a copy
                assert take_block([dp[0] for dp in got]) is None
        _same(ds.__getitems__(order), [rows[i] for i in order])  # outside a collation: each value on its own
        with collating():
            single = ds.__getitems__([7])  # one value: read as ds[i]
            _same(single, [rows[7]])


def test_a_damaged_value_read_into_rows_is_named(tmp_path):
    rows = [KINDS["image_int"](i) for i in range(30)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=False) as ds:
        off, size = int(ds._index.offsets[17]), int(ds._index.sizes[17])
    with open(path, "r+b") as f:  # a byte inside the array: it lands in the batch's row, and its CRC fails
        f.seek(off + size - 1000)
        byte = f.read(1)
        f.seek(off + size - 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    with LMDBSerializer.load(path, shuffle=False) as ds, collating():
        ds.reset_state()
        assert [dp[1] for dp in ds.__getitems__([3, 16, 18])] == [3, 16, 18]
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 17: checksum mismatch"):
            ds.__getitems__([3, 17, 18])
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: datapoint 17: checksum mismatch"):
            ds.__getitems__([17, 3])  # the first value of the batch, read whole


def test_a_file_cut_under_a_batch_read_into_rows_is_named(tmp_path):
    rows = [KINDS["image_int"](i) for i in range(40)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    with LMDBSerializer.load(path, shuffle=False) as ds, collating():
        ds.reset_state()
        ds.__getitems__([0, 1])
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(CorruptDataError, match=r"d\.lmdb: the file was cut to \d+ bytes while open"):
            ds.__getitems__([1, 39])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_drop_in_collates_an_lmdb_dataset_read_into_rows(num_workers, tmp_path):
    """torch's DataLoader semantics over an LMDBDataset whose batches are read into their rows (in the workers'
    shared memory with workers): the batches torch's own loader makes of the same datapoints."""
    from conftest import need

    need("torch")
    import torch
    import torch.utils.data as tud

    from bridgeflow.adapters.torch import DataLoader
    from bridgeflow.serialize import LMDBDataset

    rows = [KINDS["two_arrays_dict"](i) for i in range(50)]
    path = str(tmp_path / "d.lmdb")
    LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    with LMDBDataset(path, shuffle=False) as ds:
        ours = list(DataLoader(ds, batch_size=16, num_workers=num_workers, **kw))
    theirs = list(tud.DataLoader(rows, batch_size=16))
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert set(a) == set(b)
        for key in b:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_the_fast_collation_takes_a_block_and_copies_anything_else():
    from conftest import need

    need("torch")
    from bridgeflow.adapters.torch._compat import fast_default_collate

    with collating():
        block = new_block(3, (4,), np.dtype(np.float32))
        block[...] = np.arange(12).reshape(3, 4)
        out = fast_default_collate([[block[k], k] for k in range(3)])
        assert np.shares_memory(out[0].numpy(), block) and out[1].tolist() == [0, 1, 2]
        mine = np.arange(12, dtype=np.float32).reshape(3, 4)  # the user's array, shaped as a batch
        again = fast_default_collate([[mine[k], k] for k in range(3)])
        assert not np.shares_memory(again[0].numpy(), mine) and again[0].tolist() == mine.tolist()
