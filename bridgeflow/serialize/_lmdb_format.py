"""LMDB datasets: one encoded datapoint per key, each read by one positioned read of its value.

Layout: a single file (``foo.lmdb``, LMDB's ``subdir=False`` mode; no ``-lock`` file is kept). Datapoint
``i`` is stored under the 8-byte big-endian key ``i``, so cursor order is index order; metadata keys start
with ``__bf__/`` (they sort after every datapoint): ``format``, ``codec``, ``version``, ``count``.
``load`` also reads an LMDB *directory* (``data.mdb`` inside) written the same way.

Each value is one :func:`bridgeflow.serialize.encode` buffer followed by its 4-byte CRC-32 (the
default, ``checksum=True``; the ``__bf__/checksum`` key says so; files saved with ``checksum=False`` or
before checksums were the default have none and still load). The CRC is zlib's, computed by zlib-ng when
installed (the ``lmdb`` extra; see :mod:`bridgeflow.serialize._checksum`).

Reading never goes through LMDB's memory map. ``LMDBDataset`` (what ``load`` returns) opens the path once
(:mod:`bridgeflow.serialize._pinned`: a file renamed over the path by ``save(overwrite=True)`` is never
mixed with the one being read), walks its B-tree once with plain reads, checking every page, offset and
size against the file's real size (:mod:`bridgeflow.serialize._lmdb_tree`), the count against the entries
and every key against its datapoint; it keeps where each value lies (12 bytes a datapoint, shared by the
readers of one file in a process and by forked workers). A datapoint is then one ``pread`` of its value
into a ``bytearray`` the datapoint owns (no transaction, no cursor, nothing to re-open after ``fork``),
its CRC checked on that copy, decoded zero-copy: arrays are writable and valid after the file is closed.
Small values (under 16 KiB) are read, checked and decoded a batch at a time instead
(:mod:`bridgeflow.serialize._lmdb_rows`: one CRC call and one decode a batch).
A file cut short in place while it is read (by any process) gives a short read, hence a
:class:`CorruptDataError` naming the file, never a SIGBUS. Writing uses the ``lmdb`` package; reading needs
nothing but numpy.

``load`` also reads the files tensorpack's ``LMDBSerializer.save`` writes (keys ``"{:08}"`` and
``__keys__``, values msgpack or pickle; :mod:`bridgeflow.serialize._tensorpack_lmdb`), with the same
pinning, page check and errors; those values carry no checksum. ``LMDBData`` (tensorpack's raw
``[key, value]`` reader) lives in :mod:`bridgeflow.serialize._lmdb_raw`.

Damage: truncated files, foreign files, damaged pages, metadata, keys and values raise
:class:`CorruptDataError` naming the path. Every value's structure and CRC are checked on read. Without a
checksum, a changed byte inside array data or a string reads back as a changed value.

Example:
    >>> import numpy as np
    >>> from bridgeflow import DataFromList
    >>> df = DataFromList([[np.arange(3) + i, i] for i in range(4)], shuffle=False)
    >>> LMDBSerializer.save(df, "train.lmdb", progress=False)
    4
    >>> ds = LMDBSerializer.load("train.lmdb", shuffle=True, seed=0)
    >>> len(ds), ds[1]
    (4, [array([1, 2, 3]), 1])
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._base import DataFlow
from .._codec import CODECS, DECODE_ERRORS, DEFAULT_CODEC, FORMAT_VERSION, decode, decode_many, encode
from .._deps import require
from .._order import IndexedSource
from .._serialize_errors import CorruptDataError, EncodeError, PickleNotAllowedError, UnsupportedFormatError
from ._atomic import atomic_path, write_error
from ._checksum import crc32
from ._common import classes_json, existing_path, iterate_source, normalize_index, note_datapoint, parse_classes
from ._lmdb_file import PinnedLMDB, check_verify, new_bytearray, new_bytearray_function
from ._lmdb_rows import ROWS, SMALL_VALUE, SmallValueReads, gather_rows, rows_crc
from ._lmdb_tree import LMDBTree, walk_lmdb, written_error
from ._pinned import PinnedFile
from ._tensorpack_codec import decode_tensorpack
from ._tensorpack_lmdb import lmdb_layout, tensorpack_index, tensorpack_key

__all__ = ["LMDB_FORMATS", "LMDBDataset", "LMDBSerializer", "read_lmdb_meta"]

log = logging.getLogger(__name__)

FORMAT_NAME = b"bridgeflow-lmdb"
META = b"__bf__/"
_KEY = struct.Struct(">Q")
_CRC = struct.Struct("<I")
CHECKSUM = b"crc32"
_INITIAL_MAP = 256 << 20
_BATCH_BYTES = 64 << 20  # commit at least this often, whatever write_frequency says
_CLASSES_MAX = 16 << 20
_SMALL_VALUE = SMALL_VALUE  # sequential epochs read values smaller than this in blocks
_BLOCK_BYTES = 256 << 10  # of values lying within this distance of the first
_BLOCK_ITEMS = 1024  # at most this many datapoints
_PAGE = 4096  # (or, where they lie apart, of the values in the first one's page)
_EACH_BYTES = 4 << 20  # large values read a batch of about this many bytes at a time (then the watch, once)


def _key(i: int) -> bytes:
    return _KEY.pack(i)


LMDB_FORMATS = ("bridgeflow", "tensorpack")


class LMDBSerializer:
    """Save a flow to an LMDB file and load it back (tensorpack-compatible names)."""

    @staticmethod
    def save(df: DataFlow, path: str | os.PathLike, write_frequency: int = 5000, *,
             codec: str = DEFAULT_CODEC, overwrite: bool = False, progress: bool = True,
             checksum: bool = True, classes: Sequence[str] | None = None) -> int:
        """Encode every datapoint of ``df`` into the single-file LMDB ``path``; returns the count.

        Commits every ``write_frequency`` datapoints (or 64 MiB, whichever comes first). The map grows
        as needed. Written to a temporary file beside ``path`` and renamed at the end: an error or Ctrl-C
        leaves nothing behind. ``codec="pickle"`` stores any picklable object (readers must opt in).
        ``checksum=True`` (the default) stores a CRC-32 with every value, checked on every read (see the
        module doc); ``checksum=False`` writes files without, as older versions did. ``classes`` (the names
        of the labels) is stored in the file and comes back as the reader's ``.classes``.
        """
        lmdb = require("lmdb", "LMDBSerializer")
        if int(write_frequency) < 1:
            raise ValueError(f"write_frequency must be >= 1, got {write_frequency}")
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; choose one of {list(CODECS)}")
        target = os.fspath(path)
        with atomic_path(path, overwrite=overwrite) as tmp:
            out = _Output(lmdb, target, tmp)
            with out.writing(0):
                env = lmdb.open(tmp, subdir=False, map_size=_INITIAL_MAP, lock=False, sync=False,
                                meminit=False, map_async=True)
            try:
                count = _write_all(out, env, df, codec, int(write_frequency), progress, bool(checksum),
                                   _classes_json(classes))
                with out.writing(0):
                    env.sync(True)
            finally:
                env.close()
        log.info("saved %d datapoints to %s", count, target)
        return count

    @staticmethod
    def load(path: str | os.PathLike, shuffle: bool = True, *, seed: int | None = None,
             allow_pickle: bool = False, verify: bool | None = None, format: str | None = None,
             shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> LMDBDataset:
        """The flow of datapoints stored at ``path`` (see :class:`LMDBDataset`): a file written by this
        class, or by tensorpack's ``LMDBSerializer.save`` (``format=None`` recognises which);
        ``shard=(rank, world)`` or ``"auto"`` reads this rank's part only; ``verify`` is deprecated and does
        nothing."""
        return LMDBDataset(path, shuffle=shuffle, seed=seed, allow_pickle=allow_pickle, verify=verify,
                           format=format, shard=shard, drop_last=drop_last)


class _Output:
    """Where a save writes (``target``, through ``tmp``): turns LMDB's write failures into a
    :class:`DatasetWriteError` naming the target and the real cause (LMDB reports a short write, on a
    full disk or past ``ulimit -f``, as "Input/output error")."""

    def __init__(self, lmdb: Any, target: str, tmp: str) -> None:
        self.lmdb, self.target, self.tmp = lmdb, target, tmp
        # what a failing write raises; the others (a key out of order, a value too large) are not about the disk
        self.io_errors = (lmdb.DiskError, lmdb.PanicError, lmdb.ReadonlyError, lmdb.CorruptedError, OSError)

    @contextlib.contextmanager
    def writing(self, nbytes: int) -> Iterator[None]:
        try:
            yield
        except self.lmdb.Error as exc:
            if type(exc) is self.lmdb.Error or isinstance(exc, self.io_errors):
                raise write_error(self.target, exc, self.tmp, needed=nbytes + (1 << 20)) from exc
            raise
        except OSError as exc:
            raise write_error(self.target, exc, self.tmp, needed=nbytes + (1 << 20)) from exc

    def commit(self, env: Any, items: list[tuple[bytes, bytes]], append: bool) -> None:
        nbytes = sum(len(k) + len(v) for k, v in items)
        while True:
            try:
                with self.writing(nbytes), env.begin(write=True) as txn:
                    for k, v in items:
                        txn.put(k, v, append=append)
                return
            except self.lmdb.MapFullError:
                new = env.info()["map_size"] * 2
                log.debug("LMDB map full; growing it to %d MiB", new >> 20)
                env.set_mapsize(new)


def _classes_json(classes: Sequence[str] | None) -> bytes | None:
    return None if classes is None else classes_json(classes).encode("utf-8")


def _write_all(out: _Output, env: Any, df: DataFlow, codec: str, every: int, progress: bool, checksum: bool,
               classes: bytes | None = None) -> int:
    pending: list[tuple[bytes, bytes]] = []
    size = count = 0
    crc = crc32()
    for dp in iterate_source(df, progress=progress, desc=f"LMDB {os.path.basename(out.target)}"):
        try:
            value = encode(dp, codec=codec)
        except EncodeError as exc:
            note_datapoint(exc, count)
            raise
        if checksum:
            value += _CRC.pack(crc(value))
        pending.append((_key(count), value))
        count += 1
        size += len(value)
        if len(pending) >= every or size >= _BATCH_BYTES:
            out.commit(env, pending, append=True)
            pending, size = [], 0
    if pending:
        out.commit(env, pending, append=True)
    meta = {b"format": FORMAT_NAME, b"codec": codec.encode(), b"version": b"%d" % FORMAT_VERSION,
            b"count": b"%d" % count}
    if checksum:
        meta[b"checksum"] = CHECKSUM
    if classes is not None:
        meta[b"classes"] = classes
    out.commit(env, [(META + k, v) for k, v in meta.items()], append=False)
    return count


def read_lmdb_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``{"format", "codec", "version", "count", "checksum", "classes"}`` of an LMDB dataset; checks they
    are ones we read (``checksum`` is ``"crc32"`` or ``None``; ``classes`` a list of label names or
    ``None``)."""
    p = existing_path(path, "LMDB dataset")
    pin = PinnedFile(os.path.join(p, "data.mdb") if os.path.isdir(p) else p, "LMDB dataset")
    try:
        return _bridgeflow_meta(walk_lmdb(pin, p), pin, p)
    finally:
        pin.close()


