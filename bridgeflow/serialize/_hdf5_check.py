"""Checks made before libhdf5 reads an HDF5 file, so that damage ends in an error, never a hang.

libhdf5 verifies a checksum on every metadata block of files in its newer format (superblock version 2
or 3: object headers, B-trees, fractal heaps, chunk indexes), but two things it parses without one:

- the metadata of files in the original format (superblock version 0 or 1, h5py's default
  ``libver="earliest"``): symbol tables, local heaps, version 1 B-trees and object headers;
- *global heap collections*, where variable-length data lives (vlen strings, ragged arrays, vlen
  attributes), in every format. A zeroed page in one makes libhdf5 1.14 loop forever while parsing it.

So :func:`check_superblock` refuses the original format (unless the caller trusts the file) and checks
the file is as long as its superblock says, and :func:`check_global_heaps` walks every global heap
collection in the file (found by their signature, in one pass over the file) the way libhdf5 will, before
anything variable-length is read. Both read through the reader's pinned descriptor and are bounded by
the file's real size. bridgeflow's own files (format version 2) hold no variable-length data at all.
"""

from __future__ import annotations

import struct

from ._common import wrong_format
from ._pinned import PinnedFile
from .errors import CorruptDataError

__all__ = ["check_global_heaps", "check_superblock", "is_variable_length"]

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_GCOL = b"GCOL\x01"
_SCAN = 16 << 20
_checked: set[tuple] = set()  # files whose global heaps were found sound: (dev, inode, size, mtime)


def check_superblock(pin: PinnedFile, name: str, *, trust_old_format: bool = False) -> tuple[int, int]:
    """``(superblock version, size of lengths)``; :class:`CorruptDataError` for a file that is not HDF5, is
    shorter than its superblock says, or (unless ``trust_old_format``) is in the original format."""
    size = pin.size()
    other = wrong_format(name, pin.pread(32, 0), "hdf5")
    if other is not None:
        raise other
    base = 0
    while True:  # the superblock is at 0, 512, 1024, 2048, ... (after a user block)
        head = pin.pread(48, base)
        if head[:8] == _SIGNATURE:
            break
        base = 512 if base == 0 else base * 2
        if base + 48 > size:
            raise CorruptDataError(f"{name}: not an HDF5 file (no superblock signature)")
    version = head[8]
    if version in (2, 3):
        offsets, lengths = head[9], head[10]
        if offsets != 8 or lengths != 8:
            raise CorruptDataError(f"{name}: damaged HDF5 superblock ({offsets}-byte addresses)")
        _base, _ext, eof, _root = struct.unpack_from("<QQQQ", head, 12)
        if base + eof > size:
            raise CorruptDataError(f"{name}: truncated HDF5 file ({size} bytes, its superblock says "
                                   f"{base + eof})")
        return version, lengths
    if version in (0, 1):
        if not trust_old_format:
            raise CorruptDataError(
                f"{name}: written in HDF5's original file format (superblock version {version}), whose "
                "metadata carries no checksums: a damaged block could make libhdf5 loop forever, so it is "
                "not opened. If you trust the file, pass verify=False; or re-save it with "
                "h5py.File(..., libver='latest')")
        return version, head[14] if len(head) > 14 else 8
    raise CorruptDataError(f"{name}: damaged HDF5 superblock (version {version})")


def is_variable_length(type_id: object) -> bool:
    """Whether an h5py ``TypeID`` holds variable-length data (read from a global heap)."""
    from h5py import h5t

    cls = type_id.get_class()  # type: ignore[attr-defined]
    if cls == h5t.VLEN:
        return True
    if cls == h5t.STRING:
        return bool(type_id.is_variable_str())  # type: ignore[attr-defined]
    if cls in (h5t.COMPOUND,):
        return any(is_variable_length(type_id.get_member_type(i))  # type: ignore[attr-defined]
                   for i in range(type_id.get_nmembers()))  # type: ignore[attr-defined]
    if cls == h5t.ARRAY:
        return is_variable_length(type_id.get_super())  # type: ignore[attr-defined]
    return False


def check_global_heaps(pin: PinnedFile, name: str) -> None:
    """Walk every global heap collection of the file as libhdf5 parses them; damage that would make it
    loop (an object of size 0, one running past its collection) raises :class:`CorruptDataError`. One
    pass over the file, done once per file and process."""
    st = pin.stat()
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in _checked:
        return
    size = st.st_size
    skip_to = 0
    at = 0
    tail = b""
    while at < size:
        block = tail + pin.pread(_SCAN, at)
        start = at - len(tail)
        if len(block) == len(tail):
            break
        pos = block.find(_GCOL)
        while pos >= 0:
            where = start + pos
            if where >= skip_to:
                skip_to = where + _collection(pin, where, size, name)
            pos = block.find(_GCOL, pos + 1)
        at += len(block) - len(tail)
        tail = block[-(len(_GCOL) - 1):]
    if len(_checked) > 4096:
        _checked.clear()
    _checked.add(identity)


def _collection(pin: PinnedFile, where: int, size: int, name: str) -> int:
    """Check the collection at ``where``; returns its size."""
    head = pin.pread(16, where)
    if len(head) < 16:
        raise CorruptDataError(f"{name}: a global heap collection at byte {where} runs past the end of the file")
    csize = struct.unpack_from("<Q", head, 8)[0]
    if csize < 16 + 16 or where + csize > size:
        raise CorruptDataError(f"{name}: damaged global heap collection at byte {where} (size {csize}, the file "
                               f"holds {size} bytes)")
    data = pin.pread(csize, where)
    p, end = 16, csize
    while p < end:
        if p + 16 > end:  # too small for an object header: libhdf5 takes it as free space
            break
        idx, _nrefs, _reserved, osize = struct.unpack_from("<HHIQ", data, p)
        need = 16 + ((osize + 7) & ~7) if idx else osize
        if need < 16 or p + need > end:
            raise CorruptDataError(f"{name}: damaged global heap collection at byte {where} (object {idx} of "
                                   f"{osize} bytes at offset {p})")
        p += need
    return csize
