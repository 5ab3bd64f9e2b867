"""Walk an LMDB file's B-tree with plain reads: every page checked, and where every entry's value lies.

LMDB reads its file through a memory map and trusts its pages: a damaged page header, node offset or
value size, or a file cut short while mapped, makes it touch memory past the end of the file, and the
process dies of SIGBUS. bridgeflow's readers therefore never map the file. :func:`walk_lmdb` walks the
main B-tree once, the way LMDB would (meta pages, branch and leaf pages; the extent of overflow-page
runs, without reading them), with positioned reads bounded by the file's real size, checks every offset
and size against its page and the file, and returns every entry's key and the byte range of its value
(an :class:`LMDBTree`). A reader then reads a value with one ``pread`` at its offset: a file cut short
meanwhile gives a short read, which the reader turns into a :class:`CorruptDataError` naming the file.

The walk reads each tree page at most once and never more pages than the file really holds, so a count
the file claims cannot make it skip or stretch the walk. Large values (overflow pages) are not read;
small ones live in the leaf pages, which are read.

A file being written meanwhile (another process committing LMDB transactions) is never read as a mix.
LMDB writes a new version beside the old (copy on write) and reuses the pages of an old version only
once two later transactions have committed and no reader slot in its lock file still holds it; bridgeflow
holds no slot (it would have to map the file, and py-lmdb allows one environment per file and process),
so it watches the meta page the next commit writes (``LMDBTree.watch_at``): while its bytes are those
read with the tree, no page of that version was reused, and whatever was read before the watch was
looked at is that version's. The walk looks once at its end and walks again if a commit came meanwhile;
the readers look after each value read (one 8-byte ``pread``), and raise :class:`DatasetChangedError`
saying the file is being written, never returning what a writer put in a page since.

Layout facts used (LMDB 0.9, 64-bit): a page starts with a 16-byte header (pgno u64, pad u16, flags u16,
lower u16, upper u16; overflow pages keep their page count in the lower/upper u32); the meta (pages 0
and 1, the one with the larger txnid wins) holds the page size in the free DB's ``md_pad``, the main DB
record and the last page number; nodes start with lo u16, hi u16, flags u16, ksize u16, then the key,
then the value (or, with ``F_BIGDATA``, the u64 number of the first overflow page, whose data starts
after its 16-byte header).

Example:
    >>> tree = walk_lmdb(PinnedFile("train.lmdb"), "train.lmdb")   # doctest: +SKIP
    >>> tree.key(0), tree.offsets[0], tree.sizes[0]                  # doctest: +SKIP
"""

from __future__ import annotations

import os
import struct

import numpy as np

from .._serialize_errors import CorruptDataError, DatasetChangedError
from ._common import wrong_format
from ._pinned import PinnedFile

__all__ = ["LMDBTree", "cut_error", "walk_lmdb", "written_error"]

_MAGIC = 0xBEEFC0DE
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_PAGE_HEADER = 16
_EIGHT = np.arange(8)
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize (at byte 16)
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_TAIL = struct.Struct("<QQ")  # last_pg, txnid
_INVALID = 0xFFFFFFFFFFFFFFFF
_TXNID_AT = 144  # a meta page's transaction id
_WALKS = 3  # walks tried while a writer commits, before the file is said to be being written
_CHUNK_PAGES = 4096  # pages of one tree level read at a time (16 MiB of 4 KiB pages)
_CHUNK_NODES = 1 << 16  # nodes checked at a time (about 200 bytes of arrays each)
_NODE_HEADER = 8


class LMDBTree:
    """The entries of an LMDB file's main database, in key order: ``keys`` (all keys end to end, entry
    ``j``'s ending at ``key_ends[j]``), ``offsets`` and ``sizes`` (where its value lies in the file; every
    range checked to lie inside it); ``txnid``, the transaction that wrote this version of the file; and
    the watch (see the module doc): while the 8 bytes at ``watch_at`` are ``watch``, no transaction was
    committed since (:meth:`unchanged`)."""

    __slots__ = ("file_size", "key_ends", "keys", "offsets", "sizes", "txnid", "watch", "watch_at")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray, key_ends: np.ndarray,
                 file_size: int, txnid: int = 0, watch_at: int = _TXNID_AT, watch: bytes = b"") -> None:
        self.offsets, self.sizes, self.keys, self.key_ends = offsets, sizes, keys, key_ends
        self.file_size, self.txnid, self.watch_at, self.watch = file_size, txnid, watch_at, watch

    def unchanged(self, fd: int) -> bool:
        """Whether no transaction was committed to the file since its tree was read (what was read
        before this call is that version's)."""
        return os.pread(fd, 8, self.watch_at) == self.watch

    def __len__(self) -> int:
        return len(self.offsets)

    def key(self, j: int) -> bytes:
        start = int(self.key_ends[j - 1]) if j else 0
        return self.keys[start:int(self.key_ends[j])].tobytes()

    def key_lengths(self) -> np.ndarray:
        return np.diff(self.key_ends, prepend=0)

    def bisect(self, key: bytes) -> int:
        """The first entry whose key is not less than ``key`` (LMDB's order: bytes compared as such)."""
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.key(mid) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, key: bytes) -> int | None:
        """The entry of ``key``, or ``None``."""
        j = self.bisect(key)
        return j if j < len(self) and self.key(j) == key else None

    def read(self, pin: PinnedFile, j: int, name: str) -> bytes:
        """The value of entry ``j``, read from ``pin``."""
        off, n = int(self.offsets[j]), int(self.sizes[j])
        value = pin.pread(n, off)
        if not self.unchanged(pin.ensure()):
            raise written_error(pin, name, self.txnid)
        if len(value) != n:
            raise cut_error(pin, name, off, n, f"the value of key {self.key(j)!r}")
        return value


