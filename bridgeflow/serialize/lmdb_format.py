"""LMDB datasets: one encoded datapoint per key, read by one cursor pass or by random access.

Layout: a single file (``foo.lmdb``, LMDB's ``subdir=False`` mode; no ``-lock`` file is kept). Datapoint
``i`` is stored under the 8-byte big-endian key ``i``, so cursor order is index order; metadata keys start
with ``__bf__/`` (they sort after every datapoint): ``format``, ``codec``, ``version``, ``count``.
``load`` also reads an LMDB *directory* (``data.mdb`` inside) written the same way.

Each value is one :func:`bridgeflow.serialize.codec.encode` buffer followed by its 4-byte CRC-32 (the
default, ``checksum=True``; the ``__bf__/checksum`` key says so; files saved with ``checksum=False`` or
before checksums were the default have none and still load). Reading checks the value's length against
the length its header declares, copies it once out of the memory map into a ``bytearray``, checks the
CRC on the copy and decodes zero-copy, so arrays are writable, owned by the datapoint and valid after the
file is closed. The CRC is zlib's, computed by zlib-ng when installed (the ``lmdb`` extra): ~70 GB/s,
about 15% of a read of large values from the page cache (see :mod:`bridgeflow.serialize._checksum`).

One open per reader: ``LMDBDataset`` (what ``load`` returns) opens the path once, holds that file (see
:mod:`bridgeflow.serialize._pinned`) and reads its length and every value from it, so a file renamed over
the path by ``save(overwrite=True)`` is never mixed with the one being read. Readers of one file in one
process share one LMDB environment (LMDB allows one per file per process), found by the file's inode, not
its name, and closed with the last reader, or when a reader is dropped without ``close()``
(:mod:`bridgeflow.serialize._lmdb_env`).

``load`` also reads the files tensorpack's ``LMDBSerializer.save`` writes (keys ``"{:08}"`` and
``__keys__``, values msgpack or pickle; :mod:`bridgeflow.serialize.tensorpack_lmdb`), with the same
pinning, page check and errors; those values carry no checksum. ``LMDBData`` (tensorpack's raw
``[key, value]`` reader) lives in :mod:`bridgeflow.serialize.lmdb_raw`.

Damage: truncated files, foreign files, damaged metadata and damaged values raise
:class:`CorruptDataError` naming the path. LMDB trusts its own B-tree pages (damage there would crash the
reader with SIGBUS), so ``LMDBDataset`` first walks the tree with plain reads and checks every page, offset
and size against the file's real size (``verify=None`` or ``True``; ``verify=False`` skips it). The
count, the keys and every value's structure and CRC are checked on read. Without a checksum, a changed
byte inside array data or a string reads back as a changed value.

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

import logging
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

from .._deps import require
from ..base import DataFlow
from ..order import IndexedSource
from ._checksum import crc32
from ._common import classes_json, existing_path, iterate_source, normalize_index, parse_classes
from ._lmdb_env import Held, PinnedLMDB, _envs, lmdb_error  # noqa: F401 - _envs: tests look at it
from ._pinned import PinnedFile
from .atomic import atomic_path
from .codec import CODECS, DECODE_ERRORS, DEFAULT_CODEC, FORMAT_VERSION, TOTAL, decode, encode
from .errors import CorruptDataError, PickleNotAllowedError, UnsupportedFormatError
from .tensorpack_codec import decode_tensorpack
from .tensorpack_lmdb import TENSORPACK_SEQUENTIAL_LIMIT, lmdb_layout, read_tensorpack_meta, tensorpack_key

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


def _key(i: int) -> bytes:
    return _KEY.pack(i)


LMDB_FORMATS = ("bridgeflow", "tensorpack")
_wrap = lmdb_error


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
        with atomic_path(path, overwrite=overwrite) as tmp:
            env = lmdb.open(tmp, subdir=False, map_size=_INITIAL_MAP, lock=False, sync=False,
                            meminit=False, map_async=True)
            try:
                count = _write_all(lmdb, env, df, codec, int(write_frequency), progress, os.fspath(path),
                                   bool(checksum), _classes_json(classes))
                env.sync(True)
            finally:
                env.close()
        log.info("saved %d datapoints to %s", count, os.fspath(path))
        return count

    @staticmethod
    def load(path: str | os.PathLike, shuffle: bool = True, *, seed: int | None = None,
             allow_pickle: bool = False, verify: bool | None = None, format: str | None = None,
             shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> LMDBDataset:
        """The flow of datapoints stored at ``path`` (see :class:`LMDBDataset`): a file written by this
        class, or by tensorpack's ``LMDBSerializer.save`` (``format=None`` recognises which);
        ``shard=(rank, world)`` or ``"auto"`` reads this rank's part only."""
        return LMDBDataset(path, shuffle=shuffle, seed=seed, allow_pickle=allow_pickle, verify=verify,
                           format=format, shard=shard, drop_last=drop_last)


