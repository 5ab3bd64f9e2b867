"""Check the structure of an LMDB file with plain reads before LMDB maps it.

LMDB trusts its pages: a damaged page header, node offset or value size makes it read past the end of
the file through its memory map, and the process dies of SIGBUS. This walks the main B-tree the way a
reader would (meta pages, branch and leaf pages; the extent of overflow-page runs, without reading them)
and checks every offset and size against the page and the file, so such damage becomes a
:class:`CorruptDataError` naming the path. It reads only the tree's pages, not large values.

Layout facts used (LMDB 0.9, 64-bit): a page starts with a 16-byte header (pgno u64, pad u16, flags u16,
lower u16, upper u16; overflow pages keep their page count in the lower/upper u32); the meta (pages 0
and 1, the one with the larger txnid wins) holds the page size in the free DB's ``md_pad``, the main DB
record and the last page number; nodes start with lo u16, hi u16, flags u16, ksize u16.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from .errors import CorruptDataError

__all__ = ["check_lmdb_file", "tree_pages"]

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


def tree_pages(data_file: str) -> int:
    """Branch + leaf pages of the main tree, from the meta page (the cost of a check, in pages)."""
    with open(data_file, "rb") as f:
        head = f.read(160)
    if len(head) < 160:
        return 0
    try:
        _psize, _txn, main, _last = _meta(head, data_file)
    except CorruptDataError:
        return 0
    return main[3] + main[4]


def check_lmdb_file(data_file: str, path: str | None = None) -> None:
    """Raise :class:`CorruptDataError` (naming ``path``) unless every page of the main tree is sound."""
    name = path or data_file
    size = os.path.getsize(data_file)
    with open(data_file, "rb") as f:
        head = f.read(160)
        if len(head) < 160:
            raise CorruptDataError(f"{name}: too short for an LMDB file ({size} bytes)")
        psize = _meta(head, name)[0]
        if psize < 512 or psize > 65536 or psize & (psize - 1):
            raise CorruptDataError(f"{name}: damaged meta page (page size {psize})")
        f.seek(psize)
        second = f.read(160)
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

        def page(pgno: int) -> bytes:
            if not 2 <= pgno <= last_pg:
                raise CorruptDataError(f"{name}: page number {pgno} outside the file (pages 2..{last_pg})")
            f.seek(pgno * psize)
            return f.read(psize)

        seen: set[int] = set()
        level = [root]
        found = 0
        for lvl in range(1, depth + 1):
            nxt: list[int] = []
            for pgno in level:
                if pgno in seen:
                    raise CorruptDataError(f"{name}: page {pgno} is reached twice (damaged tree)")
                seen.add(pgno)
                p = page(pgno)
                stored, _pad, flags, lower, upper = _HDR.unpack_from(p, 0)
                leaf = lvl == depth
                want = _P_LEAF if leaf else _P_BRANCH
                if stored != pgno or flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_LEAF2) != want:
                    raise CorruptDataError(f"{name}: page {pgno} has a damaged header")
                if not 16 <= lower <= upper <= psize or (lower - 16) % 2:
                    raise CorruptDataError(f"{name}: page {pgno} has damaged bounds")
                nkeys = (lower - 16) // 2
                if not leaf and nkeys < 1:
                    raise CorruptDataError(f"{name}: branch page {pgno} has no keys")
                # the nodes of one page, checked together (numpy: the walk costs ~nothing per entry)
                raw = np.frombuffer(p, np.uint8)
                offs = np.frombuffer(p, "<u2", nkeys, 16).astype(np.int64)
                if nkeys and (offs.min() < upper or offs.max() + 8 > psize):
                    raise CorruptDataError(f"{name}: page {pgno} has a node outside its page")
                lo, hi, nflags, ksize = raw[offs[:, None] + _EIGHT].view("<u2").T.astype(np.int64)
                kend = offs + 8 + ksize
                if nkeys and (kend.max() > psize or ksize.max() > 511):
                    raise CorruptDataError(f"{name}: page {pgno} has a key running outside its page")
                if not leaf:
                    nxt.extend((lo | hi << 16 | nflags << 32).tolist())
                    continue
                dsize = lo | hi << 16
                if (nflags & ~_F_BIGDATA).any():
                    raise CorruptDataError(f"{name}: page {pgno} has nodes with unexpected flags")
                big = (nflags & _F_BIGDATA) != 0
                if (kend[~big] + dsize[~big] > psize).any():
                    raise CorruptDataError(f"{name}: page {pgno} has a value running outside its page")
                if big.any():
                    kb = kend[big]
                    if kb.max() + 8 > psize:
                        raise CorruptDataError(f"{name}: page {pgno} has a damaged overflow link")
                    # LMDB reads dsize bytes after the first overflow page's header: that run of
                    # pages must lie inside the file (their headers are not read: cheap)
                    ov = raw[kb[:, None] + _EIGHT].view("<u8").ravel()
                    run = (dsize[big] + 16 + psize - 1) // psize
                    if (ov < 2).any() or (ov > last_pg).any() or (ov.astype(np.int64) + run - 1 > last_pg).any():
                        raise CorruptDataError(f"{name}: page {pgno} has a value whose overflow pages lie "
                                               "outside the file")
                found += nkeys
            level = nxt
        if level or found != entries:
            raise CorruptDataError(f"{name}: the tree holds {found} entries, its meta page says {entries}")