def cut_error(pin: PinnedFile, name: str, offset: int, size: int, what: str) -> CorruptDataError:
    """The error for a read of ``size`` bytes at ``offset`` that came back short: the file was cut short
    since its tree was walked (every value lay inside it then)."""
    try:
        have = pin.size()
    except OSError:
        have = -1
    return CorruptDataError(f"{name}: the file was cut to {have} bytes while open ({what} lies at bytes "
                            f"{offset}..{offset + size}); it is no longer readable")


def written_error(pin: PinnedFile, name: str, txnid: int) -> DatasetChangedError | CorruptDataError:
    """The error for a file to which a writer committed since its tree was read (at ``txnid``), or for one cut
    short meanwhile: the meta pages the readers watch then read back short, and no writer is to blame."""
    try:
        psize = _psize(pin)
        if psize == 0 or pin.size() < 2 * psize:
            return cut_error(pin, name, 0, 2 * (psize or 4096), "its meta pages")
    except (OSError, struct.error, CorruptDataError):
        pass
    try:
        now = max(struct.unpack("<Q", pin.pread(8, at))[0] for at in (_TXNID_AT, _psize(pin) + _TXNID_AT))
    except (OSError, struct.error):
        now = None
    return DatasetChangedError(
        f"{name} is being written: another process committed LMDB transaction {now or 'a later one'} since this "
        f"reader read transaction {txnid}, and may have reused the pages it reads. A reader reads a file as it was "
        "when opened, and never returns what a writer put there since: open the file again to read it as it is "
        "now, or read it once the writer is done")


def _meta(head: bytes, path: str) -> tuple[int, int, tuple, int]:
    """(psize, txnid, main db record, last_pg) of one meta page."""
    magic, version, _addr, _mapsize = _META.unpack_from(head, 16)
    if magic != _MAGIC or version != 1:
        raise CorruptDataError(f"{path}: not an LMDB file, or its meta page is damaged")
    psize = _DB.unpack_from(head, 40)[0]
    main = _DB.unpack_from(head, 88)
    last_pg, txnid = _TAIL.unpack_from(head, 136)
    return psize, txnid, main, last_pg


def walk_lmdb(pin: PinnedFile, name: str) -> LMDBTree:
    """Every entry of the file's main database, its pages checked; :class:`CorruptDataError` naming
    ``name`` for anything that is not a sound LMDB file, :class:`DatasetChangedError` for one that a
    writer kept changing while it was walked.

    ``pin`` is the open file to read: its real size (``fstat``), never a count the file claims, bounds
    the walk, which reads each tree page at most once. Memory stays in proportion to the file: the count
    of entries the meta page claims is checked against the pages first, every page's nodes must fit in
    its free space (nodes sharing bytes would multiply them), and pages are checked a few at a time.
    """
    txnid = 0
    for _ in range(_WALKS):
        before = pin.pread(8, _TXNID_AT), pin.pread(8, _psize(pin) + _TXNID_AT)
        try:
            tree = _walk(pin, name)
        except MemoryError as exc:  # a sound but large file, under a memory limit: say which
            raise MemoryError(f"{name}: not enough memory to index the entries of this {pin.size()}-byte LMDB "
                              "file (about 20 bytes and its key's length an entry)") from exc
        except CorruptDataError:
            if (pin.pread(8, _TXNID_AT), pin.pread(8, _psize(pin) + _TXNID_AT)) == before:
                raise  # damage, not a writer's commit meanwhile
            continue
        if tree.unchanged(pin.ensure()):  # no commit meanwhile: every page read was of one version
            return tree
        txnid = tree.txnid
    raise written_error(pin, name, txnid)


