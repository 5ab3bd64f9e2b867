"""Datapoints as columns: the shared schema of the column formats (HDF5, npz).

A datapoint (list, tuple or dict) becomes one column per component. Each column has a *kind*:

- ``array``: numeric/bool arrays of one shape, stacked into ``(N, *shape)``;
- ``ragged``: arrays of one dtype and rank whose shapes differ, stored flat with their shapes beside
  (a column starts as ``array`` and becomes ``ragged`` at the first datapoint of another shape);
- ``scalar``: Python or numpy numbers and bools, stored as ``(N,)``; Python types come back as Python types;
- ``str`` and ``bytes``: variable-length text and binary (encoded images).

Anything else (None, nested lists, dicts inside a component, object arrays) is refused with an error
naming the component: store such datapoints with LMDB, which takes any codec-supported structure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._errors import DatapointError

__all__ = ["Column", "assemble", "classify", "restore", "split_datapoint"]

_NUMERIC = frozenset("biufc")
_PYTYPES = {bool: "bool", int: "int", float: "float"}
_PYTYPES_BACK = {"": None, "bool": bool, "int": int, "float": float}


@dataclass
class Column:
    name: str
    kind: str  # array | ragged | scalar | str | bytes
    dtype: str = ""
    shape: tuple[int, ...] = ()
    pytype: str = ""  # for scalars: "bool" | "int" | "float" (Python types), "" for numpy scalars

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Column:
        """Rebuild a column from file metadata; ``ValueError`` when the description is not valid."""
        col = cls(str(d["name"]), d["kind"], d.get("dtype", ""), tuple(int(x) for x in d.get("shape", ())),
                  d.get("pytype", ""))
        if col.kind not in ("array", "ragged", "scalar", "str", "bytes") or col.pytype not in _PYTYPES_BACK:
            raise ValueError(f"bad column description {d!r}")
        if col.kind in ("array", "ragged", "scalar") and np.dtype(col.dtype).kind not in _NUMERIC:
            raise ValueError(f"bad column dtype in {d!r}")
        if any(x < 0 for x in col.shape):
            raise ValueError(f"bad column shape in {d!r}")
        return col

    def check(self, value: Any, index: int) -> Column | None:
        """Raise if ``value`` does not fit; return a replacement column when it only needs ``ragged``."""
        if self.kind in ("array", "ragged"):
            if not isinstance(value, np.ndarray) or value.dtype.str != self.dtype:
                got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
                raise DatapointError(f"component {self.name!r} of datapoint {index}: expected an array of "
                                     f"dtype {np.dtype(self.dtype)}, got {got}")
            if self.kind == "array" and value.shape != self.shape:
                if value.ndim != len(self.shape):
                    raise DatapointError(f"component {self.name!r} of datapoint {index}: rank {value.ndim}, "
                                         f"earlier datapoints have rank {len(self.shape)}")
                return Column(self.name, "ragged", self.dtype, self.shape, "")
            if value.ndim != len(self.shape):
                raise DatapointError(f"component {self.name!r} of datapoint {index}: rank {value.ndim}, "
                                     f"earlier datapoints have rank {len(self.shape)}")
            return None
        other = classify(self.name, value, index)
        if (other.kind, other.dtype) != (self.kind, self.dtype):  # int and np.int64 mix: fine
            raise DatapointError(f"component {self.name!r} of datapoint {index}: a {describe(value)} where "
                                 f"earlier datapoints have {self.kind} {self.pytype or self.dtype}".rstrip())
        return None


def describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__


def classify(name: str, value: Any, index: int = 0) -> Column:
    """The column that stores ``value`` (the component ``name`` of the first datapoint)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMERIC or value.dtype.fields is not None:
            raise DatapointError(f"component {name!r} of datapoint {index}: column formats store numeric and "
                                 f"bool arrays, got dtype {value.dtype}; use LMDBSerializer for it")
        return Column(name, "array", value.dtype.str, tuple(value.shape))
    if isinstance(value, np.generic) and value.dtype.kind in _NUMERIC:
        return Column(name, "scalar", value.dtype.str)
    if type(value) in _PYTYPES:
        if type(value) is int and not -(1 << 63) <= value < (1 << 63):
            raise DatapointError(f"component {name!r} of datapoint {index}: the int {value} does not fit in "
                                 "64 bits, which column formats store; use LMDBSerializer for it")
        dt = {"bool": "|b1", "int": "<i8", "float": "<f8"}[_PYTYPES[type(value)]]
        return Column(name, "scalar", dt, (), _PYTYPES[type(value)])
    if isinstance(value, str):
        return Column(name, "str")
    if isinstance(value, bytes):
        return Column(name, "bytes")
    raise DatapointError(f"component {name!r} of datapoint {index} is a {describe(value)}; column formats "
                         "(HDF5, npz) store arrays, numbers, str and bytes per component; flatten it or "
                         "use LMDBSerializer")


def split_datapoint(dp: Any, data_paths: list[str] | None, index: int) -> tuple[str, list[str], list]:
    """``(structure, names, values)`` of a datapoint; structure is ``list``, ``tuple`` or ``dict``."""
    if isinstance(dp, dict):
        names = list(dp) if data_paths is None else list(data_paths)
        for k in names:
            if not isinstance(k, str):
                raise DatapointError(f"datapoint {index}: column formats need str keys, got {k!r}")
            if k not in dp:
                raise DatapointError(f"datapoint {index} has no key {k!r} (keys: {list(dp)})")
        return "dict", names, [dp[k] for k in names]
    if isinstance(dp, (list, tuple)):
        names = [str(i) for i in range(len(dp))] if data_paths is None else list(data_paths)
        if len(names) != len(dp):
            raise DatapointError(f"datapoint {index} has {len(dp)} components but {len(names)} names "
                                 f"were given: {names}")
        return ("tuple" if isinstance(dp, tuple) else "list"), names, list(dp)
    raise DatapointError(f"datapoint {index} is a {type(dp).__name__}; expected a list, tuple or dict")


def restore(value: Any, col: Column) -> Any:
    """A stored cell back to the type it was saved as."""
    if col.kind == "scalar":
        return {"bool": bool, "int": int, "float": float}[col.pytype](value) if col.pytype else value
    if col.kind == "bytes":
        return bytes(value) if not isinstance(value, bytes) else value
    if col.kind == "str" and isinstance(value, bytes):
        return value.decode("utf-8", "surrogatepass")
    return value


def assemble(structure: str, names: list[str], values: list) -> Any:
    if structure == "dict":
        return dict(zip(names, values))
    return tuple(values) if structure == "tuple" else values
