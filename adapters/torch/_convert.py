"""Tensors through the worker's shared-memory transport, and the diagnosis of what cannot be sent.

bridgeflow's transport (:mod:`bridgeflow.parallel._transport.shm`) moves numpy arrays through shared memory out of band
(pickle protocol 5, one copy) but would pickle a torch tensor's bytes into the message. So each worker's
result writer gets one more entry in its pickler's dispatch table (:func:`install`): a plain CPU tensor is
pickled as a zero-copy numpy view of its data plus its real dtype, and rebuilt in the consumer by
:func:`rebuild_tensor` with ``torch.from_numpy`` over the received shared-memory view: same dtype, shape and
values, no extra copy. dtypes numpy lacks (bfloat16, complex32, float8) travel as same-width integers and are
viewed back. The pickler meets each tensor once, wherever it is in the result: nothing walks the result in
Python, in the worker or in the consumer.

What cannot be pickled (an open file, a lock) is found only when sending fails: :func:`unsendable` then walks
the value for the first leaf that does not pickle, so the error can name it.

Example:
    >>> import io, pickle
    >>> import torch
    >>> from bridgeflow.adapters.torch._convert import reduce_tensor
    >>> out = io.BytesIO(); p = pickle.Pickler(out, protocol=5)
    >>> p.dispatch_table = {torch.Tensor: reduce_tensor}
    >>> p.dump({"x": torch.arange(3, dtype=torch.bfloat16)})
    >>> pickle.loads(out.getvalue())["x"].tolist()
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._compat import torch

__all__ = ["install", "map_structure", "rebuild_tensor", "reduce_tensor", "unsendable"]

# Integer dtypes of each width, used to carry dtypes numpy has no type for.
_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic)


def rebuild_tensor(array: np.ndarray, dtype: Any, requires_grad: bool) -> Any:
    """Consumer side: the tensor over ``array`` (received in shared memory), viewed as ``dtype`` when it
    travelled as a same-width integer."""
    t = torch.from_numpy(array)
    if dtype is not None:
        t = t.view(dtype)
    if requires_grad:
        t.requires_grad_(True)
    return t


def reduce_tensor(t: Any) -> Any:
    """Worker side, a pickler's reduction of a ``torch.Tensor``: a plain strided CPU tensor becomes a numpy
    view of its data (sent out of band) for :func:`rebuild_tensor`; any other (nested, sparse, quantized,
    conjugated or negated views, another device) is pickled as torch pickles it."""
    if (t.device.type != "cpu" or t.layout != torch.strided or t.is_nested or t.is_quantized or t.is_conj()
            or t.is_neg()):
        return t.__reduce_ex__(5)
    requires_grad = t.requires_grad
    if requires_grad:
        t = t.detach()
    try:
        return rebuild_tensor, (t.numpy(), None, requires_grad)
    except TypeError:  # a dtype numpy has no type for: carry it as a same-width integer
        return rebuild_tensor, (t.view(_CARRIER[t.element_size()]).numpy(), t.dtype, requires_grad)


def install(writer: Any) -> None:
    """Make ``writer`` (a worker's :class:`~bridgeflow.parallel._transport.shm.SlabWriter`) send tensors out of band."""
    writer.reducers[torch.Tensor] = reduce_tensor


def _rebuild(obj: Any, items: Any) -> Any:
    """A container like ``obj`` holding ``items`` (a dict for mappings, a list for sequences)."""
    if isinstance(obj, Mapping):
        if type(obj) is dict:
            return items
        try:
            clone: Any = copy.copy(obj)  # any mapping type: one without update() is rebuilt as a dict
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
        clone = copy.copy(obj)  # any sequence type: one without slice assignment is rebuilt as a list
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


_SENDABLE = (torch.Tensor, str, bytes, bytearray, int, float, complex, bool, type(None), np.generic)


def unsendable(obj: Any) -> tuple[Any, Exception] | None:
    """The first value inside ``obj`` (through dicts, lists and tuples) that cannot be pickled, with the
    reason, or None. Values of the usual types are taken as sendable without trying. For diagnosis, once
    sending failed: it walks every leaf."""
    if isinstance(obj, Mapping):
        values: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    else:
        if isinstance(obj, _SENDABLE) or (isinstance(obj, np.ndarray) and not obj.dtype.hasobject):
            return None
        try:
            pickle.dumps(obj, protocol=5)
        except Exception as exc:
            return obj, exc
        return None
    for v in values:
        found = unsendable(v)
        if found is not None:
            return found
    return None