def _psize(pin: PinnedFile) -> int:
    """The page size the first meta page claims (where the second lies), or 0."""
    head = pin.pread(44, 0)
    return struct.unpack_from("<I", head, 40)[0] if len(head) == 44 else 0


def _walk(pin: PinnedFile, name: str) -> LMDBTree:
    size = pin.size()
    head = pin.pread(160, 0)
    other = None if head[16:20] == _MAGIC.to_bytes(4, "little") else wrong_format(name, pin, "lmdb")
    if other is not None:
        raise other
    if len(head) < 160:
        raise CorruptDataError(f"{name}: too short for an LMDB file ({size} bytes)")
    psize = _meta(head, name)[0]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise CorruptDataError(f"{name}: damaged meta page (page size {psize})")
    second = pin.pread(160, psize)
    metas = [_meta(head, name)] + ([_meta(second, name)] if len(second) == 160 else [])
    _psize, txnid, main, last_pg = max(metas, key=lambda m: m[1])
    watch_at = ((txnid + 1) & 1) * psize + _TXNID_AT  # the meta page the next commit writes
    watch = (head, second)[(txnid + 1) & 1][_TXNID_AT:_TXNID_AT + 8]
    _pad, _flags, depth, _branch, _leaf, _overflow, entries, root = main
    npages = size // psize
    if last_pg >= npages or last_pg < 1:
        raise CorruptDataError(f"{name}: truncated or damaged LMDB file (last page {last_pg}, "
                               f"the file holds {npages} pages)")
    if entries > (last_pg - 1) * _most_nodes(psize):  # before anything is allocated for them
        raise CorruptDataError(f"{name}: damaged meta page ({entries} entries, more than its {last_pg - 1} "
                               "pages can hold)")
    out = _Entries(entries, name)
    if root == _INVALID:
        if entries:
            raise CorruptDataError(f"{name}: damaged meta page (no root but {entries} entries)")
        return out.tree(size, txnid, watch_at, watch)

    def pages(pgnos: list[int]) -> np.ndarray:
        out = np.empty(len(pgnos) * psize, np.uint8)
        for k, pgno in enumerate(pgnos):
            if not 2 <= pgno <= last_pg:
                raise CorruptDataError(f"{name}: page number {pgno} outside the file (pages 2..{last_pg})")
            got = os.preadv(pin.ensure(), [out.data[k * psize:(k + 1) * psize]], pgno * psize)
            if got != psize:
                raise CorruptDataError(f"{name}: page {pgno} lies past the end of the file")
        return out

    seen: set[int] = set()
    level = [root]
    for lvl in range(1, depth + 1):  # each page is read once: the walk ends within the file's pages
        if len(set(level)) != len(level) or seen.intersection(level):
            raise CorruptDataError(f"{name}: a page is reached twice (damaged tree)")
        seen.update(level)
        children: list[int] = []
        for at in range(0, len(level), _CHUNK_PAGES):
            chunk = level[at:at + _CHUNK_PAGES]
            children += _check_level(pages(chunk), np.array(chunk, np.int64), psize, lvl == depth, last_pg,
                                     name, out)
            if len(children) > last_pg:  # each must be another page of the file
                raise CorruptDataError(f"{name}: branch pages point at more pages than the file holds")
        level = children
    if level or out.n != entries:
        raise CorruptDataError(f"{name}: the tree holds {out.n} entries, its meta page says {entries}")
    return out.tree(size, txnid, watch_at, watch)


def _most_nodes(psize: int) -> int:
    """The most nodes a page can hold: each takes a 2-byte pointer and at least an 8-byte header."""
    return (psize - _PAGE_HEADER) // (2 + _NODE_HEADER)


class _Entries:
    """The entries found so far, in arrays sized once from the (checked) count the meta page claims."""

    def __init__(self, entries: int, name: str) -> None:
        self.name, self.n = name, 0
        self.offsets = np.empty(entries, np.int64)
        self.sizes = np.empty(entries, np.uint32)
        self.key_ends = np.empty(entries, np.int64)
        self.keys: list[np.ndarray] = []
        self.key_bytes = 0

    def add(self, offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray, key_lens: np.ndarray) -> None:
        n, k = self.n, len(offsets)
        if n + k > len(self.offsets):
            raise CorruptDataError(f"{self.name}: the tree holds more entries than its meta page says "
                                   f"({len(self.offsets)})")
        self.offsets[n:n + k] = offsets
        self.sizes[n:n + k] = sizes
        np.cumsum(key_lens, out=self.key_ends[n:n + k])
        self.key_ends[n:n + k] += self.key_bytes
        self.keys.append(keys)
        self.key_bytes += len(keys)
        self.n = n + k

    def tree(self, size: int, txnid: int, watch_at: int, watch: bytes) -> LMDBTree:
        keys = np.concatenate(self.keys) if self.keys else np.zeros(0, np.uint8)
        self.keys = []
        return LMDBTree(self.offsets, self.sizes, keys, self.key_ends, size, txnid, watch_at, watch)


