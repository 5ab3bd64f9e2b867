"""The layout of LMDB files written by tensorpack's ``LMDBSerializer.save``, read without tensorpack.

tensorpack stores datapoint ``i`` under the ASCII key ``"{:08}".format(i)`` (so cursor order is index
order up to 10**8 datapoints) and the list of those keys under ``b"__keys__"``, every value serialized by
tensorpack's ``dumps`` (pickle or msgpack, see :mod:`bridgeflow.serialize.tensorpack_codec`; one file
uses one). The file is a directory (``path/data.mdb``) when ``path`` was an existing folder, else a
single file (with a ``path-lock`` file beside it). There is no count, format name or checksum: the count
is the number of entries less ``__keys__``, checked against the first and last keys, and every key is
checked as it is read.

:func:`lmdb_layout` tells bridgeflow's files from tensorpack's; :func:`read_tensorpack_meta` gives the
same dictionary as :func:`bridgeflow.serialize.lmdb_format.read_lmdb_meta` (``format="tensorpack"``,
``codec`` the serializer); ``TENSORPACK_SEQUENTIAL_LIMIT`` is the count past which keys stop sorting in index
order (9 digits), so readers read by key instead of one cursor pass.

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

from .errors import CorruptDataError

__all__ = ["KEYS_ENTRY", "TENSORPACK_SEQUENTIAL_LIMIT", "lmdb_layout", "read_tensorpack_meta", "tensorpack_key"]

KEYS_ENTRY = b"__keys__"
BRIDGEFLOW_FORMAT_KEY = b"__bf__/format"
TENSORPACK_SEQUENTIAL_LIMIT = 10**8  # beyond this, keys have 9 digits and cursor order is no longer index order


def tensorpack_key(i: int) -> bytes:
    """The key of datapoint ``i`` in a tensorpack LMDB file."""
    return b"%08d" % i


def lmdb_layout(txn: Any) -> str | None:
    """``"bridgeflow"``, ``"tensorpack"`` or ``None`` (another writer) for the file of ``txn``."""
    if txn.get(BRIDGEFLOW_FORMAT_KEY) is not None:
        return "bridgeflow"
    if txn.get(KEYS_ENTRY) is not None:
        return "tensorpack"
    return None


def _not_tensorpack(path: str, why: str) -> CorruptDataError:
    return CorruptDataError(f"{path}: not an LMDB file written by tensorpack's LMDBSerializer.save ({why}); "
                            "LMDBData(path) reads the raw [key, value] pairs of any LMDB file")


def read_tensorpack_meta(path: str, env: Any, *, require_keys_entry: bool = True) -> dict[str, Any]:
    """``{"format": "tensorpack", "codec": "msgpack" | "pickle", "count", "version": None, "checksum": None,
    "classes": None}`` of a tensorpack LMDB file, checked as far as the layout allows (see the module doc).
    """
    from .tensorpack_codec import which_serializer

    with env.begin(buffers=True) as txn:
        if txn.get(BRIDGEFLOW_FORMAT_KEY) is not None:
            raise CorruptDataError(f"{path}: written by bridgeflow's LMDBSerializer, not tensorpack's; load it "
                                   "with LMDBSerializer.load(path) (format=None or 'bridgeflow')")
        entries = txn.stat(env.open_db())["entries"]
        keys = txn.get(KEYS_ENTRY)
        if keys is None and require_keys_entry:
            raise _not_tensorpack(path, f"no {KEYS_ENTRY.decode()} entry")
        count = entries - (keys is not None)
        if count > 0:
            for i in (0, count - 1):
                if txn.get(tensorpack_key(i)) is None:
                    raise _not_tensorpack(path, f"{count} datapoint entries but no key {tensorpack_key(i).decode()!r}")
        if keys is not None and len(keys):
            codec = which_serializer(keys)
        elif count > 0:
            codec = which_serializer(txn.get(tensorpack_key(0)))
        else:
            codec = "msgpack"
    return {"format": "tensorpack", "codec": codec, "version": None, "count": count, "checksum": None,
            "classes": None}
