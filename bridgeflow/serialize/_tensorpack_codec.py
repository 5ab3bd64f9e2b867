"""Values serialized by tensorpack's ``dumps``: msgpack with msgpack-numpy's array maps, or pickle.

tensorpack (``tensorpack.utils.serialize``) stores a datapoint with ``pickle.dumps(dp, protocol=-1)``
(its default since 0.9.x: ``TENSORPACK_SERIALIZE=pickle``) or with ``msgpack.dumps(dp, use_bin_type=True)``
after ``msgpack_numpy.patch()`` (``TENSORPACK_SERIALIZE=msgpack``, and older versions). msgpack-numpy
writes a numpy array as the map ``{b"nd": True, b"type": dtype.str, b"kind": b"", b"shape": [...],
b"data": raw bytes}``, a numpy scalar as ``{b"nd": False, b"type": ..., b"data": ...}`` and a Python
complex as ``{b"complex": True, b"data": repr}``; an *object* array (``kind == b"O"``) is itself a pickle.

:func:`decode_tensorpack` reads msgpack values with its own handling of those maps, so nothing in a
msgpack value can run code: an object array is refused unless ``allow_pickle=True``. A pickled value is
recognised by its first bytes and unpickled only with ``allow_pickle=True``. Decoded arrays are writable
copies; tuples come back as lists, as they do from tensorpack's ``loads``.

Example:
    >>> import msgpack
    >>> decode_tensorpack(msgpack.dumps([1, "a"], use_bin_type=True))
    [1, 'a']
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import numpy as np

from .._deps import require
from .._errors import MissingDependencyError
from .._serialize_errors import CorruptDataError, PickleNotAllowedError

__all__ = ["SERIALIZERS", "decode_tensorpack", "is_pickle", "which_serializer"]

SERIALIZERS = ("msgpack", "pickle")

_ND, _TYPE, _KIND, _SHAPE, _DATA, _COMPLEX = (b"nd", b"type", b"kind", b"shape", b"data", b"complex")
_MISSING = object()
_MAX_DTYPE_DEPTH = 8


def is_pickle(buf: Any) -> bool:
    """Whether ``buf`` starts like a pickle of protocol 2 or later (what ``pickle.dumps(x, -1)`` writes).

    An msgpack value never starts so: ``0x80`` is msgpack's empty map, which is a whole value by itself.
    """
    head = bytes(memoryview(buf)[:2])
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def which_serializer(buf: Any) -> str:
    """``"pickle"`` or ``"msgpack"``: the serializer that wrote one of tensorpack's values."""
    return "pickle" if is_pickle(buf) else "msgpack"


def _get(obj: dict, key: bytes) -> Any:
    """``obj[key]`` with ``key`` as bytes (msgpack-numpy since 0.4) or str (older writers), else _MISSING."""
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        value = obj.get(key.decode("ascii"), _MISSING)
    return value


def _text(x: Any, what: str) -> str:
    if isinstance(x, bytes):
        return x.decode("ascii")
    if isinstance(x, str):
        return x
    raise CorruptDataError(f"msgpack-numpy {what} is a {type(x).__name__}, not a string")


def _dtype(descr: Any, depth: int = 0) -> np.dtype:
    """The dtype msgpack-numpy stored: a type string, or a structured description ``[[name, type, *shape]]``."""
    if depth > _MAX_DTYPE_DEPTH:
        raise CorruptDataError("msgpack-numpy dtype nested too deeply")
    if isinstance(descr, (list, tuple)):
        fields = []
        for field in descr:
            if not isinstance(field, (list, tuple)) or len(field) < 2:
                raise CorruptDataError(f"msgpack-numpy structured dtype field {field!r} is malformed")
            shape = tuple(int(n) for n in field[2:]) if len(field) > 2 else ()
            fields.append((_text(field[0], "field name"), _dtype(field[1], depth + 1), *((shape,) if shape else ())))
        dt = np.dtype(fields)
    else:
        dt = np.dtype(_text(descr, "dtype"))
    if dt.hasobject:  # an object dtype cannot come from raw bytes (it would be pointers)
        raise CorruptDataError(f"msgpack-numpy array of dtype {dt} holds Python objects without a pickle")
    return dt


