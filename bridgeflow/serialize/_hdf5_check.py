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

:func:`contained_dataset` opens a dataset only once its path is known to stay inside the file and its
data to lie there: libhdf5 follows external links, soft links leading through them, raw data stored in
other files and virtual datasets wherever they point, so a crafted dataset file could make the reader
read any file the process can. Such datasets raise :class:`ExternalDataError` naming the file, the
dataset and what it points at, unless the caller vouches for the file (``allow_external=True``). It
also checks the dataset holds the bytes its shape declares (:func:`check_stored`): a chunked dataset
may declare 5e8 rows and store none, which libhdf5 reads back as gigabytes of fill values.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from .._serialize_errors import CorruptDataError, ExternalDataError
from ._common import hdf5_superblock_at, wrong_format
from ._pinned import PinnedFile

__all__ = ["check_global_heaps", "check_stored", "check_superblock", "contained_dataset", "is_variable_length"]

_GCOL = b"GCOL\x01"
_SCAN = 16 << 20
_checked: set[tuple] = set()  # files whose global heaps were found sound: (dev, inode, size, mtime)


def check_superblock(pin: PinnedFile, name: str, *, trust_old_format: bool = False) -> tuple[int, int]:
    """``(superblock version, size of lengths)``; :class:`CorruptDataError` for a file that is not HDF5, is
    shorter than its superblock says, or (unless ``trust_old_format``) is in the original format. The
    superblock is at byte 0 or after a user block (512, 1024, ... bytes, which other tools fill: even
    with a zip, so its signature, not the file's first bytes, says the format)."""
    size = pin.size()
    other = wrong_format(name, pin, "hdf5")
    if other is not None:
        raise other
    base = hdf5_superblock_at(pin)
    if base is None:
        raise CorruptDataError(f"{name}: not an HDF5 file (no superblock signature)")
    head = pin.pread(48, base)
    version = head[8] if len(head) > 8 else -1
    if version in (2, 3):
        if len(head) < 48:
            raise CorruptDataError(f"{name}: truncated HDF5 file ({size} bytes, its superblock at byte {base} is cut)")
        offsets, lengths = head[9], head[10]
        if offsets != 8 or lengths != 8:
            raise CorruptDataError(f"{name}: damaged HDF5 superblock ({offsets}-byte addresses)")
        _base, _ext, eof, _root = struct.unpack_from("<QQQQ", head, 12)
        if eof > size:  # libhdf5 keeps the end of a file with a user block as its length, user block included
            raise CorruptDataError(f"{name}: truncated HDF5 file ({size} bytes, its superblock says {eof})")
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


def is_variable_length(type_id: Any) -> bool:
    """Whether an h5py ``TypeID`` (untyped: h5py ships no types) holds variable-length data (read from a
    global heap)."""
    from h5py import h5t

    cls = type_id.get_class()
    if cls == h5t.VLEN:
        return True
    if cls == h5t.STRING:
        return bool(type_id.is_variable_str())
    if cls in (h5t.COMPOUND,):
        return any(is_variable_length(type_id.get_member_type(i)) for i in range(type_id.get_nmembers()))
    if cls == h5t.ARRAY:
        return is_variable_length(type_id.get_super())
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


_MAX_HOPS = 16  # soft links followed in one path: libhdf5's own default limit
_SMALL = 1 << 20  # a dataset declaring no more than this is read whatever it stores
_LOSSLESS_RATIO = 1032  # the most deflate expands: the bound for datasets with a compression filter
_NOT_COMPRESSING = (2, 3)  # shuffle, fletcher32: stored bytes >= declared bytes


def _outside(path: str, name: str, what: str) -> ExternalDataError:
    return ExternalDataError(f"{path}: dataset {name!r} {what}; a dataset file must not make the reader read "
                             "other files, so it is not read. If you trust the file and the files it points at, "
                             "pass allow_external=True (bridgeflow serialize/inspect: --allow-external)")