def _bridgeflow_meta(tree: LMDBTree, pin: PinnedFile, p: str) -> dict[str, Any]:
    """The metadata of a file written by :class:`LMDBSerializer`, checked (see :func:`read_lmdb_meta`)."""
    raw: dict[bytes, bytes | None] = {}
    for k in (b"format", b"codec", b"version", b"count", b"checksum", b"classes"):
        j = tree.find(META + k)
        limit = _CLASSES_MAX if k == b"classes" else 64
        raw[k] = None if j is None or tree.sizes[j] > limit else tree.read(pin, j, p)  # a damaged size: not read
    if raw[b"format"] != FORMAT_NAME:
        raise CorruptDataError(f"{p}: an LMDB file, but not one written by LMDBSerializer "
                               f"(no {(META + b'format').decode()} key)")
    try:
        codec_b, version_b, count_b = raw[b"codec"], raw[b"version"], raw[b"count"]
        if codec_b is None or version_b is None or count_b is None:
            raise ValueError("a key is missing or too long")
        codec, version, count = codec_b.decode(), int(version_b), int(count_b)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptDataError(f"{p}: damaged metadata {raw!r}") from exc
    if codec not in CODECS:
        raise UnsupportedFormatError(f"{p}: written with codec {codec!r}, unknown to this bridgeflow "
                                     f"(known: {list(CODECS)})")
    if version != FORMAT_VERSION:
        raise UnsupportedFormatError(f"{p}: written with format version {version}; this bridgeflow reads "
                                     f"version {FORMAT_VERSION}")
    if count < 0:
        raise CorruptDataError(f"{p}: negative count {count} in metadata")
    if raw[b"checksum"] not in (None, CHECKSUM):
        raise UnsupportedFormatError(f"{p}: its values carry a {raw[b'checksum']!r} checksum, unknown to this "
                                     f"bridgeflow (known: {CHECKSUM.decode()})")
    first_meta = tree.bisect(META)
    meta_keys = 0
    while first_meta + meta_keys < len(tree) and meta_keys < 64 and \
            tree.key(first_meta + meta_keys).startswith(META):
        meta_keys += 1
    if count + meta_keys != len(tree):  # a damaged count would silently read a prefix, or run past the end
        raise CorruptDataError(f"{p}: its metadata counts {count} datapoints but the file holds "
                               f"{len(tree) - meta_keys}")
    classes = None
    if raw[b"classes"] is not None:
        classes = parse_classes(raw[b"classes"], p)
    return {"format": FORMAT_NAME.decode(), "codec": codec, "version": version, "count": count,
            "checksum": None if raw[b"checksum"] is None else CHECKSUM.decode(), "classes": classes}


