"""LMDB datasets: one encoded datapoint per key, read by one cursor pass or by random access.

Layout: a single file (``foo.lmdb``, LMDB's ``subdir=False`` mode; no ``-lock`` file is kept). Datapoint
``i`` is stored under the 8-byte big-endian key ``i``, so cursor order is index order; metadata keys start
with ``__bf__/`` (they sort after every datapoint): ``format``, ``codec``, ``version``, ``count``.
``load`` also reads an LMDB *directory* (``data.mdb`` inside) written the same way.

Each value is one :func:`bridgeflow.serialize.codec.encode` buffer (followed by its 4-byte CRC-32 when
saved with ``checksum=True``; the ``__bf__/checksum`` key says so). Reading checks the value's length
against the length its header declares, copies it once out of the memory map into a ``bytearray`` and
decodes zero-copy, so arrays are writable, owned by the datapoint and valid after the file is closed.

Damage: truncated files, foreign files, damaged metadata and damaged values raise
:class:`CorruptDataError` naming the path. LMDB trusts its own B-tree pages (damage there would crash the
reader with SIGBUS), so ``LMDBData`` first walks the tree with plain reads and checks every page, offset
and size (``verify=None``: when the tree is at most 256 MiB of pages, i.e. always for datasets of large
values; ``verify=True`` forces it). The count, the keys and every value's structure are checked on
read, but LMDB keeps no checksums of its own: without ``checksum=True`` a changed byte inside array data
or a string reads back as a changed value. ``checksum=True`` makes such damage an error too, at the cost
of a CRC-32 over every value read (about 4 GB/s: for large arrays it costs more than the read itself).

Example:
    >>> LMDBSerializer.save(df, "train.lmdb")                      # doctest: +SKIP
    >>> ds = LMDBSerializer.load("train.lmdb", shuffle=True, seed=0)  # doctest: +SKIP
    >>> len(ds), ds[0]                                            # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import Any

from .._deps import require
from ..base import DataFlow
from ..order import IndexedSource
from ._common import existing_path, iterate_source, normalize_index
from ._lmdb_check import check_lmdb_file, tree_pages
from .atomic import atomic_path
from .codec import CODECS, DECODE_ERRORS, DEFAULT_CODEC, FORMAT_VERSION, TOTAL, decode, encode
from .errors import CorruptDataError, PickleNotAllowedError, UnsupportedFormatError

__all__ = ["LMDBData", "LMDBSerializer", "read_lmdb_meta"]

log = logging.getLogger(__name__)

FORMAT_NAME = b"bridgeflow-lmdb"
META = b"__bf__/"
_KEY = struct.Struct(">Q")
_CRC = struct.Struct("<I")
CHECKSUM = b"crc32"
_INITIAL_MAP = 256 << 20
_BATCH_BYTES = 64 << 20  # commit at least this often, whatever write_frequency says
_VERIFY_MAX_PAGES = 65536  # verify=None checks trees of up to this many branch+leaf pages


def _key(i: int) -> bytes:
    return _KEY.pack(i)


def _wrap(path: str, exc: Exception, doing: str) -> CorruptDataError:
    return CorruptDataError(f"{path}: {doing} failed ({type(exc).__name__}: {exc}); is it a complete "
                            "LMDB file written by LMDBSerializer?")


class LMDBSerializer:
    """Save a flow to an LMDB file and load it back (tensorpack-compatible names)."""

    @staticmethod
    def save(df: DataFlow, path: str | os.PathLike, write_frequency: int = 5000, *,
             codec: str = DEFAULT_CODEC, overwrite: bool = False, progress: bool = True,
             checksum: bool = False) -> int:
        """Encode every datapoint of ``df`` into the single-file LMDB ``path``; returns the count.

        Commits every ``write_frequency`` datapoints (or 64 MiB, whichever comes first). The map grows
        as needed. Written to a temporary file beside ``path`` and renamed at the end: an error or Ctrl-C
        leaves nothing behind. ``codec="pickle"`` stores any picklable object (readers must opt in).
        ``checksum=True`` stores a CRC-32 with every value, checked on every read (see the module doc).
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
                                   bool(checksum))
                env.sync(True)
            finally:
                env.close()
        log.info("saved %d datapoints to %s", count, os.fspath(path))
        return count

    @staticmethod
    def load(path: str | os.PathLike, shuffle: bool = True, *, seed: int | None = None,
             allow_pickle: bool = False, verify: bool | None = None, shard: tuple[int, int] | str | None = None,
             drop_last: bool = False) -> LMDBData:
        """The flow of datapoints stored at ``path`` (see :class:`LMDBData`); ``shard=(rank, world)`` or
        ``"auto"`` reads this rank's part only."""
        return LMDBData(path, shuffle=shuffle, seed=seed, allow_pickle=allow_pickle, verify=verify, shard=shard,
                        drop_last=drop_last)


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


