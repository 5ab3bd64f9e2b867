"""Dataset files crafted as an attacker would: compression bombs, user blocks, duplicated names.

Each builder writes one file and returns what it declares (the decompressed bytes its headers promise),
which is what a reader may spend memory on. Used by ``fuzz_serialize.py --crafted`` (every file read
under a memory limit of twice what it declares plus 64 MiB) and by the serialize tests.

- ``npz_bomb``: a NumpySerializer file whose first array member is recompressed (deflate, bzip2 or LZMA)
  from its own bytes followed by ``extra`` zeros: its declared size and CRC are those of the array, its
  stream goes on for ``extra`` bytes more (Python's zipfile inflates a bzip2 or LZMA chunk whole, then cuts).
- ``npz_duplicate``: two members of one name, the second one different.
- ``hdf5_compressed``: a bridgeflow HDF5 file whose array column is recompressed (gzip, lzf, szip) in
  chunks of ``chunk_rows`` rows: one large chunk is the "chunk bomb" (valid CRCs, a small file).
- ``hdf5_stream_bomb``: a gzip column whose first chunk's stream inflates far past the chunk's size.
- ``hdf5_userblock``: a bridgeflow HDF5 file behind a user block of ``size`` bytes, optionally filled with
  a complete zip (so it starts with ``PK\\3\\4``).

Example:
    >>> declared = npz_bomb("bomb.npz", "bzip2", extra=1 << 20)
"""

from __future__ import annotations

import bz2
import json
import lzma
import os
import struct
import zipfile
import zlib

import numpy as np

__all__ = ["hdf5_compressed", "hdf5_stream_bomb", "hdf5_userblock", "npz_bomb", "npz_duplicate", "write_zip"]

_METHOD = {"stored": zipfile.ZIP_STORED, "deflate": zipfile.ZIP_DEFLATED, "bzip2": zipfile.ZIP_BZIP2,
           "lzma": zipfile.ZIP_LZMA}
_LZMA_FILTER = {"id": lzma.FILTER_LZMA1, "dict_size": 1 << 20, "lc": 3, "lp": 0, "pb": 2}


def _compress(method: str, chunks) -> bytes:
    """``chunks`` (an iterable of bytes) compressed as a zip member of ``method`` stores them."""
    if method == "stored":
        return b"".join(chunks)
    if method == "deflate":
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
    elif method == "bzip2":
        c = bz2.BZ2Compressor(9)
    else:
        c = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=[_LZMA_FILTER])
    out = [c.compress(b) for b in chunks]
    out.append(c.flush())
    data = b"".join(out)
    if method == "lzma":  # zip's LZMA: version 9.4, the properties' size, the properties, the raw stream
        props = bytes([(_LZMA_FILTER["pb"] * 5 + _LZMA_FILTER["lp"]) * 9 + _LZMA_FILTER["lc"]])
        props += struct.pack("<I", _LZMA_FILTER["dict_size"])
        data = b"\x09\x04" + struct.pack("<H", len(props)) + props + data
    return data


def write_zip(path: str, members: list[tuple[str, str, int, int, bytes]], prefix: bytes = b"") -> None:
    """A zip of ``(name, method, declared size, CRC-32, compressed bytes)`` members, written as they are
    (nothing checked: declared sizes and streams may disagree), after ``prefix``."""
    out, central = bytearray(prefix), bytearray()
    for name, method, size, crc, data in members:
        m = _METHOD[method]
        flags = 0x02 if m == zipfile.ZIP_LZMA else 0  # bit 1: the LZMA stream has an end marker
        version = 63 if m == zipfile.ZIP_LZMA else 46 if m == zipfile.ZIP_BZIP2 else 20
        raw = name.encode()
        at = len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", version, flags, m, 0, 0x21, crc, len(data), size,
                           len(raw), 0) + raw + data
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", version, version, flags, m, 0, 0x21, crc,
                               len(data), size, len(raw), 0, 0, 0, 0, 0o644 << 16, at) + raw
    cd_at = len(out)
    out += central
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), cd_at, 0)
    with open(path, "wb") as f:
        f.write(out)


def _members(path: str) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _small_npz(path: str, n: int = 16) -> None:
    from bridgeflow import DataFromList
    from bridgeflow.serialize import NumpySerializer

    rng = np.random.default_rng(0)
    dps = [[rng.integers(0, 256, (8, 8), dtype=np.uint8), i] for i in range(n)]
    NumpySerializer.save(DataFromList(dps, shuffle=False), path, progress=False, overwrite=True)


