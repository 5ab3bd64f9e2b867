"""Tensors <-> numpy for the trip from a worker process to the consumer.

bridgeflow's transport moves numpy arrays through shared memory out of band (pickle protocol 5, one copy)
but would pickle a torch tensor in band. So a worker wraps each CPU tensor of its result as a
:class:`TensorBox` holding a zero-copy numpy view, and the consumer turns the box back into a tensor with
``torch.from_numpy`` over the received shared-memory view: same dtype, shape and values, no extra copy.
dtypes numpy lacks (bfloat16, complex32, float8) travel as same-width integers and are viewed back.

Containers are rebuilt only where a tensor was found inside; everything else passes through untouched.

Example:
    >>> import torch
    >>> from bridgeflow.adapters.torch.convert import pack, unpack
    >>> batch = {"x": torch.arange(3, dtype=torch.bfloat16), "name": ["a", "b", "c"]}
    >>> out = unpack(pack(batch))
    >>> out["x"].dtype, out["x"].tolist(), out["name"]
    (torch.bfloat16, [0.0, 1.0, 2.0], ['a', 'b', 'c'])
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._compat import torch

__all__ = ["TensorBox", "map_structure", "pack", "slab_bytes", "unpack", "unsendable"]

# Integer dtypes of each width, used to carry dtypes numpy has no type for.
_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic)


class TensorBox:
    """A CPU tensor in transit: a numpy view of its data, the real dtype, and its ``requires_grad`` flag."""

    __slots__ = ("array", "dtype", "requires_grad")

    def __init__(self, array: np.ndarray, dtype: Any, requires_grad: bool = False) -> None:
        self.array = array
        self.dtype = dtype  # None when the numpy dtype is the tensor's own
        self.requires_grad = requires_grad

    def __reduce__(self):
        return (TensorBox, (self.array, self.dtype, self.requires_grad))

    def __repr__(self) -> str:
        return f"TensorBox({self.array.dtype}{list(self.array.shape)}, dtype={self.dtype})"


def _boxable(t: Any) -> bool:
    # A nested tensor has no single shape for numpy: it travels pickled, as torch sends it.
    return (type(t) is torch.Tensor and not t.is_nested and t.device.type == "cpu"
            and t.layout == torch.strided and not t.is_conj() and not t.is_neg() and not t.is_quantized)


def box_tensor(t: Any) -> Any:
    """A :class:`TensorBox` for a plain strided CPU tensor; any other tensor is returned as is."""
    if not _boxable(t):
        return t
    requires_grad = t.requires_grad
    if requires_grad:
        t = t.detach()
    try:
        return TensorBox(t.numpy(), None, requires_grad)
    except TypeError:  # a dtype numpy has no type for: carry it as a same-width integer
        carrier = _CARRIER[t.element_size()]
        return TensorBox(t.view(carrier).numpy(), t.dtype, requires_grad)


def unbox_tensor(box: TensorBox) -> Any:
    t = torch.from_numpy(box.array)
    if box.dtype is not None:
        t = t.view(box.dtype)
    if box.requires_grad:
        t.requires_grad_(True)
    return t


def _rebuild(obj: Any, items: Any) -> Any:
    """A container like ``obj`` holding ``items`` (a dict for mappings, a list for sequences)."""
    if isinstance(obj, Mapping):
        if type(obj) is dict:
            return items
        try:
            clone = copy.copy(obj)
            clone.update(items)
            return clone
        except (TypeError, AttributeError):
            return items
    if isinstance(obj, tuple):
        if type(obj) is tuple:
            return tuple(items)
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        try:
            return type(obj)(items)
        except TypeError:
            return tuple(items)
    if type(obj) is list:
        return items
    try:
        clone = copy.copy(obj)
        clone[:] = items
        return clone
    except TypeError:
        return items


def map_structure(obj: Any, leaf: Callable[[Any], Any], match: tuple[type, ...]) -> Any:
    """Apply ``leaf`` to every instance of ``match`` inside nested dicts/lists/tuples; rebuild only the
    containers where something changed (others keep their identity)."""
    if isinstance(obj, match):
        return leaf(obj)
    if isinstance(obj, _LEAVES):
        return obj
    if isinstance(obj, Mapping):
        changed = False
        items = {}
        for k, v in obj.items():
            nv = map_structure(v, leaf, match)
            changed = changed or nv is not v
            items[k] = nv
        return _rebuild(obj, items) if changed else obj
    if isinstance(obj, (list, tuple)):
        changed = False
        out = []
        for v in obj:
            nv = map_structure(v, leaf, match)
            changed = changed or nv is not v
            out.append(nv)
        return _rebuild(obj, out) if changed else obj
    return obj


def pack(obj: Any) -> Any:
    """Worker side: replace CPU tensors inside ``obj`` by :class:`TensorBox` es (zero copy)."""
    return map_structure(obj, box_tensor, (torch.Tensor,))


def unpack(obj: Any) -> Any:
    """Consumer side: turn every :class:`TensorBox` inside ``obj`` back into a tensor (zero copy)."""
    return map_structure(obj, unbox_tensor, (TensorBox,))


_ALIGN = 64  # as the slab writer aligns each array
_SENDABLE = (TensorBox, torch.Tensor, str, bytes, bytearray, int, float, complex, bool, type(None), np.generic)


def _leaves(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def slab_bytes(obj: Any) -> int:
    """Bytes the arrays and tensors inside ``obj`` take in a slab, each aligned: room for its batch."""
    total = 0
    for leaf in _leaves(obj):
        if isinstance(leaf, np.ndarray):
            total += leaf.nbytes + _ALIGN
        elif isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
            total += leaf.numel() * leaf.element_size() + _ALIGN
    return total


def unsendable(obj: Any) -> tuple[Any, Exception] | None:
    """The first value inside ``obj`` that cannot be pickled, with the reason (values of the usual types
    are taken as sendable without trying), or None."""
    for leaf in _leaves(obj):
        if isinstance(leaf, _SENDABLE) or (isinstance(leaf, np.ndarray) and not leaf.dtype.hasobject):
            continue
        try:
            pickle.dumps(leaf, protocol=5)
        except Exception as exc:
            return leaf, exc
    return None