def _check_keys(tree: LMDBTree, count: int, p: str) -> None:
    """The first ``count`` entries hold the keys of datapoints ``0 .. count-1``, in that order: a damaged
    key would reorder or skip datapoints silently."""
    lengths = tree.key_lengths()[:count]
    if count and (lengths == 8).all():
        keys = tree.keys[:8 * count].view(">u8")
        bad = np.flatnonzero(keys != np.arange(count, dtype=np.uint64))
    else:
        bad = np.flatnonzero(lengths != 8)
    if len(bad):
        i = int(bad[0])
        raise CorruptDataError(f"{p}: datapoint {i}: key {tree.key(i)!r} where key {_key(i)!r} belongs (a "
                               "damaged key would reorder or skip datapoints)")


class _Index:
    """What the readers of one file need, found once per file and process: the file's layout and
    metadata, where each datapoint's value lies (``offsets``, ``sizes``: 12 bytes a datapoint), and the
    version of the file they describe (its ``txnid``, and the watch that tells a commit since: see
    :mod:`bridgeflow.serialize._lmdb_tree`)."""

    __slots__ = ("__weakref__", "format", "meta", "offsets", "sizes", "small", "txnid", "watch", "watch_at")

    def __init__(self, fmt: str, meta: dict, offsets: np.ndarray, sizes: np.ndarray, tree: LMDBTree) -> None:
        self.format, self.meta = fmt, meta
        self.txnid, self.watch_at, self.watch = tree.txnid, tree.watch_at, tree.watch
        self.offsets = np.ascontiguousarray(offsets, np.int64)
        self.sizes = np.ascontiguousarray(sizes, np.uint32)
        self.small = bool(np.median(self.sizes) < _SMALL_VALUE) if len(self.sizes) else False  # read in blocks