def npz_bomb(path: str, method: str, extra: int) -> int:
    """See the module doc; returns the bytes the file declares."""
    _small_npz(path)
    members = _members(path)
    out = []
    for k, (name, data) in enumerate(members):
        def stream(data: bytes = data, bomb: bool = k == 0):
            yield data
            left = extra if bomb else 0
            while left > 0:
                yield bytes(min(left, 16 << 20))
                left -= 16 << 20
        out.append((name, method, len(data), zlib.crc32(data), _compress(method, stream())))
    write_zip(path, out)
    return sum(len(d) for _, d in members)


def npz_duplicate(path: str) -> int:
    _small_npz(path)
    members = _members(path)
    name, data = members[0]
    other = bytearray(data)
    other[-1] ^= 0xFF
    rows = [(n, "stored", len(d), zlib.crc32(d), d) for n, d in members]
    rows.insert(1, (name, "stored", len(other), zlib.crc32(bytes(other)), bytes(other)))
    write_zip(path, rows)
    return sum(len(d) for _, d in members) + len(other)


def _hdf5_source(path: str, rows: int, row_bytes: int) -> None:
    from bridgeflow import DataFromList
    from bridgeflow.serialize import HDF5Serializer

    dps = [[np.zeros(row_bytes, np.uint8), i] for i in range(rows)]
    HDF5Serializer.save(DataFromList(dps, shuffle=False), path, data_paths=["img", "label"], progress=False,
                        overwrite=True)


def _replace_column(path: str, rows: int, row_bytes: int, make) -> None:
    """A bridgeflow file of ``rows`` zero rows whose ``img`` column is made by ``make(file)`` (written to a
    new file: HDF5 does not give back the space of a deleted dataset)."""
    import h5py

    from bridgeflow.serialize._hdf5_write import row_crc

    src = path + ".src"
    _hdf5_source(src, rows, 1)
    with h5py.File(src, "r") as a, h5py.File(path, "w", libver="latest") as b:
        for name in a:
            if name != "img":
                a.copy(a[name], b, name)
        for k, v in a.attrs.items():
            b.attrs[k] = v
        columns = json.loads(a.attrs["columns"])
        columns[0]["shape"] = [row_bytes]
        b.attrs["columns"] = np.bytes_(json.dumps(columns).encode())
        b["__bf_crc__/img"][...] = row_crc(np.zeros(row_bytes, np.uint8))  # the rows' CRC-32, valid
        make(b)
    os.unlink(src)