def _commit(lmdb: Any, env: Any, items: list[tuple[bytes, bytes]], append: bool) -> None:
    while True:
        try:
            with env.begin(write=True) as txn:
                for k, v in items:
                    txn.put(k, v, append=append)
            return
        except lmdb.MapFullError:
            new = env.info()["map_size"] * 2
            log.debug("LMDB map full; growing it to %d MiB", new >> 20)
            env.set_mapsize(new)


def _classes_json(classes: Sequence[str] | None) -> bytes | None:
    return None if classes is None else classes_json(classes).encode("utf-8")


def _write_all(lmdb: Any, env: Any, df: DataFlow, codec: str, every: int, progress: bool, name: str,
               checksum: bool, classes: bytes | None = None) -> int:
    pending: list[tuple[bytes, bytes]] = []
    size = count = 0
    crc = crc32()
    for dp in iterate_source(df, progress=progress, desc=f"LMDB {os.path.basename(name)}"):
        value = encode(dp, codec=codec)
        if checksum:
            value += _CRC.pack(crc(value))
        pending.append((_key(count), value))
        count += 1
        size += len(value)
        if len(pending) >= every or size >= _BATCH_BYTES:
            _commit(lmdb, env, pending, append=True)
            pending, size = [], 0
    if pending:
        _commit(lmdb, env, pending, append=True)
    meta = {b"format": FORMAT_NAME, b"codec": codec.encode(), b"version": b"%d" % FORMAT_VERSION,
            b"count": b"%d" % count}
    if checksum:
        meta[b"checksum"] = CHECKSUM
    if classes is not None:
        meta[b"classes"] = classes
    _commit(lmdb, env, [(META + k, v) for k, v in meta.items()], append=False)
    return count


def read_lmdb_meta(path: str | os.PathLike, env: Any = None) -> dict[str, Any]:
    """``{"format", "codec", "version", "count", "checksum", "classes"}`` of an LMDB dataset; checks they
    are ones we read (``checksum`` is ``"crc32"`` or ``None``; ``classes`` a list of label names or
    ``None``)."""
    p = existing_path(path, "LMDB dataset")
    lmdb = require("lmdb", "LMDBSerializer")
    held = None
    if env is None:  # one open of the file, released below
        held = Held(PinnedFile(os.path.join(p, "data.mdb") if os.path.isdir(p) else p, "LMDB dataset"))
        try:
            env = held.environment(p, False)
        except BaseException:
            held.release()
            raise
    try:
        with env.begin(buffers=True) as txn:
            raw = {}
            for k in (b"format", b"codec", b"version", b"count", b"checksum", b"classes"):
                v = txn.get(META + k)
                limit = _CLASSES_MAX if k == b"classes" else 64
                raw[k] = None if v is None or len(v) > limit else bytes(v)  # a damaged size: never copy it
            entries = txn.stat(env.open_db())["entries"]
            meta_keys = _count_meta_keys(txn)
    except lmdb.Error as exc:
        raise _wrap(p, exc, "reading metadata") from exc
    finally:
        if held is not None:
            held.release()
    if raw[b"format"] != FORMAT_NAME:
        raise CorruptDataError(f"{p}: an LMDB file, but not one written by LMDBSerializer "
                               f"(no {(META + b'format').decode()} key)")
    try:
        codec, version, count = raw[b"codec"].decode(), int(raw[b"version"]), int(raw[b"count"])
    except (AttributeError, TypeError, ValueError, UnicodeDecodeError) as exc:
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
    if count + meta_keys != entries:  # a damaged count would silently read a prefix, or run past the end
        raise CorruptDataError(f"{p}: its metadata counts {count} datapoints but the file holds "
                               f"{entries - meta_keys}")
    classes = None
    if raw[b"classes"] is not None:
        classes = parse_classes(raw[b"classes"], p)
    return {"format": FORMAT_NAME.decode(), "codec": codec, "version": version, "count": count,
            "checksum": None if raw[b"checksum"] is None else CHECKSUM.decode(), "classes": classes}