_indexes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (file identity, format) -> _Index
_recent: list[_Index] = []  # the last few, kept while no reader holds them (a reader re-made each epoch)
_indexes_lock = threading.Lock()


def _index(tree_of: Any, pin: PinnedFile, p: str, fmt: str | None) -> _Index:
    """The :class:`_Index` of the pinned file, made from its tree (``tree_of()``) unless a reader of the
    same file (same inode, size and modification time) made it already in this process."""
    st = pin.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, fmt)
    with _indexes_lock:
        found = _indexes.get(key)
    if found is not None:
        return found
    tree = tree_of()
    layout = fmt or lmdb_layout(tree)
    if layout == "bridgeflow":
        meta = _bridgeflow_meta(tree, pin, p)
        n = meta["count"]
        _check_keys(tree, n, p)
        if meta["checksum"] is not None and (tree.sizes[:n] < _CRC.size).any():
            i = int(np.argmax(tree.sizes[:n] < _CRC.size))
            raise CorruptDataError(f"{p}: datapoint {i}: stored value of {tree.sizes[i]} bytes is too short for "
                                   "its checksum")
        made = _Index(layout, meta, tree.offsets[:n], tree.sizes[:n], tree)
    elif layout == "tensorpack":
        entries, meta = tensorpack_index(tree, pin, p, require_keys_entry=fmt is None)
        made = _Index(layout, meta, tree.offsets[entries], tree.sizes[entries], tree)
    else:
        raise CorruptDataError(f"{p}: an LMDB file, but not one written by LMDBSerializer (no "
                               f"{(META + b'format').decode()} key) nor by tensorpack's LMDBSerializer (no "
                               "__keys__ key); LMDBData(path) reads the raw [key, value] pairs of any LMDB file")
    with _indexes_lock:
        _indexes[key] = made
        _recent.append(made)
        del _recent[:-4]
    return made