def hdf5_compressed(path: str, rows: int, row_bytes: int, chunk_rows: int, compression: str = "gzip") -> int:
    """See the module doc; returns the bytes the file declares (its datasets' shapes)."""
    opts: dict = {"compression": compression}
    if compression == "gzip":
        opts["compression_opts"] = 9

    def make(f):
        ds = f.create_dataset("img", shape=(rows, row_bytes), dtype=np.uint8, chunks=(chunk_rows, row_bytes),
                               maxshape=(None, row_bytes), **opts)
        step = max(1, (64 << 20) // row_bytes)
        for a in range(0, rows, step):
            ds[a:a + step] = np.zeros((min(step, rows - a), row_bytes), np.uint8)

    _replace_column(path, rows, row_bytes, make)
    return rows * row_bytes + rows * 16


def hdf5_stream_bomb(path: str, rows: int = 1024, row_bytes: int = 1024, inflates_to: int = 256 << 20) -> int:
    """A gzip column of small chunks whose first chunk's stream inflates to ``inflates_to`` bytes."""
    def make(f):
        ds = f.create_dataset("img", shape=(rows, row_bytes), dtype=np.uint8, chunks=(rows, row_bytes),
                              compression="gzip")
        c = zlib.compressobj(9)
        parts, left = [], inflates_to
        while left > 0:
            parts.append(c.compress(bytes(min(left, 16 << 20))))
            left -= 16 << 20
        parts.append(c.flush())
        ds.id.write_direct_chunk((0, 0), b"".join(parts), 0)

    _replace_column(path, rows, row_bytes, make)
    return rows * row_bytes + rows * 16


def hdf5_userblock(path: str, size: int = 512, zip_inside: bool = False, rows: int = 32) -> int:
    """A bridgeflow HDF5 file (arrays, numbers) behind a user block of ``size`` bytes."""
    import h5py

    src = path + ".src"
    from bridgeflow import DataFromList
    from bridgeflow.serialize import HDF5Serializer

    dps = [[np.full((4, 4), i, np.int32), i] for i in range(rows)]
    HDF5Serializer.save(DataFromList(dps, shuffle=False), src, progress=False, overwrite=True)
    with h5py.File(src, "r") as a, h5py.File(path, "w", libver="latest", userblock_size=size) as b:
        for name in a:
            a.copy(a[name], b, name)
        for k, v in a.attrs.items():
            b.attrs[k] = v
    os.unlink(src)
    if zip_inside:
        block = path + ".zip"
        write_zip(block, [("x.npy", "stored", 3, zlib.crc32(b"abc"), b"abc")])
        with open(block, "rb") as f:
            data = f.read()
        os.unlink(block)
        assert len(data) <= size
        with open(path, "r+b") as f:
            f.write(data)
    return rows * 4 * 4 * 4 + rows * 16


# --- random crafted files for the fuzz: (kind, path, declared bytes, the outcomes allowed) ---------------

READ, CORRUPT, UNSUPPORTED = "read", "error:CorruptDataError", "error:UnsupportedFormatError"
NPZ_BOMB_EXTRAS = (1 << 20, 16 << 20, 256 << 20)  # bytes an npz bomb's stream goes on for, past its declared size
HDF5_BOMB_SIZES = (4 << 20, 64 << 20, 512 << 20)  # bytes an HDF5 chunk bomb's gzip stream inflates to
HDF5_MOST_DECLARED = 64 << 20  # the most an HDF5 case's rows declare (its chunks may be larger)
_cache: dict = {}


def _bomb_stream(method: str, data: bytes, extra: int) -> bytes:
    key = (method, data, extra)
    if key not in _cache:
        def chunks():
            yield data
            left = extra
            while left > 0:
                yield bytes(min(left, 16 << 20))
                left -= 16 << 20
        _cache[key] = _compress(method, chunks())
    return _cache[key]


def npz_case(rng, path: str) -> tuple[str, int, tuple]:
    """One random npz: honest (any method, maybe behind a prefix), a bomb, a duplicated name, a stream
    shorter than declared, or a member declaring more than its method can give."""
    _small_npz(path, n=int(rng.integers(1, 40)))
    members = _members(path)
    declared = sum(len(d) for _, d in members)
    method = str(rng.choice(["stored", "deflate", "bzip2", "lzma"]))
    kind = str(rng.choice(["honest", "honest-prefix", "bomb", "duplicate", "short", "over-ratio"],
                          p=[0.25, 0.1, 0.35, 0.1, 0.1, 0.1]))
    rows = [(n, method, len(d), zlib.crc32(d), _compress(method, [d])) for n, d in members]
    prefix = b""
    if kind == "honest-prefix":
        prefix = bytes(rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8))
    elif kind == "bomb":
        k = int(rng.integers(len(rows)))
        bomb = str(rng.choice(["deflate", "bzip2", "lzma"]))
        extra = int(rng.choice(NPZ_BOMB_EXTRAS))
        n, _, size, crc, _ = rows[k]
        rows[k] = (n, bomb, size, crc, _bomb_stream(bomb, members[k][1], extra))
    elif kind == "duplicate":
        n, d = members[int(rng.integers(len(members)))]
        rows.append((n, "stored", len(d), zlib.crc32(d), d))
        declared += len(d)
    elif kind == "short":
        k = int(rng.integers(len(rows)))
        n, m, size, crc, _ = rows[k]
        cut = members[k][1][:-int(rng.integers(1, 64))]
        rows[k] = (n, m, size, crc, _compress(m, [cut]))
    elif kind == "over-ratio":
        k = int(rng.integers(len(rows)))
        n, m, size, crc, data = rows[k]
        rows[k] = (n, m, 0xFFFF_FFF0, crc, data)  # 4 GB declared
    write_zip(path, rows, prefix)
    return f"npz-{kind}-{method}", declared, ((READ,) if kind.startswith("honest") else (CORRUPT,))


