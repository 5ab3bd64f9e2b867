"""A seeded fuzz of the three dataset formats in the normal test run: a few hundred random mutations per
format (zeroed or random 4 KiB pages, flipped bytes, cuts), each read whole in a worker process killed
after a timeout. Every read ends, with the data as saved or a bridgeflow error naming the file. The full
2,000-mutation run is ``python tests/fuzz/fuzz_serialize.py``."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import fuzz_serialize

MUTATIONS = 300


@pytest.fixture(scope="module")
def reader():
    r = fuzz_serialize.Reader()
    yield r
    r.stop()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "npz", "lmdb-nochecksum"])
def test_damaged_files_never_hang_crash_or_read_back_wrong(tmp_path, reader, fmt):
    result = fuzz_serialize.run(fmt, MUTATIONS, seed=7, timeout=15.0, folder=str(tmp_path), reader=reader)
    assert result["hangs"] == 0, result
    assert result["crashes"] == 0, result
    assert result["foreign_errors"] == 0, result  # every error is a bridgeflow error naming the file
    assert result["outcomes"].get("error:CorruptDataError", 0) > MUTATIONS // 2, result  # damage is noticed
    if fmt != "lmdb-nochecksum":  # checksummed: a read that succeeds returns exactly what was saved
        assert result["silent_wrong"] == 0, result


CRAFTED = 16


@pytest.mark.parametrize("fmt", ["npz", "hdf5", "special"])
def test_crafted_files_end_as_their_kind_calls_for_within_what_they_declare(tmp_path, reader, fmt, monkeypatch):
    """Files crafted as an attacker would (compression bombs in every npz method and HDF5 gzip, lzf and szip
    chunks, lying sizes, duplicated names, user blocks, filters nobody can bound, paths that are not files),
    each read under twice what it declares plus 64 MiB: an honest one reads back, every other ends in the error
    its kind calls for, naming the file; none hangs or runs out of memory. (The full run: ``--crafted 200``.)"""
    import crafted

    monkeypatch.setattr(crafted, "NPZ_BOMB_EXTRAS", (1 << 20, 64 << 20))  # the full run adds 256 MiB
    monkeypatch.setattr(crafted, "HDF5_BOMB_SIZES", (4 << 20, 128 << 20))
    monkeypatch.setattr(crafted, "HDF5_MOST_DECLARED", 8 << 20)
    result = fuzz_serialize.run_crafted(fmt, CRAFTED, seed=3, timeout=60.0, folder=str(tmp_path), reader=reader)
    assert result["unexpected"] == 0 and result["hangs"] == 0 and result["out_of_memory"] == 0, result
    if fmt != "special":
        assert result["outcomes"].get("read", 0) >= 2 and result["outcomes"].get("error:CorruptDataError", 0) >= 2, \
            result


def test_aliasing_skips_a_page_whose_header_is_not_one():
    """An overflow value's continuation pages have no header: bytes there that look like a leaf's flags with
    ``upper < lower`` are no page to alias (the full run with seed 0 died on one: OverflowError from the
    mutation itself, a negative entry count written into the meta pages)."""
    psize = 4096
    b = bytearray(3 * psize)
    at = 2 * psize
    b[at + 10] = 0x02  # "leaf"
    b[at + 12:at + 14] = (400).to_bytes(2, "little")  # lower
    b[at + 14:at + 16] = (100).to_bytes(2, "little")  # upper, below lower
    before = bytes(b)
    fuzz_serialize.alias_pointers(b, random.Random(0), psize)
    assert bytes(b) == before
