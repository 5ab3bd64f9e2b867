"""Compressed HDF5 chunks (bridgeflow.serialize._hdf5_chunks): a chunk over the limit is refused when the file
is opened, with its figures; a stream that decodes past its chunk's size is refused before libhdf5 decodes it
(gzip, lzf, szip); rows are read through a chunk cache that holds a row of chunks; and running out of memory
is a MemoryError naming the file, not damage."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from bridgeflow.serialize import CorruptDataError, UnsupportedFormatError, load_dataset
from bridgeflow.serialize._hdf5_chunks import MAX_CHUNK_BYTES, CheckedChunks, _lzf_decompress
from bridgeflow.serialize._hdf5_format import HDF5Data

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import crafted


def read_all(path, **kw):
    with HDF5Data(path, shuffle=False, **kw) as ds:
        ds.reset_state()
        return [dp[1] for dp in ds], [ds[i][1] for i in range(len(ds))]


@pytest.mark.parametrize("compression", ["gzip", "lzf", "szip"])
def test_compressed_columns_read_back(tmp_path, compression):
    path = tmp_path / "ok.h5"
    crafted.hdf5_compressed(str(path), 40, 4096, 16, compression)
    seq, by_index = read_all(path)
    assert seq == by_index == list(range(40))


def test_a_chunk_over_the_limit_is_refused_at_open_with_its_figures(tmp_path):
    """A 300 KB file holding one 256 MiB gzip chunk: every row read decoded the whole chunk (8 rows: 15 s and
    289 MB). Refused when opened, naming the chunk's shape, its bytes and the limit; verify=False reads it."""
    path = tmp_path / "bomb.h5"
    crafted.hdf5_compressed(str(path), 256, 1 << 20, 256)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(UnsupportedFormatError, match=r"bomb\.h5: dataset 'img' is stored in gzip chunks of "
                                                     r"268,435,456 bytes \(\(256, 1048576\) of uint8\); .*at most "
                                                     f"{MAX_CHUNK_BYTES:,} bytes.*verify=False"):
        HDF5Data(path)
    with pytest.raises(UnsupportedFormatError, match="bomb.h5"):
        load_dataset(path)
    with HDF5Data(path, shuffle=False, verify=False) as ds:  # a file the caller trusts
        assert ds[3][1] == 3


def test_rows_read_in_order_decode_each_chunk_once(tmp_path):
    """A chunk of 16 rows of 1 MiB: libhdf5's default cache (1 MiB) decoded the 16 MiB chunk again for every
    row; the dataset is opened with a cache that holds a row of chunks."""
    path = tmp_path / "big.h5"
    crafted.hdf5_compressed(str(path), 32, 1 << 20, 16)
    with HDF5Data(path, shuffle=False) as ds:
        ds.reset_state()
        column = ds._datasets()[0][1]
        assert isinstance(column, CheckedChunks)
        nslots, nbytes, w0 = column.ds.id.get_access_plist().get_chunk_cache()
        assert nbytes > 16 << 20  # holds a whole chunk: a chunk of the cache's size exactly is not cached
        assert [ds[i][1] for i in range(32)] == list(range(32))
        assert column.checked.all()


def test_a_gzip_stream_that_inflates_past_its_chunk_is_refused(tmp_path):
    """A 1 MB file whose 1 MiB chunk inflates to 1 GiB: libhdf5's deflate filter doubles its buffer until the
    stream ends (1,086 MB for one row). Checked in 1 MiB pieces first, it is refused at the first piece past."""
    path = tmp_path / "stream.h5"
    crafted.hdf5_stream_bomb(str(path), 1024, 1024, 64 << 20)
    with HDF5Data(path, shuffle=False) as ds:
        with pytest.raises(CorruptDataError, match=r"stream\.h5: dataset 'img', the chunk at \(0, 0\): its gzip stream "
                                                   r"inflates past the 1,048,576 bytes the chunk holds"):
            ds[5]
        with pytest.raises(CorruptDataError, match="inflates past"):
            list(ds)


def _rewrite_chunk(path, change):
    with h5py.File(path, "r+") as f:
        ds = f["img"]
        mask, raw = ds.id.read_direct_chunk((0, 0))
        ds.id.write_direct_chunk((0, 0), change(raw), mask)


def test_an_lzf_or_szip_chunk_that_decodes_past_its_size_is_refused(tmp_path):
    assert _lzf_decompress() is not None  # h5py's own lzf_decompress, found in its h5z module (a private symbol)
    lzf = tmp_path / "lzf.h5"
    crafted.hdf5_compressed(str(lzf), 16, 1024, 16, "lzf")
    big = tmp_path / "big.h5"
    crafted.hdf5_compressed(str(big), 1024, 1024, 1024, "lzf")  # zeros: 1 MiB in a few KB of lzf
    with h5py.File(big, "r") as f:
        stream = f["img"].id.read_direct_chunk((0, 0))[1]
    _rewrite_chunk(lzf, lambda raw: stream)
    with HDF5Data(lzf, shuffle=False) as ds, \
            pytest.raises(CorruptDataError, match=r"lzf\.h5: .*its lzf stream decodes past the 16,384 bytes"):
        ds[0]
    szip = tmp_path / "szip.h5"
    crafted.hdf5_compressed(str(szip), 16, 1024, 16, "szip")
    _rewrite_chunk(szip, lambda raw: (2 << 30).to_bytes(4, "little") + raw[4:])  # claims 2 GiB: libhdf5 allocates it
    with HDF5Data(szip, shuffle=False) as ds, \
            pytest.raises(CorruptDataError, match=r"szip\.h5: .*its szip stream claims 2,147,483,648 bytes for 16,384"):
        ds[0]


def test_a_filter_whose_output_cannot_be_bounded_is_refused_unless_trusted(tmp_path):
    path = tmp_path / "so.h5"
    crafted._replace_column(str(path), 8, 16, lambda f: f.create_dataset(
        "img", data=np.zeros((8, 16), np.uint8), chunks=(4, 16), scaleoffset=0))
    with pytest.raises(UnsupportedFormatError, match=r"so\.h5: dataset 'img' is stored through the filters "
                                                     r"scaleoffset; .*verify=False"):
        HDF5Data(path)
    assert read_all(path, verify=False)[0] == list(range(8))


OOM_SCRIPT = """
import resource, sys
from bridgeflow.serialize._hdf5_format import HDF5Data

ds = HDF5Data(sys.argv[1], shuffle=False)
ds.reset_state()
ds[0]  # imports and opens everything first: what is left to allocate is the chunk's decoding
for line in open("/proc/self/status"):
    if line.startswith("VmSize:"):
        size = int(line.split()[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (size + (24 << 20), resource.RLIM_INFINITY))
try:
    ds[20]  # in the second chunk: 16 MiB to decode, with 24 MiB to spare
except BaseException as exc:
    print(type(exc).__name__, exc)
"""


def test_running_out_of_memory_is_a_memory_error_naming_the_file(tmp_path):
    """libhdf5 reports a failed allocation in a filter as "filter returned failure", which was read as damage."""
    path = tmp_path / "tight.h5"
    crafted.hdf5_compressed(str(path), 32, 1 << 20, 16)
    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("MemoryError") and "tight.h5: not enough memory" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]