def _array(obj: dict, allow_pickle: bool) -> Any:
    kind, data = _get(obj, _KIND), _get(obj, _DATA)
    if kind in (b"O", "O"):  # msgpack-numpy pickles object arrays
        if not allow_pickle:
            raise PickleNotAllowedError("a numpy object array, which msgpack-numpy stores as a pickle: pass "
                                        "allow_pickle=True to read it, only if you trust the file (unpickling "
                                        "can run code)")
        return pickle.loads(data)
    descr, shape = _get(obj, _TYPE), _get(obj, _SHAPE)
    if descr is _MISSING or shape is _MISSING or data is _MISSING:
        return obj  # as msgpack-numpy does: a map that only looks like an array stays a map
    if not isinstance(data, bytes) or not isinstance(shape, (list, tuple)):
        raise CorruptDataError("msgpack-numpy array with malformed data or shape")
    dims = []
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CorruptDataError(f"msgpack-numpy array with shape {shape!r}")
        dims.append(n)
    dt = _dtype(descr)
    count = math.prod(dims)
    if count * dt.itemsize != len(data):
        raise CorruptDataError(f"msgpack-numpy array of shape {tuple(dims)} and dtype {dt} needs "
                               f"{count * dt.itemsize} bytes, the value holds {len(data)}")
    return np.frombuffer(data, dtype=dt, count=count).reshape(dims).copy()  # writable, owned


def _scalar(obj: dict) -> Any:
    descr, data = _get(obj, _TYPE), _get(obj, _DATA)
    if descr is _MISSING or data is _MISSING:
        return obj
    dt = _dtype(descr)
    if not isinstance(data, bytes) or len(data) != dt.itemsize:
        raise CorruptDataError(f"msgpack-numpy scalar of dtype {dt} with {len(data)} bytes of data")
    return np.frombuffer(data, dtype=dt, count=1)[0]


def _object_hook(allow_pickle: bool):
    def hook(obj: dict) -> Any:
        nd = _get(obj, _ND)
        if nd is True:
            return _array(obj, allow_pickle)
        if nd is False:
            return _scalar(obj)
        if _get(obj, _COMPLEX) is True:
            data = _get(obj, _DATA)
            if data is _MISSING:
                return obj
            return complex(_text(data, "complex number"))
        return obj

    return hook


def _refuse_ext(code: int, data: bytes) -> Any:
    raise CorruptDataError(f"msgpack extension type {code}, which tensorpack never writes")


def _decode_msgpack(buf: Any, allow_pickle: bool) -> Any:
    msgpack = require("msgpack", "reading tensorpack's msgpack values")
    # Sizes are bounded by the buffer itself (msgpack >= 1.0): a damaged length cannot make it allocate more.
    return msgpack.unpackb(buf, raw=False, strict_map_key=False, use_list=True,
                           object_hook=_object_hook(allow_pickle), ext_hook=_refuse_ext)


_NUMPY2 = int(np.__version__.split(".")[0]) >= 2


class _Unpickler(pickle.Unpickler):
    """tensorpack's pickles name numpy 1's ``numpy.core``, which numpy 2 keeps as a shim warning on every
    first use; the names are looked up where numpy 2 keeps them (``numpy._core``)."""

    def find_class(self, module: str, name: str) -> Any:
        if _NUMPY2 and (module == "numpy.core" or module.startswith("numpy.core.")):
            module = "numpy._core" + module[len("numpy.core"):]
        return super().find_class(module, name)


def decode_tensorpack(buf: Any, *, allow_pickle: bool = False, serializer: str | None = None) -> Any:
    """Decode one value written by tensorpack's ``dumps`` (see the module doc).

    ``serializer``: ``"msgpack"``, ``"pickle"`` or ``None`` (recognised from the value's first bytes).
    Anything that does not decode raises :class:`CorruptDataError`; a pickle (or an object array inside
    msgpack) without ``allow_pickle=True`` raises :class:`PickleNotAllowedError`.
    """
    if serializer is None:
        serializer = which_serializer(buf)
    elif serializer not in SERIALIZERS:
        raise ValueError(f"unknown tensorpack serializer {serializer!r}; choose one of {list(SERIALIZERS)}")
    if serializer == "pickle":
        if not is_pickle(buf):
            raise CorruptDataError("not a pickle (the value does not start with a pickle protocol header)")
        if not allow_pickle:
            raise PickleNotAllowedError("a pickled value (tensorpack's default serializer, "
                                        "TENSORPACK_SERIALIZE=pickle): pass allow_pickle=True to read it, only if "
                                        "you trust the data (unpickling can run code)")
        try:
            return _Unpickler(io.BytesIO(buf)).load()
        except Exception as exc:  # whatever a damaged pickle raises
            raise CorruptDataError(f"cannot unpickle the value: {type(exc).__name__}: {exc}") from exc
    if is_pickle(buf):
        raise CorruptDataError("a pickle where msgpack was expected: the data is damaged or was tampered with; "
                               "it is not unpickled")
    try:
        return _decode_msgpack(buf, allow_pickle)
    except (CorruptDataError, PickleNotAllowedError, MissingDependencyError):  # a missing msgpack is not bad data
        raise
    except Exception as exc:  # ExtraData, FormatError, StackError, UnicodeDecodeError, unhashable keys, ...
        raise CorruptDataError(f"not a valid msgpack value: {type(exc).__name__}: {exc}") from exc