class LMDBDataset(IndexedSource, PinnedLMDB, SmallValueReads):
    """Datapoints of an LMDB dataset: ``len()``, ``ds[i]``, and iteration in order or shuffled.

    Reads files written by :class:`LMDBSerializer` and by tensorpack's ``LMDBSerializer.save`` (values
    in msgpack, read without pickle, or in pickle, read only with ``allow_pickle=True``; see
    :mod:`bridgeflow.serialize._tensorpack_lmdb`). ``.format`` says which; ``.meta`` holds the count, codec
    and, for bridgeflow's files, checksum and class names.

    The path is opened once, here, and that file is read for the reader's lifetime (see the module doc):
    its tree is walked and checked once, then every datapoint is one positioned read of its value (no
    memory map, no per-read transaction), checked and decoded. Processes that got the reader through
    ``fork`` (DataLoader workers, parallel stages) read through the inherited descriptor with nothing to
    open; a copy sent by pickling, or a reader used after ``close()``, opens the path again and raises
    :class:`DatasetChangedError` if another file lies there now. Shuffled epochs read the datapoints in a
    permutation drawn from ``seed`` each epoch.

    Args:
        path: a single-file LMDB (``foo.lmdb``) or an LMDB directory.
        shuffle: a new random order every epoch.
        seed: makes the shuffled orders reproducible.
        allow_pickle: needed to read files saved with ``codec="pickle"`` and tensorpack's pickled files
            (tensorpack's default): unpickling can run code.
        verify: deprecated, does nothing (the pages are always checked; nothing is memory-mapped).
        format: ``"bridgeflow"``, ``"tensorpack"`` or ``None`` (recognised from the file's keys).
        shard: ``(rank, world)`` or ``"auto"``: read only this rank's contiguous part of every epoch's
            order, all ranks equally long (``drop_last`` drops the remainder instead of wrapping around;
            see :mod:`bridgeflow._shard`). Shuffled shards need the same ``seed`` on every rank.

    ``state_dict()`` is the epoch, the position and the shuffle's entropy (see :mod:`bridgeflow._order`).

    Example:
        >>> import numpy as np
        >>> from bridgeflow import DataFromList
        >>> LMDBSerializer.save(DataFromList([[np.zeros(2), "a"]]), "one.lmdb", progress=False)
        1
        >>> ds = LMDBDataset("one.lmdb", shuffle=False)
        >>> len(ds), ds.format, ds[0]
        (1, 'bridgeflow', [array([0., 0.]), 'a'])
    """

    def __init__(self, path: str | os.PathLike, shuffle: bool = True, seed: int | None = None, *,
                 allow_pickle: bool = False, verify: bool | None = None, format: str | None = None,
                 shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> None:
        if format is not None and format not in LMDB_FORMATS:
            raise ValueError(f"LMDBDataset: unknown format {format!r}; choose one of {list(LMDB_FORMATS)} or None")
        check_verify(verify, "LMDBDataset")
        self.shuffle = shuffle
        self.seed = seed
        self.allow_pickle = allow_pickle
        self._open_pinned(path, "LMDBSerializer.load")
        try:
            index = _index(self._walk, self._pin, self.path, format)
        except BaseException:
            self._abandon()
            raise
        self.format, self.meta = index.format, dict(index.meta)
        if self.meta["codec"] == "pickle" and not allow_pickle:
            self._abandon()
            raise PickleNotAllowedError(self._pickle_refusal())
        # a value of a bridgeflow-codec file that claims to be a pickle is damage, never unpickled
        self._unpickle = allow_pickle and self.meta["codec"] == "pickle"
        self._crc = self.meta["checksum"] is not None
        self.classes: list[str] | None = self.meta["classes"]
        self._set_index(index)
        self._init_order(self.meta["count"], shuffle, shard, drop_last)

    def _set_index(self, index: _Index) -> None:
        self._index = index
        self._offsets, self._sizes = index.offsets.data, index.sizes.data  # fast int lookups
        self._watch_at, self._watch = index.watch_at, index.watch

    def _written(self) -> Exception:
        """The error for a file a writer committed to since it was opened (see the module doc)."""
        return written_error(self._pin, self.path, self._index.txnid)

    def _pickle_refusal(self) -> str:
        if self.format == "tensorpack":
            return (f"{self.path} holds pickled values (written by tensorpack with its default serializer, "
                    "TENSORPACK_SERIALIZE=pickle): pass allow_pickle=True (bridgeflow serialize/inspect: "
                    "--allow-pickle) to load it, only if you trust the file (unpickling can run code)")
        return (f"{self.path} was saved with codec='pickle'; pass allow_pickle=True to load it, only if you "
                "trust the file (unpickling can run code)")

    def _identity(self) -> dict:
        return {"count": self.meta["count"], "bytes": self._pin.size()}

    def _damaged(self, index: int, exc: Exception | None = None) -> CorruptDataError:
        """A stored value whose CRC does not match (``exc`` None) or that does not decode (``exc``): the
        file's metadata names its codec and version, so a value claiming another (or a pickle in a
        bridgeflow-codec file) is damage too. A file cut in place while the value was read is named as
        such: the read can come back full length with the bytes past the new end zeroed (the kernel
        shrinks the file's size before it clears the cut page's tail)."""
        off, size = self._offsets[index], self._sizes[index]
        if self._pin.size() < off + size:
            return self._cut(off, size, f"datapoint {index}")
        if exc is None:
            return CorruptDataError(f"{self.path}: datapoint {index}: checksum mismatch: the stored value is damaged")
        if isinstance(exc, PickleNotAllowedError):  # "pass allow_pickle=True" would be no help here
            return CorruptDataError(f"{self.path}: datapoint {index} is a pickle, but the file's metadata says "
                                    f"codec={self.meta['codec']}: the file is damaged or was tampered with; "
                                    "it is not unpickled" + (" (even with allow_pickle=True)" if self.allow_pickle
                                                             else ""))
        return CorruptDataError(f"{self.path}: datapoint {index}: {exc}")

    def _get(self, fd: int, i: int) -> Any:
        """Datapoint ``i`` of the file: its value read (one ``pread``, into memory the datapoint owns), its
        CRC checked, decoded zero-copy."""
        off, size = self._offsets[i], self._sizes[i]
        data: bytes | bytearray
        if self.format == "tensorpack":
            data, crc = os.pread(fd, size, off), None
            got = len(data)
        elif self._crc:
            data, crc = new_bytearray(size - _CRC.size), bytearray(_CRC.size)  # size >= 4: checked at open
            got = os.preadv(fd, [data, crc], off)
        else:
            data, crc = new_bytearray(size), None
            got = os.preadv(fd, [data], off)
        if got != size:
            raise self._cut(off, size, f"datapoint {i}")
        if os.pread(fd, 8, self._watch_at) != self._watch:
            raise self._written()
        return self._finish(i, data, crc)

    def _finish(self, i: int, data: Any, crc: Any) -> Any:
        """Check the CRC (``crc``: the stored 4 bytes, or ``None``) and decode datapoint ``i``'s value."""
        if crc is not None and crc32()(data) != _CRC.unpack(crc)[0]:
            raise self._damaged(i)
        if self.format == "tensorpack":
            try:
                return decode_tensorpack(data, allow_pickle=self.allow_pickle, serializer=self.meta["codec"])
            except DECODE_ERRORS as exc:
                raise type(exc)(f"{self.path}: key {tensorpack_key(i).decode()!r} (datapoint {i}): {exc}") from exc
        try:
            return decode(data, allow_pickle=self._unpickle)
        except DECODE_ERRORS as exc:
            raise self._damaged(i, exc) from exc

    def __getitem__(self, index: int) -> Any:
        i = self._order.shard_index(normalize_index(index, len(self), type(self).__name__))
        return self._get(self._fd(), i)

    def _read(self, runs: list, pos: int) -> Iterator[Any]:
        fd, get = self._fd(), self._get
        for it, run, _skip in self._order.iters(runs, pos):
            if self.shuffle or not self._index.small:  # each value read alone
                if self.format == "bridgeflow" and self._index.small and not self._unpickle:
                    yield from self._read_batches(fd, it, run, _skip)  # see SmallValueReads
                elif self.format == "bridgeflow" and self._crc:
                    yield from self._read_each(fd, it, run, _skip)
                else:
                    for i in it:
                        yield get(fd, i)
                continue
            assert isinstance(run, range)  # not shuffled: a run is a range of datapoints
            stop = run.stop
            for i in it:
                at, end, base, block = self._block(fd, i, stop)  # datapoints at..end-1 lie in ``block``
                if end == at:  # a large value, or one lying apart: read alone
                    yield get(fd, i)
                    continue
                assert block is not None  # end > at: they lie in it
                batch = self._decode_block(at, end, base, block)
                items = iter(batch) if batch is not None else self._block_items(at, end, base, block)
                yield next(items)  # datapoint i
                for dp, _ in zip(items, it):  # ``it`` advances with each one handed out, in C
                    yield dp

    def _block_items(self, at: int, end: int, base: int, block: memoryview) -> Iterator[Any]:
        """The datapoints ``at..end-1`` whose values lie in ``block`` (read from byte ``base``), each in turn
        (where :meth:`_decode_block` could not decode them together: this names a damaged one)."""
        for i in range(at, end):
            a, size = self._offsets[i] - base, self._sizes[i]
            if self.format == "tensorpack":
                yield self._finish(i, bytes(block[a:a + size]), None)
            elif self._crc:
                n = a + size - _CRC.size
                yield self._finish(i, bytearray(block[a:n]), block[n:n + _CRC.size])
            else:
                yield self._finish(i, bytearray(block[a:a + size]), None)

    def _read_each(self, fd: int, it: Iterator[int], run: Any, skip: int) -> Iterator[Any]:
        """:meth:`_get` for each of ``it`` (``run[skip:]``; the common case of large values: bridgeflow's
        format, checksums), inlined, a batch of up to :data:`_EACH_BYTES` (or :data:`ROWS` values) at a
        time: each value read into memory it owns, its CRC checked while its bytes are in the CPU's cache
        and decoded; then the writer's watch read once for the batch, before any of it is handed out (a
        file committed to or cut while it is read is an error, as for one value); then the batch handed
        out, ``it`` advancing with each (the reader's position), and the error of a damaged value, if any,
        after the ones before it."""
        offsets, sizes, new, preadv = self._offsets, self._sizes, new_bytearray_function(), os.preadv
        crc32_of, stored, allow, tail = crc32(), _CRC.unpack, self._unpickle, _CRC.size
        pread, watch_at, watch = os.pread, self._watch_at, self._watch
        j, n = skip, len(run)
        for _ in it:
            batch: list = []
            failed: Exception | None = None
            nbytes = 0
            while j < n and nbytes < _EACH_BYTES and len(batch) < ROWS:
                i = run[j]
                off, size = offsets[i], sizes[i]
                data, crc = new(size - tail), bytearray(tail)
                if preadv(fd, [data, crc], off) != size:
                    raise self._cut(off, size, f"datapoint {i}")
                j += 1
                nbytes += size
                if crc32_of(data) != stored(crc)[0]:
                    failed = self._damaged(i)
                    break
                try:
                    batch.append(decode(data, allow_pickle=allow))
                except DECODE_ERRORS as exc:
                    failed = self._damaged(i, exc)
                    failed.__cause__ = exc
                    break
            if pread(fd, 8, watch_at) != watch:
                raise self._written()
            if batch:
                yield batch[0]
                for dp, _ in zip(itertools.islice(batch, 1, None), it):
                    yield dp
            if failed is not None:  # a damaged value: the ones before it were handed out
                raise failed

    def _decode_block(self, at: int, end: int, base: int, block: memoryview | None) -> list | None:
        """The datapoints ``at..end-1`` of a block of small values, their CRCs checked and their values decoded
        together (:func:`~bridgeflow._codec.decode_many`: the arrays are views of the block), or
        ``None`` where they are not alike: then each goes the usual way, which names a damaged one."""
        if block is None or end - at < 2 or self.format != "bridgeflow" or self._unpickle:
            return None
        sizes = self._index.sizes[at:end]
        size = int(sizes[0])
        if (sizes != size).any():
            return None
        starts = self._index.offsets[at:end] - base
        length = size - _CRC.size if self._crc else size
        if self._crc:  # the values end to end: one CRC call checks them all
            rows = gather_rows(block, starts, size)
            if crc32()(rows) != rows_crc(end - at, size):
                return None
            block, starts = memoryview(rows), np.arange(0, len(rows), size, dtype=np.int64)
        try:
            return decode_many(block, starts, length)
        except DECODE_ERRORS:
            return None

    def _block(self, fd: int, i: int, stop: int) -> tuple[int, int, int, memoryview | None]:
        """``(i, end, base, bytes)``: the small values of datapoints ``i..end-1`` that lie close together in
        the file (in neighbouring leaf pages, as a sequential epoch reads them), read at once from byte
        ``base``; ``end == i`` when datapoint ``i``'s value is large or lies apart (it is read alone)."""
        if self._sizes[i] >= _SMALL_VALUE:
            return i, i, 0, None
        last = min(stop, i + _BLOCK_ITEMS)
        offsets, sizes = self._index.offsets[i:last], self._index.sizes[i:last]
        ends = offsets + sizes
        first = int(offsets[0])
        near = (sizes < _SMALL_VALUE) & (offsets >= first - _BLOCK_BYTES) & (ends <= first + _BLOCK_BYTES)
        n = len(near) if near.all() else int(np.argmin(near))
        lo, hi = int(offsets[:n].min()), int(ends[:n].max())
        if hi - lo > 2 * int(sizes[:n].sum()) + _PAGE:  # gaps between them: only those in the first one's page
            same = offsets[:n] // _PAGE == first // _PAGE
            n = len(same) if same.all() else int(np.argmin(same))
            lo, hi = int(offsets[:n].min()), int(ends[:n].max())
        if n < 2:
            return i, i, 0, None
        block = new_bytearray(hi - lo)
        if os.preadv(fd, [block], lo) != hi - lo:
            raise self._cut(lo, hi - lo, f"datapoints {i}..{i + n - 1}")
        if os.pread(fd, 8, self._watch_at) != self._watch:
            raise self._written()
        return i, i + n, lo, memoryview(block)

    def close(self) -> None:
        self.__dict__.pop("_values_region", None)  # the values __getitems__ held
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        del state["_offsets"], state["_sizes"]  # memoryviews: made again from the index in the copy
        state.pop("_values_region", None)  # held values (see __getitems__): read again by the copy
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._set_index(self._index)

    def __repr__(self) -> str:
        return f"LMDBDataset({self.path!r}, shuffle={self.shuffle}, format={self.format!r}, n={self.meta['count']})"
