"""Small LMDB values checked and decoded a batch at a time, as *rows*: values of one size laid end to end.

At a few hundred bytes a value, what a read costs is the Python around it: a call to check each CRC, one
to decode each value, one ``pread`` to watch for a writer. A batch of ``k`` values of ``s`` bytes each
(the encoding and its 4-byte CRC-32, as :mod:`bridgeflow.serialize.lmdb_format` stores them), gathered into
one buffer, is instead checked by one CRC-32 call over the whole buffer and decoded by
:func:`~bridgeflow.serialize.codec.decode_many`.

Why one CRC over the rows checks every row: a value followed by its own CRC-32 (little-endian) has the same
CRC-32, whatever the value (the CRC's residue), and the CRC-32 of two buffers end to end depends only on
the CRC-32 of each and the second's length (zlib's ``crc32_combine``). So ``k`` sound rows of ``s`` bytes
always have one CRC-32, that of ``k`` copies of any sound row (:func:`rows_crc`). Damage to one row changes
that row's CRC, and ``crc32_combine`` carries any change of one part's CRC into a change of the whole's:
whatever a per-value check catches in one value, the batch check catches; damage to several values that
cancels out exactly is a 2**-32 chance, as for one CRC over the whole. When the check fails, each row is
checked alone, which names the damaged datapoint.

Example:
    >>> from bridgeflow.serialize._checksum import crc32
    >>> body = b"some encoded value"
    >>> row = body + crc32()(body).to_bytes(4, "little")
    >>> crc32()(row * 3) == rows_crc(3, len(row))
    True
"""

from __future__ import annotations

import os
import threading

from ._checksum import crc32
from ._lmdb_file import new_bytearray

__all__ = ["ROWS", "gather_rows", "read_rows", "rows_crc"]

ROWS = 256  # values a batch: 256 values of 300 bytes is 77 KB, held while the batch is handed out

_crcs: dict[tuple[int, int], int] = {}
_crcs_lock = threading.Lock()


def rows_crc(k: int, s: int) -> int:
    """The CRC-32 of ``k`` sound rows of ``s`` bytes each, end to end (see the module doc); ``s >= 4``."""
    key = (k, s)
    found = _crcs.get(key)
    if found is not None:
        return found
    crc = crc32()
    body = bytes(s - 4)
    row = body + crc(body).to_bytes(4, "little")
    value = crc(row * k)
    with _crcs_lock:
        if len(_crcs) >= 256:
            _crcs.clear()
        _crcs[key] = value
    return value


def read_rows(fd: int, offsets: list[int], s: int) -> tuple[bytearray, int]:
    """The ``s``-byte values at ``offsets`` of the file ``fd``, read one ``preadv`` each into one buffer;
    and how many were read whole (``len(offsets)`` unless the file was cut under the reader)."""
    buf = new_bytearray(len(offsets) * s)
    mv = memoryview(buf)
    preadv = os.preadv
    at = 0
    for a, off in enumerate(offsets):
        if preadv(fd, [mv[at:at + s]], off) != s:
            return buf, a
        at += s
    return buf, len(offsets)


def gather_rows(block: memoryview, starts: list[int], s: int) -> bytearray:
    """The ``s``-byte values lying at ``starts`` in ``block`` (a run of leaf pages read at once), end to end."""
    return bytearray().join([block[a:a + s] for a in starts])
