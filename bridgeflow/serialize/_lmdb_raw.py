"""tensorpack's raw LMDB readers: ``LMDBData`` yields ``[key, value bytes]``, ``LMDBDataDecoder`` maps them.

``LMDBData(lmdb_path, shuffle=True, keys=None)`` reads any LMDB file (a directory or a single file) as
tensorpack's does: in key order, or shuffled over a list of keys, skipping the ``__keys__`` entry that
tensorpack's ``LMDBSerializer.save`` writes. Decoding is left to you: ``LMDBDataDecoder(ds, decoder)``
applies ``decoder(key, value)`` (``None`` drops the datapoint), and the decoding can run in parallel
(``MultiProcessMapData(LMDBData(path), 8, decode)``). ``LMDBDataPoint`` (deprecated, as in tensorpack)
is ``LMDBSerializer.load``.

The reader holds the file it opened and reads it with positioned reads, never through a memory map (a
file cut short while read is an error, not a crash: :mod:`bridgeflow.serialize._lmdb_file`). Files
written by bridgeflow's own
``LMDBSerializer`` are refused here, because their datapoints come from ``LMDBSerializer.load(path)``
(what ``LMDBData(path)`` returned in earlier bridgeflow versions).

Example:
    >>> import lmdb
    >>> with lmdb.open("raw.lmdb", subdir=False) as env, env.begin(write=True) as txn:
    ...     _ = txn.put(b"a", b"123"), txn.put(b"b", b"45")
    >>> ds = LMDBData("raw.lmdb", shuffle=False)
    >>> ds.reset_state(); list(ds)
    [[b'a', b'123'], [b'b', b'45']]
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._base import DataFlow
from .._codec import DECODE_ERRORS
from .._serialize_errors import CorruptDataError, PickleNotAllowedError, UnsupportedFormatError
from .._transforms import MapData
from ._common import normalize_index
from ._lmdb_file import PinnedLMDB, check_verify
from ._lmdb_tree import written_error
from ._tensorpack_codec import decode_tensorpack, which_serializer
from ._tensorpack_lmdb import KEYS_ENTRY, datapoint_numbers, lmdb_layout

__all__ = ["LMDBData", "LMDBDataDecoder", "LMDBDataPoint"]

log = logging.getLogger(__name__)


def _as_key(k: Any, i: int) -> bytes:
    if isinstance(k, bytes):
        return k
    if isinstance(k, str):
        return k.encode("utf-8")
    if isinstance(k, (bytearray, memoryview)):
        return bytes(k)
    raise TypeError(f"LMDBData: keys[{i}] is a {type(k).__name__}; keys are bytes or str")


class LMDBData(PinnedLMDB):
    """``[key, value]`` pairs (both ``bytes``) of an LMDB file, as tensorpack's ``LMDBData`` yields them.

    Args:
        lmdb_path: an LMDB directory or single file.
        shuffle: ``False``: every entry in key order. ``True``: the keys in a new random order each epoch.
        keys: used when ``shuffle`` is true (as in tensorpack): a list of keys (``bytes`` or ``str``) or a
            format string such as ``"{:08}"`` formatted with ``0 .. entries-1``. By default, the keys of the
            file.
        seed: makes the shuffled orders reproducible.
        verify: deprecated, does nothing (the pages are always checked; nothing is memory-mapped).

    ``len()`` is the number of pairs an epoch yields: the entries less ``__keys__``, or ``len(keys)``
    when ``keys`` is given and ``shuffle`` is true. ``ds[i]`` is the pair of the ``i``-th key. A key that
    is missing from the file raises :class:`CorruptDataError` (a key you gave: ``KeyError``), naming it.
    The file's tree is walked once, when the reader is made (every page checked, every key and where its
    value lies kept: about 24 bytes plus the key's length per entry); a value is one positioned read.

    Its state (``state_dict()``) is the default count and skip: the generator's state at the start of the
    epoch and the pairs handed out since; resuming reads those pairs again and drops them.
    """

    def __init__(self, lmdb_path: str | os.PathLike, shuffle: bool = True,
                 keys: Sequence[bytes | str] | str | None = None, *, seed: int | None = None,
                 verify: bool | None = None) -> None:
        if keys is not None and not isinstance(keys, (str, Sequence)) or isinstance(keys, bytes):
            raise TypeError(f"LMDBData: keys must be a list of keys or a format string like '{{:08}}', got {keys!r}")
        check_verify(verify, "LMDBData")
        self.shuffle = bool(shuffle)
        self.seed = seed
        self._open_pinned(lmdb_path, "LMDBData")
        try:
            tree = self._walk()
            layout = lmdb_layout(tree)
            keys_at = tree.find(KEYS_ENTRY)
            self.serializer = None
            if keys_at is not None and tree.sizes[keys_at]:
                self.serializer = which_serializer(tree.read(self._pin, keys_at, self.path))
        except BaseException:
            self._abandon()
            raise
        if layout == "bridgeflow":
            self._abandon()
            raise UnsupportedFormatError(
                f"{self.path} was written by bridgeflow's LMDBSerializer: load its datapoints with "
                "LMDBSerializer.load(path) (what LMDBData(path) returned in earlier bridgeflow versions). LMDBData now "
                "yields tensorpack's raw [key, value bytes] pairs, which for this file would be encoded bytes")
        self._tree = tree
        entries = np.arange(len(tree))
        self._entries = entries if keys_at is None else np.delete(entries, keys_at)  # the file's pairs, in order
        self._given: list[bytes] | None = None
        if keys is not None and self.shuffle:
            if isinstance(keys, str):
                self._given = [keys.format(i).encode("utf-8") for i in range(len(self._entries))]
            else:
                self._given = [_as_key(k, i) for i, k in enumerate(keys)]
        self._numbered = layout == "tensorpack" and bool((datapoint_numbers(tree, self._entries) ==
                                                          np.arange(len(self._entries))).all())
        self._all_keys: list[bytes] | None = None

    def __len__(self) -> int:
        return len(self._given) if self._given is not None else len(self._entries)

    def keys(self) -> list[bytes]:
        """The keys, in the order ``ds[i]`` uses (the given keys, else the file's key order)."""
        if self._given is not None:
            return self._given
        if self._all_keys is None:
            self._all_keys = [self._tree.key(int(j)) for j in self._entries]
        return self._all_keys

    def _entry(self, key: bytes) -> int:
        """The entry of a given key: found from its number in tensorpack's layout, else by bisection."""
        j = None
        if self._numbered and key.isdigit() and (len(key) == 8 or key[:1] != b"0") and \
                int(key) < len(self._entries):
            j = int(self._entries[int(key)])
        if j is None or self._tree.key(j) != key:
            j = self._tree.find(key)
        if j is None or key == KEYS_ENTRY:
            if self._given is not None:
                raise KeyError(f"{self.path}: no key {key!r} (one of the keys given to LMDBData)")
            raise CorruptDataError(f"{self.path}: key {key!r} is missing; the file changed or is damaged")
        return j

    def _pair(self, fd: int, j: int, key: bytes | None = None) -> list[bytes]:
        off, n = int(self._tree.offsets[j]), int(self._tree.sizes[j])
        value = os.pread(fd, n, off)
        key = self._tree.key(j) if key is None else key
        if len(value) != n:
            raise self._cut(off, n, f"the value of key {key!r}")
        if not self._tree.unchanged(fd):  # a writer may have put another key's value there since
            raise written_error(self._pin, self.path, self._tree.txnid)
        return [key, value]

    def __getitem__(self, index: int) -> list[bytes]:
        i = normalize_index(index, len(self), "LMDBData")
        if self._given is None:
            return self._pair(self._fd(), int(self._entries[i]))
        key = self._given[i]
        return self._pair(self._fd(), self._entry(key), key)

    def _iter_epoch(self) -> Iterator[list[bytes]]:
        fd = self._fd()
        if self.shuffle and self._given is not None:
            keys = self._given
            for i in self.rng.permutation(len(keys)).tolist():
                yield self._pair(fd, self._entry(keys[i]), keys[i])
            return
        entries = self._entries.tolist()
        order = self.rng.permutation(len(entries)).tolist() if self.shuffle else range(len(entries))
        for i in order:
            yield self._pair(fd, entries[i])

    def __repr__(self) -> str:
        return f"LMDBData({self.path!r}, shuffle={self.shuffle}, n={len(self)})"


def _apply_decoder(decoder: Callable[[bytes, bytes], Any], dp: list) -> Any:
    return decoder(dp[0], dp[1])


class LMDBDataDecoder(MapData):
    """``decoder(key, value)`` applied to every pair of an :class:`LMDBData`; ``None`` drops the pair.

    Example:
        >>> import lmdb
        >>> with lmdb.open("pairs.lmdb", subdir=False) as env, env.begin(write=True) as txn:
        ...     _ = txn.put(b"a", b"123"), txn.put(b"b", b"45")
        >>> ds = LMDBDataDecoder(LMDBData("pairs.lmdb", shuffle=False), lambda k, v: [k.decode(), len(v)])
        >>> ds.reset_state(); list(ds)
        [['a', 3], ['b', 2]]
    """

    def __init__(self, lmdb_data: DataFlow, decoder: Callable[[bytes, bytes], Any]) -> None:
        if not callable(decoder):
            raise TypeError(f"LMDBDataDecoder needs a callable decoder(key, value), got {decoder!r}")
        self.decoder = decoder
        super().__init__(lmdb_data, functools.partial(_apply_decoder, decoder))


def _decode_pair(path: str, serializer: str | None, allow_pickle: bool, dp: list) -> Any:
    key, value = dp
    try:
        return decode_tensorpack(value, allow_pickle=allow_pickle, serializer=serializer)
    except DECODE_ERRORS as exc:
        raise type(exc)(f"{path}: key {key!r}: {exc}") from exc


def LMDBDataPoint(lmdb_path: str | os.PathLike | LMDBData, shuffle: bool = True,
                  keys: Sequence[bytes | str] | str | None = None, *, allow_pickle: bool = False) -> DataFlow:
    """Deprecated (as in tensorpack): the decoded datapoints of a tensorpack LMDB file; use
    ``LMDBSerializer.load(path, shuffle)``.

    ``lmdb_path`` may be an :class:`LMDBData` (then alone): its values are decoded with tensorpack's
    serializers (msgpack safely; pickle only with ``allow_pickle=True``).
    """
    warnings.warn("LMDBDataPoint is deprecated, as in tensorpack: use LMDBSerializer.load(path, shuffle=...)",
                  DeprecationWarning, stacklevel=2)
    if isinstance(lmdb_path, LMDBData):
        if keys is not None or shuffle is not True:
            raise TypeError("LMDBDataPoint(lmdb_data) takes no other arguments (as in tensorpack)")
        ds = lmdb_path
    elif keys is None:
        from ._lmdb_format import LMDBSerializer

        return LMDBSerializer.load(lmdb_path, shuffle=shuffle, allow_pickle=allow_pickle, format="tensorpack")
    else:
        ds = LMDBData(lmdb_path, shuffle, keys)
    if ds.serializer == "pickle" and not allow_pickle:
        path = ds.path
        ds.close()
        raise PickleNotAllowedError(f"{path} holds pickled values (tensorpack's default serializer): pass "
                                    "allow_pickle=True to decode them, only if you trust the file")
    return MapData(ds, functools.partial(_decode_pair, ds.path, ds.serializer, allow_pickle))
