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
