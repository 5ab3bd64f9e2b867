"""Check the structure of an LMDB file with plain reads before LMDB maps it.

LMDB trusts its pages: a damaged page header, node offset or value size makes it read past the end of
the file through its memory map, and the process dies of SIGBUS. This walks the main B-tree the way a
reader would (meta pages, branch and leaf pages; the extent of overflow-page runs, without reading them)
and checks every offset and size against the page and the file, so such damage becomes a
:class:`CorruptDataError` naming the path. It reads only the tree's pages, not large values, and never
more pages than the file really holds: a count the file claims cannot make it skip or stretch the walk.

Layout facts used (LMDB 0.9, 64-bit): a page starts with a 16-byte header (pgno u64, pad u16, flags u16,
lower u16, upper u16; overflow pages keep their page count in the lower/upper u32); the meta (pages 0
and 1, the one with the larger txnid wins) holds the page size in the free DB's ``md_pad``, the main DB
record and the last page number; nodes start with lo u16, hi u16, flags u16, ksize u16.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from ._pinned import PinnedFile
from .errors import CorruptDataError

__all__ = ["check_lmdb_file"]

_MAGIC = 0xBEEFC0DE
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA = 0x01
_HDR = struct.Struct("<QHHHH")
_EIGHT = np.arange(8)
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize (at byte 16)
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_TAIL = struct.Struct("<QQ")  # last_pg, txnid
_INVALID = 0xFFFFFFFFFFFFFFFF


def _meta(head: bytes, path: str) -> tuple[int, int, tuple, int]:
    """(psize, txnid, main db record, last_pg) of one meta page."""
    magic, version, _addr, _mapsize = _META.unpack_from(head, 16)
    if magic != _MAGIC or version != 1:
        raise CorruptDataError(f"{path}: not an LMDB file, or its meta page is damaged")
    psize = _DB.unpack_from(head, 40)[0]
    main = _DB.unpack_from(head, 88)
    last_pg, txnid = _TAIL.unpack_from(head, 136)
    return psize, txnid, main, last_pg


_checked: set[tuple] = set()  # files found sound, by identity: (dev, inode, size, mtime)
_CHUNK_PAGES = 4096  # pages of one tree level read and checked at a time (16 MiB of 4 KiB pages)


def check_lmdb_file(pin: PinnedFile, name: str) -> None:
    """Raise :class:`CorruptDataError` (naming ``name``) unless every page of the main tree is sound.

    ``pin`` is the open file LMDB will map: its real size (``fstat``), never a count the file claims,
    bounds the walk, which reads each tree page at most once. A file already found sound in this
    process, unchanged since (same inode, size and mtime), is not walked again.
    """
    st = pin.stat()
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in _checked:
        return
    _walk(pin, name, st.st_size)
    if len(_checked) > 4096:
        _checked.clear()
    _checked.add(identity)


def _walk(pin: PinnedFile, name: str, size: int) -> None:
    head = pin.pread(160, 0)
    if len(head) < 160:
        raise CorruptDataError(f"{name}: too short for an LMDB file ({size} bytes)")
    psize = _meta(head, name)[0]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise CorruptDataError(f"{name}: damaged meta page (page size {psize})")
    second = pin.pread(160, psize)
    metas = [_meta(head, name)] + ([_meta(second, name)] if len(second) == 160 else [])
    _psize, _txnid, main, last_pg = max(metas, key=lambda m: m[1])
    _pad, _flags, depth, _branch, _leaf, _overflow, entries, root = main
    npages = size // psize
    if last_pg >= npages or last_pg < 1:
        raise CorruptDataError(f"{name}: truncated or damaged LMDB file (last page {last_pg}, "
                               f"the file holds {npages} pages)")
    if root == _INVALID:
        if entries:
            raise CorruptDataError(f"{name}: damaged meta page (no root but {entries} entries)")
        return

    def pages(pgnos: list[int]) -> np.ndarray:
        out = np.empty(len(pgnos) * psize, np.uint8)
        for k, pgno in enumerate(pgnos):
            if not 2 <= pgno <= last_pg:
                raise CorruptDataError(f"{name}: page number {pgno} outside the file (pages 2..{last_pg})")
            got = os.preadv(pin.ensure(), [memoryview(out)[k * psize:(k + 1) * psize]], pgno * psize)
            if got != psize:
                raise CorruptDataError(f"{name}: page {pgno} lies past the end of the file")
        return out

    seen: set[int] = set()
    level = [root]
    found = 0
    for lvl in range(1, depth + 1):  # each page is read once: the walk ends within the file's pages
        if len(set(level)) != len(level) or seen.intersection(level):
            raise CorruptDataError(f"{name}: a page is reached twice (damaged tree)")
        seen.update(level)
        children: list[int] = []
        for at in range(0, len(level), _CHUNK_PAGES):
            chunk = level[at:at + _CHUNK_PAGES]
            kids, n = _check_level(pages(chunk), np.array(chunk, np.int64), psize, lvl == depth, last_pg,
                                   name)
            children += kids
            found += n
        level = children
    if level or found != entries:
        raise CorruptDataError(f"{name}: the tree holds {found} entries, its meta page says {entries}")


def _check_level(raw: np.ndarray, pgnos: np.ndarray, psize: int, leaf: bool, last_pg: int,
                 name: str) -> tuple[list[int], int]:
    """Check all pages of one tree level at once; returns (child page numbers, entries on leaf pages)."""
    pages = raw.reshape(len(pgnos), psize)
    stored = pages[:, :8].copy().view("<u8").ravel()
    _pad, flags, lower, upper = pages[:, 8:16].copy().view("<u2").T.astype(np.int64)
    want = _P_LEAF if leaf else _P_BRANCH
    bad = (stored != pgnos) | ((flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_LEAF2)) != want)
    bad |= (lower < 16) | (lower > upper) | (upper > psize) | ((lower - 16) % 2 != 0)
    nkeys = np.maximum(lower - 16, 0) // 2
    if not leaf:
        bad |= nkeys < 1
    if bad.any():
        raise CorruptDataError(f"{name}: page {int(pgnos[np.argmax(bad)])} has a damaged header")
    # every node of the level: its page row, and its pointer's position in that page
    row = np.repeat(np.arange(len(pgnos)), nkeys)
    base = row * psize  # flat indexes into ``raw`` are cheaper than 2-d fancy indexing
    first = np.repeat(np.cumsum(nkeys) - nkeys, nkeys)
    pos = base + 16 + 2 * (np.arange(len(row)) - first)
    offs = raw[pos].astype(np.int64) | raw[pos + 1].astype(np.int64) << 8

    def fail(mask: np.ndarray, what: str) -> None:
        if mask.any():
            raise CorruptDataError(f"{name}: page {int(pgnos[row[np.argmax(mask)]])} has {what}")

    fail((offs < upper[row]) | (offs + 8 > psize), "a node outside its page")
    lo, hi, nflags, ksize = raw[(base + offs)[:, None] + _EIGHT].view("<u2").T.astype(np.int64)
    kend = offs + 8 + ksize
    fail((kend > psize) | (ksize > 511), "a key running outside its page")
    if not leaf:
        return (lo | hi << 16 | nflags << 32).tolist(), 0
    dsize = lo | hi << 16
    fail((nflags & ~_F_BIGDATA) != 0, "nodes with unexpected flags")
    big = (nflags & _F_BIGDATA) != 0
    fail(~big & (kend + dsize > psize), "a value running outside its page")
    fail(big & (kend + 8 > psize), "a damaged overflow link")
    if big.any():
        # LMDB reads dsize bytes after the first overflow page's header: that run of pages must lie
        # inside the file (their headers are not read: cheap)
        rb, kb = row[big], kend[big]
        ov = raw[(base[big] + kb)[:, None] + _EIGHT].view("<u8").ravel()
        run = (dsize[big] + 16 + psize - 1) // psize
        outside = (ov < 2) | (ov > last_pg)
        outside |= np.where(outside, 0, ov).astype(np.int64) + run - 1 > last_pg
        if outside.any():
            raise CorruptDataError(f"{name}: page {int(pgnos[rb[np.argmax(outside)]])} has a value whose "
                                   "overflow pages lie outside the file")
    return [], len(row)