def contained_dataset(f: Any, name: str, path: str, *, allow_external: bool = False) -> Any:
    """The object at ``name`` in the open ``h5py.File`` ``f`` (a dataset or group), or ``None`` when there
    is none; unless ``allow_external``, :class:`ExternalDataError` for a path through an external (or
    user-defined) link, a soft link out of the file, or a dataset whose data lies in other files (external
    storage, a virtual dataset). Links are read, never followed, until they are known to stay inside."""
    if allow_external:
        return f[name] if name in f else None
    from h5py import h5l

    todo = [c for c in name.split("/") if c and c != "."]
    at: list[str] = []  # the hard path walked so far
    group = f["/"]
    hops = 0
    while todo:
        comp = todo.pop(0)
        key = comp.encode("utf-8")
        if not group.id.links.exists(key):
            return None
        kind = group.id.links.get_info(key).type
        if kind == h5l.TYPE_SOFT:
            hops += 1
            if hops > _MAX_HOPS:
                raise CorruptDataError(f"{path}: dataset {name!r}: more than {_MAX_HOPS} soft links in its path")
            target = group.id.links.get_val(key).decode("utf-8", "replace")
            rest = [c for c in target.split("/") if c and c != "."]
            todo = (rest if target.startswith("/") else at + rest) + todo
            at, group = [], f["/"]
            continue
        if kind == h5l.TYPE_EXTERNAL:
            other, inside = (v.decode("utf-8", "replace") for v in group.id.links.get_val(key))
            where = "/".join(at + [comp])
            raise _outside(path, name, f"is reached through an external link /{where} -> {other}:{inside}")
        if kind != h5l.TYPE_HARD:
            where = "/".join(at + [comp])
            raise _outside(path, name, f"is reached through a user-defined link /{where} (type {kind}), which "
                                       "libhdf5 resolves by code outside the file")
        obj = group[comp]
        at.append(comp)
        if todo and not hasattr(obj.id, "links"):
            return None  # a dataset where a group belongs: nothing at ``name``
        group = obj
    if hasattr(group, "shape"):
        _check_layout(group, name, path)
    return group


def _check_layout(ds: Any, name: str, path: str) -> None:
    from h5py import h5d

    plist = ds.id.get_create_plist()
    if plist.get_layout() == h5d.VIRTUAL:
        n = plist.get_virtual_count()
        sources = ", ".join(f"{plist.get_virtual_filename(i)}:{plist.get_virtual_dsetname(i)}"
                            for i in range(min(n, 3)))
        raise _outside(path, name, f"is a virtual dataset, read from {n} source(s): {sources}"
                                   + (", ..." if n > 3 else ""))
    n = plist.get_external_count()
    if n:
        files = ", ".join(plist.get_external(i)[0].decode("utf-8", "replace") for i in range(min(n, 3)))
        raise _outside(path, name, f"stores its data in {n} other file(s): {files}" + (", ..." if n > 3 else ""))


def check_stored(ds: Any, name: str, path: str) -> None:
    """:class:`CorruptDataError` when dataset ``ds`` declares (by its shape) more bytes than the file holds
    for it: more than it stores, or, with a compression filter, more than deflate could expand that to.
    Reads then cost memory in proportion to the file, never to a count it claims."""
    declared = math.prod(ds.shape) * ds.dtype.itemsize
    if declared <= _SMALL:
        return
    from h5py import h5d

    plist = ds.id.get_create_plist()
    if plist.get_layout() == h5d.VIRTUAL or plist.get_external_count():
        return  # allowed by the caller: its data lies elsewhere
    stored = int(ds.id.get_storage_size())
    compressed = any(plist.get_filter(i)[0] not in _NOT_COMPRESSING for i in range(plist.get_nfilters()))
    if declared > stored * (_LOSSLESS_RATIO if compressed else 1):
        raise CorruptDataError(f"{path}: dataset {name!r} declares shape {ds.shape} ({declared} bytes) but holds "
                               f"{stored} bytes in the file{' (compressed)' if compressed else ''}: damaged or "
                               "crafted, not read")