def _check_level(raw: np.ndarray, pgnos: np.ndarray, psize: int, leaf: bool, last_pg: int, name: str,
                 out: _Entries) -> list[int]:
    """Check all pages of one tree level (a chunk of it) at once; returns the child page numbers (branch
    pages), or adds the entries of leaf pages to ``out``."""
    pages = raw.reshape(len(pgnos), psize)
    stored = pages[:, :8].copy().view("<u8").ravel()
    _pad, flags, lower, upper = pages[:, 8:16].copy().view("<u2").T.astype(np.int64)
    want = _P_LEAF if leaf else _P_BRANCH
    bad = (stored != pgnos) | ((flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_LEAF2)) != want)
    bad |= (lower < 16) | (lower > upper) | (upper > psize) | ((lower - 16) % 2 != 0)
    nkeys = np.maximum(lower - 16, 0) // 2
    bad |= nkeys * _NODE_HEADER > psize - upper  # every node takes at least its header from the free space
    if not leaf:
        bad |= nkeys < 1
    if bad.any():
        raise CorruptDataError(f"{name}: page {int(pgnos[np.argmax(bad)])} has a damaged header")
    children: list[int] = []
    first = 0
    ends = np.cumsum(nkeys)
    while first < len(pgnos):  # the nodes of a few pages at a time: the arrays per node stay small
        last = max(first + 1, int(np.searchsorted(ends, (ends[first - 1] if first else 0) + _CHUNK_NODES,
                                                  "right")))
        kids = _check_nodes(raw[first * psize:last * psize], pgnos[first:last], upper[first:last],
                            nkeys[first:last], psize, leaf, last_pg, name, out)
        children += kids
        first = last
    return children


def _check_nodes(raw: np.ndarray, pgnos: np.ndarray, upper: np.ndarray, nkeys: np.ndarray, psize: int, leaf: bool,
                 last_pg: int, name: str, out: _Entries) -> list[int]:
    """The nodes of some pages of a level (their headers checked): see :func:`_check_level`."""
    # every node: its page row, and its pointer's position in that page
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
    dsize = lo | hi << 16
    big = (nflags & _F_BIGDATA) != 0
    # the nodes of a page lie in its free space, apart: their bytes add up to no more than it (nodes that
    # share bytes would make a small file claim keys without end)
    used = _NODE_HEADER + ksize
    if leaf:
        used += np.where(big, 8, dsize)
    fail((np.bincount(row, used, len(pgnos)) > psize - upper)[row], "nodes overlapping each other")
    if not leaf:
        return (lo | hi << 16 | nflags << 32).tolist()
    fail((nflags & (_F_SUBDATA | _F_DUPDATA)) != 0, "named sub-databases or duplicate keys, which bridgeflow's "
         "LMDB readers do not read (one key, one value, in the main database)")
    fail((nflags & ~_F_BIGDATA) != 0, "nodes with unexpected flags")
    fail(~big & (kend + dsize > psize), "a value running outside its page")
    fail(big & (kend + 8 > psize), "a damaged overflow link")
    offsets = pgnos[row] * psize + kend  # a small value lies in its leaf page, after its key
    if big.any():
        # the value starts after the first overflow page's header and runs dsize bytes: that run of
        # pages must lie inside the file (their headers are not read: cheap)
        rb, kb = row[big], kend[big]
        ov = raw[(base[big] + kb)[:, None] + _EIGHT].view("<u8").ravel()
        run = (dsize[big] + _PAGE_HEADER + psize - 1) // psize
        outside = (ov < 2) | (ov > last_pg)
        ov = np.where(outside, 0, ov).astype(np.int64)
        outside |= ov + run - 1 > last_pg
        if outside.any():
            raise CorruptDataError(f"{name}: page {int(pgnos[rb[np.argmax(outside)]])} has a value whose "
                                   "overflow pages lie outside the file")
        offsets[big] = ov * psize + _PAGE_HEADER
    # the keys end to end: node k's key is ksize[k] bytes from raw[base + offs + 8] (no more bytes than
    # the pages hold, checked above)
    starts = base + offs + 8
    total = int(ksize.sum())
    keys = raw[np.repeat(starts - (np.cumsum(ksize) - ksize), ksize) + np.arange(total)] if total else \
        np.zeros(0, np.uint8)
    out.add(offsets, dsize, keys, ksize)
    return []