def _write_all(lmdb: Any, env: Any, df: DataFlow, codec: str, every: int, progress: bool, name: str,
               checksum: bool) -> int:
    pending: list[tuple[bytes, bytes]] = []
    size = count = 0
    for dp in iterate_source(df, progress=progress, desc=f"LMDB {os.path.basename(name)}"):
        value = encode(dp, codec=codec)
        if checksum:
            value += _CRC.pack(zlib.crc32(value))
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
    _commit(lmdb, env, [(META + k, v) for k, v in meta.items()], append=False)
    return count


def _open_env(path: str, readahead: bool = False) -> Any:
    lmdb = require("lmdb", "LMDBSerializer")
    subdir = os.path.isdir(path)
    try:
        env = lmdb.open(path, subdir=subdir, readonly=True, lock=False, readahead=readahead, meminit=False,
                        max_readers=2048)
    except lmdb.Error as exc:
        raise _wrap(path, exc, "opening") from exc
    # A truncated file would make LMDB touch pages past its end (SIGBUS): check the size first.
    data = os.path.join(path, "data.mdb") if subdir else path
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = os.path.getsize(data)
    if have < need:
        env.close()
        raise CorruptDataError(f"{path}: truncated LMDB file ({have} bytes, its pages need {need})")
    return env


# LMDB allows one open handle per file per process: flows reading one file share it, counted.
_envs: dict[str, list] = {}  # realpath -> [env, users]
_envs_pid = os.getpid()
_envs_lock = threading.Lock()


def _acquire_env(path: str, readahead: bool) -> Any:
    global _envs_pid
    with _envs_lock:
        if _envs_pid != os.getpid():
            # Handles inherited through fork must not be used; closing them is safe here because they
            # are read-only and lock-free (no reader slot to release): it only unmaps this process's
            # copy, and lets py-lmdb open the file again.
            for env, _users in _envs.values():
                env.close()
            _envs.clear()
            _envs_pid = os.getpid()
        key = os.path.realpath(path)
        entry = _envs.get(key)
        if entry is None:
            entry = _envs[key] = [_open_env(path, readahead), 0]
        entry[1] += 1
        return entry[0]


def _release_env(path: str, env: Any) -> None:
    with _envs_lock:
        entry = _envs.get(os.path.realpath(path))
        if _envs_pid != os.getpid() or entry is None or entry[0] is not env:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _envs[os.path.realpath(path)]
            env.close()


def read_lmdb_meta(path: str | os.PathLike, env: Any = None) -> dict[str, Any]:
    """``{"format", "codec", "version", "count", "checksum"}`` of an LMDB dataset; checks they are ones we
    read (``checksum`` is ``"crc32"`` or ``None``)."""
    p = existing_path(path, "LMDB dataset")
    lmdb = require("lmdb", "LMDBSerializer")
    own = env is None
    env = _acquire_env(p, False) if own else env
    try:
        with env.begin(buffers=True) as txn:
            raw = {}
            for k in (b"format", b"codec", b"version", b"count", b"checksum"):
                v = txn.get(META + k)
                raw[k] = None if v is None or len(v) > 64 else bytes(v)  # a damaged size: never copy it
            entries = txn.stat(env.open_db())["entries"]
            meta_keys = _count_meta_keys(txn)
    except lmdb.Error as exc:
        raise _wrap(p, exc, "reading metadata") from exc
    finally:
        if own:
            _release_env(p, env)
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
    return {"format": FORMAT_NAME.decode(), "codec": codec, "version": version, "count": count,
            "checksum": None if raw[b"checksum"] is None else CHECKSUM.decode()}


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