def _count_meta_keys(txn: Any) -> int:
    """Keys under ``META`` (they sort after every datapoint key); at most 64 are looked at."""
    cursor = txn.cursor()
    n = 0
    if cursor.set_range(META):
        for key in cursor.iternext(values=False):
            if bytes(key[:len(META)]) != META or n >= 64:
                break
            n += 1
    return n


class LMDBDataset(IndexedSource, PinnedLMDB):
    """Datapoints of an LMDB dataset: ``len()``, ``ds[i]``, and iteration in order or shuffled.

    Reads files written by :class:`LMDBSerializer` and by tensorpack's ``LMDBSerializer.save`` (values
    in msgpack, read without pickle, or in pickle, read only with ``allow_pickle=True``; see
    :mod:`bridgeflow.serialize.tensorpack_lmdb`). ``.format`` says which; ``.meta`` holds the count, codec
    and, for bridgeflow's files, checksum and class names.

    Sequential epochs are one cursor pass; shuffled epochs read keys in a permutation drawn from
    ``seed`` each epoch. The path is opened once, here, and that file is read for the reader's lifetime
    (see the module doc); a process that finds the environment inherited through ``fork`` opens the same
    file again through the inherited descriptor (LMDB handles must not cross fork), so many processes can
    read one file. A copy sent to another process by pickling, or a reader used after ``close()``, opens
    the path again and raises :class:`DatasetChangedError` if another file lies there now. Read-only, no
    lock file, readahead off when shuffled.

    Args:
        path: a single-file LMDB (``foo.lmdb``) or an LMDB directory.
        shuffle: a new random order every epoch.
        seed: makes the shuffled orders reproducible.
        allow_pickle: needed to read files saved with ``codec="pickle"`` and tensorpack's pickled files
            (tensorpack's default): unpickling can run code.
        verify: check the file's pages before mapping it (see the module doc); ``None`` (the default) and
            ``True`` check, within the file's real size; ``False`` skips the check (a damaged page may
            then crash the process).
        format: ``"bridgeflow"``, ``"tensorpack"`` or ``None`` (recognised from the file's keys).
        shard: ``(rank, world)`` or ``"auto"``: read only this rank's contiguous part of every epoch's
            order, all ranks equally long (``drop_last`` drops the remainder instead of wrapping around;
            see :mod:`bridgeflow.shard`). Shuffled shards need the same ``seed`` on every rank.

    ``state_dict()`` is the epoch, the position and the shuffle's entropy (see :mod:`bridgeflow.order`).

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
        self.shuffle = shuffle
        self.seed = seed
        self.allow_pickle = allow_pickle
        self._open_pinned(path, verify, "LMDBSerializer.load")
        try:
            env = self._environment()
            self.format = format or self._detect(env)
            if self.format == "bridgeflow":
                self.meta = read_lmdb_meta(self.path, env=env)
            else:
                self.meta = read_tensorpack_meta(self.path, env, require_keys_entry=format is None)
        except BaseException:
            self._abandon()
            raise
        if self.meta["codec"] == "pickle" and not allow_pickle:
            self._abandon()
            raise PickleNotAllowedError(self._pickle_refusal())
        # a value of a bridgeflow-codec file that claims to be a pickle is damage, never unpickled
        self._unpickle = allow_pickle and self.meta["codec"] == "pickle"
        self._crc = self.meta["checksum"] is not None
        self.classes: list[str] | None = self.meta["classes"]
        self._init_order(self.meta["count"], shuffle, shard, drop_last)

    def _detect(self, env: Any) -> str:
        lmdb = require("lmdb", "LMDBSerializer")
        try:
            with env.begin(buffers=True) as txn:
                layout = lmdb_layout(txn)
        except lmdb.Error as exc:
            raise _wrap(self.path, exc, "reading its keys") from exc
        if layout is None:
            raise CorruptDataError(f"{self.path}: an LMDB file, but not one written by LMDBSerializer (no "
                                   f"{(META + b'format').decode()} key) nor by tensorpack's LMDBSerializer (no "
                                   "__keys__ key); LMDBData(path) reads the raw [key, value] pairs of any LMDB file")
        return layout

    def _pickle_refusal(self) -> str:
        if self.format == "tensorpack":
            return (f"{self.path} holds pickled values (written by tensorpack with its default serializer, "
                    "TENSORPACK_SERIALIZE=pickle): pass allow_pickle=True (bridgeflow serialize/inspect: "
                    "--allow-pickle) to load it, only if you trust the file (unpickling can run code)")
        return (f"{self.path} was saved with codec='pickle'; pass allow_pickle=True to load it, only if you "
                "trust the file (unpickling can run code)")

    def _identity(self) -> dict:
        return {"count": self.meta["count"], "bytes": self._held.pin.size()}

    def _decode(self, value: Any, index: int) -> Any:
        if self.format == "tensorpack":
            return self._decode_tensorpack(value, index)
        if value is None:
            raise CorruptDataError(f"{self.path}: datapoint {index} is missing (count says {self.meta['count']})")
        try:
            return decode(self._payload(value), allow_pickle=self._unpickle)
        except DECODE_ERRORS as exc:
            raise self._damaged(index, exc) from exc

    def _decode_tensorpack(self, value: Any, index: int) -> Any:
        if value is None:
            raise CorruptDataError(f"{self.path}: key {tensorpack_key(index).decode()!r} (datapoint {index}) is "
                                   f"missing ({self.meta['count']} datapoints)")
        try:
            return decode_tensorpack(value, allow_pickle=self.allow_pickle, serializer=self.meta["codec"])
        except DECODE_ERRORS as exc:
            raise type(exc)(f"{self.path}: key {tensorpack_key(index).decode()!r} (datapoint {index}): "
                            f"{exc}") from exc

    def _payload(self, value: Any) -> bytearray:
        """The encoding inside a stored value, copied out of the map once the checks this file needs pass:
        its size against its header before copying (unless the page check covered it), and its CRC."""
        n = len(value) - _CRC.size if self._crc else len(value)
        if not self.verified and (n < 32 or TOTAL.unpack_from(value, 24)[0] != n):
            raise CorruptDataError(f"stored value of {len(value)} bytes does not match its header")
        if not self._crc:
            return bytearray(value)
        if n < 0:
            raise CorruptDataError(f"stored value of {len(value)} bytes is too short for its checksum")
        data = bytearray(value[:n])
        if crc32()(data) != _CRC.unpack_from(value, n)[0]:
            raise CorruptDataError("checksum mismatch: the stored value is damaged")
        return data

    def _damaged(self, index: int, exc: Exception) -> CorruptDataError:
        """A stored value that does not decode: the file's metadata names its codec and version, so a
        value claiming another (or a pickle in a bridgeflow-codec file) is damage too."""
        if isinstance(exc, PickleNotAllowedError):  # "pass allow_pickle=True" would be no help here
            return CorruptDataError(f"{self.path}: datapoint {index} is a pickle, but the file's metadata says "
                                    f"codec={self.meta['codec']}: the file is damaged or was tampered with; "
                                    "it is not unpickled" + (" (even with allow_pickle=True)" if self.allow_pickle
                                                             else ""))
        return CorruptDataError(f"{self.path}: datapoint {index}: {exc}")

    def _key_of(self, i: int) -> bytes:
        return tensorpack_key(i) if self.format == "tensorpack" else _key(i)

    def __getitem__(self, index: int) -> Any:
        i = self._order.shard_index(normalize_index(index, len(self), type(self).__name__))
        lmdb = require("lmdb", "LMDBDataset")
        try:
            with self._environment().begin(buffers=True) as txn:
                return self._decode(txn.get(self._key_of(i)), i)
        except lmdb.Error as exc:
            raise _wrap(self.path, exc, f"reading datapoint {i}") from exc

    def _read(self, runs: list, pos: int) -> Iterator[Any]:
        lmdb = require("lmdb", "LMDBDataset")
        env = self._environment()
        self._check_size(env)  # once an epoch: one fstat
        try:
            with env.begin(buffers=True) as txn:
                for it, run, skip in self._order.iters(runs, pos):
                    if self.shuffle or self._by_key:
                        get, key = txn.get, self._key_of
                        for i in it:
                            yield self._decode(get(key(i)), i)
                    else:
                        yield from self._read_run(txn, it, run.start + skip, run.stop)
        except lmdb.Error as exc:
            raise _wrap(self.path, exc, "reading") from exc

    @property
    def _by_key(self) -> bool:
        """tensorpack's keys have 9 digits from 10**8 on and then sort before some 8-digit ones: read by key."""
        return self.format == "tensorpack" and self.meta["count"] > TENSORPACK_SEQUENTIAL_LIMIT

    def _read_run(self, txn: Any, indices: Iterator[int], first: int, stop: int) -> Iterator[Any]:
        """Datapoints ``first:stop`` by one cursor pass; ``indices`` counts them off (the position)."""
        cursor = txn.cursor()
        if not cursor.set_key(self._key_of(first)):
            raise CorruptDataError(f"{self.path}: datapoint {first} is missing (count says {self.meta['count']})")
        if self.format == "tensorpack":
            yield from self._read_tensorpack_run(cursor, indices, first, stop)
            return
        allow, i, key, payload = self._unpickle, first - 1, _KEY.pack, self._payload
        items = cursor.iternext()
        # Sizes checked against the file and no CRC: a plain copy. Otherwise an unchecked size must
        # match its header before it is copied, and a CRC must match.
        copy = bytearray if self.verified and not self._crc else payload
        try:  # the hot loop: copy once out of the map, decode zero-copy
            for i, (k, value) in zip(indices, items):
                if k != key(i):  # a damaged key would reorder or skip datapoints silently
                    raise CorruptDataError(f"key {bytes(k)!r} where key {key(i)!r} belongs")
                yield decode(copy(value), allow_pickle=allow)
        except struct.error as exc:
            raise CorruptDataError(f"{self.path}: datapoint {i}: stored value too short") from exc
        except DECODE_ERRORS as exc:
            raise self._damaged(i, exc) from exc
        if i + 1 != stop:
            raise CorruptDataError(f"{self.path}: {i + 1} datapoints found, its count says {self.meta['count']}")

    def _read_tensorpack_run(self, cursor: Any, indices: Iterator[int], first: int, stop: int) -> Iterator[Any]:
        i = first - 1
        for i, (k, value) in zip(indices, cursor.iternext()):
            if k != tensorpack_key(i):  # a damaged key would reorder or skip datapoints silently
                raise CorruptDataError(f"{self.path}: key {bytes(k)!r} where key {tensorpack_key(i)!r} belongs")
            yield self._decode_tensorpack(value, i)
        if i + 1 != stop:
            raise CorruptDataError(f"{self.path}: {i + 1} datapoints found, its entries count {self.meta['count']}")

    def __repr__(self) -> str:
        return f"LMDBDataset({self.path!r}, shuffle={self.shuffle}, format={self.format!r}, n={self.meta['count']})"