def hdf5_case(rng, path: str) -> tuple[str, int, tuple]:
    """One random HDF5 file: a compressed column (gzip, lzf, szip) in chunks of 4 KiB to 32 MiB, a chunk
    whose stream decodes past its size, a filter nobody can bound, or a user block (maybe holding a zip)."""

    kind = str(rng.choice(["compressed", "stream-bomb", "lzf-bomb", "szip-bomb", "scaleoffset", "userblock"],
                          p=[0.35, 0.15, 0.1, 0.1, 0.05, 0.25]))
    if kind == "userblock":
        size = int(rng.choice([512, 1024, 4096]))
        declared = hdf5_userblock(path, size, zip_inside=bool(rng.integers(2)), rows=int(rng.integers(1, 64)))
        return f"hdf5-userblock-{size}", declared, (READ,)
    row_bytes = int(rng.choice([1 << 10, 1 << 14, 1 << 20]))
    chunk_bytes = int(rng.choice([1 << 12, 1 << 16, 1 << 20, 8 << 20, 16 << 20, 32 << 20]))
    chunk_rows = max(1, chunk_bytes // row_bytes)
    rows = int(rng.integers(1, 3 * chunk_rows + 2))
    rows = min(rows, max(1, HDF5_MOST_DECLARED // row_bytes))
    if kind == "compressed":
        comp = str(rng.choice(["gzip", "lzf", "szip"]))
        declared = hdf5_compressed(path, rows, row_bytes, chunk_rows, comp)
        big = chunk_rows * row_bytes > (16 << 20)
        return f"hdf5-{comp}-{chunk_rows * row_bytes >> 10}KiB", declared, ((UNSUPPORTED,) if big else (READ,))
    if kind == "stream-bomb":
        declared = hdf5_stream_bomb(path, rows=min(rows, chunk_rows), row_bytes=row_bytes,
                                    inflates_to=int(rng.choice(HDF5_BOMB_SIZES)))
        return "hdf5-gzip-stream-bomb", declared, (CORRUPT, UNSUPPORTED)
    if kind == "scaleoffset":
        def make(f):
            f.create_dataset("img", data=np.zeros((rows, row_bytes), np.uint8), chunks=(chunk_rows, row_bytes),
                             maxshape=(None, row_bytes), scaleoffset=0)
        _replace_column(path, rows, row_bytes, make)
        return "hdf5-scaleoffset", rows * row_bytes + rows * 16, (UNSUPPORTED,)
    n = min(rows, chunk_rows, max(1, (1 << 20) // row_bytes))
    comp = "lzf" if kind == "lzf-bomb" else "szip"

    def make(f):
        ds = f.create_dataset("img", shape=(n, row_bytes), dtype=np.uint8, chunks=(n, row_bytes), compression=comp)
        ds[...] = 0
        f.flush()  # (h5py reads a chunk still in the cache of the file being written as a MemoryError)
        mask, raw = ds.id.read_direct_chunk((0, 0))
        if comp == "lzf":  # a stream of zeros 64 times the chunk: lzf's own encoding, from a larger chunk
            big = f.create_dataset("big", shape=(64 * n, row_bytes), dtype=np.uint8, chunks=(64 * n, row_bytes),
                                   compression="lzf")
            big[...] = 0
            f.flush()
            raw = big.id.read_direct_chunk((0, 0))[1]
            del f["big"]
        else:  # szip's first four bytes: the size it decodes to, claimed to be 2 GB
            raw = (2 << 30).to_bytes(4, "little") + raw[4:]
        ds.id.write_direct_chunk((0, 0), raw, mask)

    _replace_column(path, n, row_bytes, make)
    return f"hdf5-{kind}", n * row_bytes + n * 16, (CORRUPT,)


def special_cases(folder: str) -> list[tuple[str, str, int, tuple]]:
    """Paths that are not dataset files: a FIFO, devices, a socket, a folder without ``data.mdb``."""
    import socket

    fifo, sock, empty = (os.path.join(folder, n) for n in ("fifo.h5", "sock.npz", "empty-folder"))
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    if not os.path.exists(sock):
        s = socket.socket(socket.AF_UNIX)
        s.bind(sock)
        _cache["socket"] = s  # kept open: its path stays a socket
    os.makedirs(empty, exist_ok=True)
    return [(f"special-{os.path.basename(p)}", p, 0, (CORRUPT,))
            for p in (fifo, sock, empty, "/dev/zero", "/dev/urandom", "/dev/null")]
