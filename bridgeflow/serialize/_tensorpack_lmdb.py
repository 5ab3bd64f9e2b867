"""The layout of LMDB files written by tensorpack's ``LMDBSerializer.save``, read without tensorpack.

tensorpack stores datapoint ``i`` under the ASCII key ``"{:08}".format(i)`` (so cursor order is index
order up to 10**8 datapoints) and the list of those keys under ``b"__keys__"``, every value serialized by
tensorpack's ``dumps`` (pickle or msgpack, see :mod:`bridgeflow.serialize._tensorpack_codec`; one file
uses one). The file is a directory (``path/data.mdb``) when ``path`` was an existing folder, else a
single file (with a ``path-lock`` file beside it). There is no count, format name or checksum: the count
is the number of entries less ``__keys__``, and every key is checked when the file is opened: the keys
must be exactly those of datapoints ``0 .. count-1``.

:func:`lmdb_layout` tells bridgeflow's files from tensorpack's; :func:`tensorpack_index` finds each
datapoint's entry and gives the same dictionary as :func:`bridgeflow.serialize._lmdb_format.read_lmdb_meta`
(``format="tensorpack"``, ``codec`` the serializer); ``TENSORPACK_SEQUENTIAL_LIMIT`` is the count past which
keys stop sorting in index order (9 digits), so datapoints are found by their number instead.

Example:
    >>> import lmdb, msgpack
    >>> from bridgeflow.serialize import LMDBSerializer
    >>> with lmdb.open("tp.lmdb", subdir=False) as env, env.begin(write=True) as txn:  # as tensorpack writes
    ...     for i in range(2):
    ...         _ = txn.put(tensorpack_key(i), msgpack.dumps([i, "x"]))
    ...     _ = txn.put(KEYS_ENTRY, msgpack.dumps([tensorpack_key(i) for i in range(2)]))
    >>> ds = LMDBSerializer.load("tp.lmdb", shuffle=False)
    >>> ds.meta["format"], ds.meta["codec"], ds[1]
    ('tensorpack', 'msgpack', [1, 'x'])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._serialize_errors import CorruptDataError
from ._lmdb_tree import LMDBTree
from ._pinned import PinnedFile

__all__ = ["KEYS_ENTRY", "TENSORPACK_SEQUENTIAL_LIMIT", "datapoint_numbers", "lmdb_layout", "tensorpack_index",
           "tensorpack_key"]

KEYS_ENTRY = b"__keys__"
BRIDGEFLOW_FORMAT_KEY = b"__bf__/format"
TENSORPACK_SEQUENTIAL_LIMIT = 10**8  # beyond this, keys have 9 digits and cursor order is no longer index order
_ROWS = 1 << 16


def tensorpack_key(i: int) -> bytes:
    """The key of datapoint ``i`` in a tensorpack LMDB file."""
    return b"%08d" % i


def lmdb_layout(tree: LMDBTree) -> str | None:
    """``"bridgeflow"``, ``"tensorpack"`` or ``None`` (another writer) for the file of ``tree``."""
    if tree.find(BRIDGEFLOW_FORMAT_KEY) is not None:
        return "bridgeflow"
    if tree.find(KEYS_ENTRY) is not None:
        return "tensorpack"
    return None


def _not_tensorpack(path: str, why: str) -> CorruptDataError:
    return CorruptDataError(f"{path}: not an LMDB file written by tensorpack's LMDBSerializer.save ({why}); "
                            "LMDBData(path) reads the raw [key, value] pairs of any LMDB file")


def datapoint_numbers(tree: LMDBTree, entries: np.ndarray) -> np.ndarray:
    """The datapoint number of each of ``entries`` from its key (``"{:08}"``), or -1 for a key that is not
    one tensorpack writes (not decimal digits, or not as ``"{:08}"`` formats a number)."""
    lengths = tree.key_lengths()[entries]
    starts = tree.key_ends[entries] - lengths
    out = np.full(len(entries), -1, np.int64)
    for n in np.unique(lengths).tolist():
        if not 8 <= n <= 18:
            continue
        every = np.flatnonzero(lengths == n)
        for at in range(0, len(every), _ROWS):  # a few rows at a time: 16 bytes of index per key byte
            rows = every[at:at + _ROWS]
            digits = tree.keys[starts[rows][:, None] + np.arange(n)].astype(np.int64) - ord("0")
            ok = ((digits >= 0) & (digits <= 9)).all(axis=1)
            if n > 8:
                ok &= digits[:, 0] != 0  # "{:08}" pads to 8 digits only
            out[rows[ok]] = digits[ok] @ (10 ** np.arange(n - 1, -1, -1, dtype=np.int64))
    return out


def tensorpack_index(tree: LMDBTree, pin: PinnedFile, path: str, *,
                     require_keys_entry: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """``(entry of each datapoint, meta)`` of a tensorpack LMDB file: ``meta`` is ``{"format": "tensorpack",
    "codec": "msgpack" | "pickle", "count", "version": None, "checksum": None, "classes": None}``. Every key
    is checked (see the module doc): a missing, extra or damaged one is a :class:`CorruptDataError`.
    """
    from ._tensorpack_codec import which_serializer

    if tree.find(BRIDGEFLOW_FORMAT_KEY) is not None:
        raise CorruptDataError(f"{path}: written by bridgeflow's LMDBSerializer, not tensorpack's; load it "
                               "with LMDBSerializer.load(path) (format=None or 'bridgeflow')")
    keys_at = tree.find(KEYS_ENTRY)
    if keys_at is None and require_keys_entry:
        raise _not_tensorpack(path, f"no {KEYS_ENTRY.decode()} entry")
    entries = np.arange(len(tree))
    if keys_at is not None:
        entries = np.delete(entries, keys_at)
    count = len(entries)
    numbers = datapoint_numbers(tree, entries)
    if count <= TENSORPACK_SEQUENTIAL_LIMIT:  # key order is datapoint order
        bad = np.flatnonzero(numbers != np.arange(count))
        if len(bad):
            i = int(bad[0])
            raise _not_tensorpack(path, f"key {tree.key(int(entries[i]))!r} where key {tensorpack_key(i)!r} "
                                        f"belongs, {count} datapoint entries")
    else:  # 9-digit keys sort among the 8-digit ones: datapoint order is found by number
        found = np.zeros(count, bool)
        inside = (numbers >= 0) & (numbers < count)
        found[numbers[inside]] = True
        if not inside.all() or not found.all() or len(np.unique(numbers)) != count:
            raise _not_tensorpack(path, f"its {count} datapoint keys are not {tensorpack_key(0)!r} to "
                                        f"{tensorpack_key(count - 1)!r}")
        order = np.empty(count, np.int64)
        order[numbers] = entries
        entries = order
    if keys_at is not None and tree.sizes[keys_at]:
        codec = which_serializer(tree.read(pin, keys_at, path))
    elif count > 0:
        codec = which_serializer(tree.read(pin, int(entries[0]), path))
    else:
        codec = "msgpack"
    meta = {"format": "tensorpack", "codec": codec, "version": None, "count": count, "checksum": None,
            "classes": None}
    return entries, meta