class LMDBData(IndexedSource):
    """Datapoints of an LMDB dataset: ``len()``, ``ds[i]``, and iteration in order or shuffled.

    Sequential epochs are one cursor pass; shuffled epochs read keys in a permutation drawn from
    ``seed`` each epoch. The file is opened lazily, in ``reset_state()`` or on first access, and again
    in any process that finds a handle inherited through ``fork`` (LMDB handles must not cross fork),
    so many processes can read one file. Read-only, no lock file, readahead off when shuffled.

    Args:
        path: a single-file LMDB (``foo.lmdb``) or an LMDB directory.
        shuffle: a new random order every epoch.
        seed: makes the shuffled orders reproducible.
        allow_pickle: needed to read files saved with ``codec="pickle"`` (unpickling can run code).
        verify: check the file's pages before mapping it (see the module doc); ``None`` = when cheap.
        shard: ``(rank, world)`` or ``"auto"``: read only this rank's contiguous part of every epoch's
            order, all ranks equally long (``drop_last`` drops the remainder instead of wrapping around;
            see :mod:`bridgeflow.shard`). Shuffled shards need the same ``seed`` on every rank.

    ``state_dict()`` is the epoch, the position and the shuffle's entropy (see :mod:`bridgeflow.order`).
    """

    def __init__(self, path: str | os.PathLike, shuffle: bool = True, seed: int | None = None, *,
                 allow_pickle: bool = False, verify: bool | None = None, shard: tuple[int, int] | str | None = None,
                 drop_last: bool = False) -> None:
        self.path = existing_path(path, "LMDBData")
        self.shuffle = shuffle
        self.seed = seed
        self.allow_pickle = allow_pickle
        data = os.path.join(self.path, "data.mdb") if os.path.isdir(self.path) else self.path
        self.verified = bool(verify or (verify is None and tree_pages(data) <= _VERIFY_MAX_PAGES))
        if self.verified:  # every value size now lies inside the file: copying a value cannot fault
            check_lmdb_file(data, self.path)
        self.meta = read_lmdb_meta(self.path)
        if self.meta["codec"] == "pickle" and not allow_pickle:
            raise PickleNotAllowedError(f"{self.path} was saved with codec='pickle'; pass allow_pickle=True "
                                        "to load it, only if you trust the file (unpickling can run code)")
        # a value of a bridgeflow-codec file that claims to be a pickle is damage, never unpickled
        self._unpickle = allow_pickle and self.meta["codec"] == "pickle"
        self._crc = self.meta["checksum"] is not None
        self._env: Any = None
        self._pid: int | None = None
        self._init_order(self.meta["count"], shuffle, shard, drop_last)

    def __len__(self) -> int:
        return self._order.length()

    def _identity(self) -> dict:
        data = os.path.join(self.path, "data.mdb") if os.path.isdir(self.path) else self.path
        return {"count": self.meta["count"], "bytes": os.path.getsize(data)}

    def _environment(self) -> Any:
        if self._env is None or self._pid != os.getpid():
            self._env = _acquire_env(self.path, readahead=not self.shuffle)
            self._pid = os.getpid()
        return self._env

    def reset_state(self) -> None:
        super().reset_state()
        self._environment()

    def _decode(self, value: Any, index: int) -> Any:
        if value is None:
            raise CorruptDataError(f"{self.path}: datapoint {index} is missing (count says {self.meta['count']})")
        try:
            return decode(self._payload(value), allow_pickle=self._unpickle)
        except DECODE_ERRORS as exc:
            raise self._damaged(index, exc) from exc

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
        if zlib.crc32(data) != _CRC.unpack_from(value, n)[0]:
            raise CorruptDataError("checksum mismatch: the stored value is damaged")
        return data

    def _damaged(self, index: int, exc: Exception) -> CorruptDataError:
        """A stored value that does not decode: the file's metadata names its codec and version, so a
        value claiming another (or a pickle in a bridgeflow-codec file) is damage too."""
        return CorruptDataError(f"{self.path}: datapoint {index}: {exc}")

    def __getitem__(self, index: int) -> Any:
        i = self._order.shard_index(normalize_index(index, len(self), "LMDBData"))
        lmdb = require("lmdb", "LMDBData")
        try:
            with self._environment().begin(buffers=True) as txn:
                return self._decode(txn.get(_key(i)), i)
        except lmdb.Error as exc:
            raise _wrap(self.path, exc, f"reading datapoint {i}") from exc

    def _read(self, runs: list, pos: int) -> Iterator[Any]:
        lmdb = require("lmdb", "LMDBData")
        env = self._environment()
        try:
            with env.begin(buffers=True) as txn:
                for it, run, skip in self._order.iters(runs, pos):
                    if self.shuffle:
                        get = txn.get
                        for i in it:
                            yield self._decode(get(_key(i)), i)
                    else:
                        yield from self._read_run(txn, it, run.start + skip, run.stop)
        except lmdb.Error as exc:
            raise _wrap(self.path, exc, "reading") from exc

    def _read_run(self, txn: Any, indices: Iterator[int], first: int, stop: int) -> Iterator[Any]:
        """Datapoints ``first:stop`` by one cursor pass; ``indices`` counts them off (the position)."""
        cursor = txn.cursor()
        if not cursor.set_key(_key(first)):
            raise CorruptDataError(f"{self.path}: datapoint {first} is missing (count says {self.meta['count']})")
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

    def close(self) -> None:
        env, self._env = self._env, None
        if env is not None and self._pid == os.getpid():
            _release_env(self.path, env)
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_env"] = None
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        return f"LMDBData({self.path!r}, shuffle={self.shuffle}, n={self.meta['count']})"
