"""Dtypes and static shapes of a flow's datapoints, as TensorFlow sees them.

A :class:`Signature` describes one datapoint: a tuple of components (list and tuple datapoints) or a
dict of named components, each with a ``tf.TensorSpec``. It is inferred from the first datapoint or
given explicitly as a tuple/list/dict of ``tf.TensorSpec`` (the same structure ``tf.data`` calls an
``output_signature``). It turns datapoints into flat lists of numpy arrays in a fixed order (for queues,
placeholders and generators) and packs flat tensors back into the datapoint's structure.

Dtypes follow numpy: Python ints become int64, floats float64, bools bool, ``str``/``bytes`` become
``tf.string``. Give an explicit signature to get float32 from Python floats.

Example:
    >>> sig = Signature.from_datapoint({"x": np.zeros((2, 3), "float32"), "y": 1})
    >>> sig.structure["x"].shape, sig.structure["y"].dtype
    (TensorShape([2, 3]), tf.int64)
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from bridgeflow import DatapointError

__all__ = ["Signature", "infer_signature"]

_STRING_KINDS = frozenset("USO")


def _component_array(value: Any, where: str) -> np.ndarray:
    if isinstance(value, tf.Tensor):
        value = value.numpy()
    arr = np.asarray(value)
    if arr.dtype.kind == "O":
        flat = arr.ravel()
        if flat.size and not all(isinstance(v, (str, bytes)) for v in flat):
            kinds = sorted({type(v).__name__ for v in flat[:20]})
            raise DatapointError(f"{where}: cannot turn a component of {kinds} into a tensor; "
                                 "components must be numbers, strings or arrays of one dtype")
    return arr


def _spec_for(arr: np.ndarray, name: str, dynamic_batch: bool) -> tf.TensorSpec:
    dtype = tf.string if arr.dtype.kind in _STRING_KINDS else tf.as_dtype(arr.dtype)
    shape = list(arr.shape)
    if dynamic_batch and shape:
        shape[0] = None
    return tf.TensorSpec(shape, dtype, name=name)


def _safe_name(key: Hashable) -> str:
    text = "".join(c if c.isalnum() or c in "_-." else "_" for c in str(key))
    return text if text and text[0].isalnum() else f"c{text}"


@dataclass(frozen=True)
class Signature:
    """The structure, dtypes and static shapes of one datapoint.

    ``keys`` are positions (``0, 1, ...``) for tuple datapoints or the dict keys, in the order used by
    :meth:`flatten` and :meth:`pack`; ``specs`` holds one ``tf.TensorSpec`` per key.
    """

    keys: tuple[Hashable, ...]
    specs: tuple[tf.TensorSpec, ...]
    is_dict: bool

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.specs):
            raise ValueError(f"Signature: {len(self.keys)} keys but {len(self.specs)} specs")
        if not self.specs:
            raise DatapointError("Signature: a datapoint needs at least one component")

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_datapoint(cls, dp: Any, dynamic_batch: bool = False, who: str = "datapoint") -> Signature:
        """Infer the signature of ``dp``; ``dynamic_batch`` leaves the first dimension unknown (``None``)
        so the last, smaller batch of an epoch still fits."""
        if isinstance(dp, Mapping):
            keys = tuple(dp)
            specs = tuple(_spec_for(_component_array(dp[k], f"{who} component {k!r}"), _safe_name(k),
                                    dynamic_batch) for k in keys)
            return cls(keys, specs, True)
        if isinstance(dp, (list, tuple)):
            specs = tuple(_spec_for(_component_array(v, f"{who} component {i}"), f"input{i}", dynamic_batch)
                          for i, v in enumerate(dp))
            return cls(tuple(range(len(dp))), specs, False)
        raise DatapointError(f"{who} is a {type(dp).__name__}; a datapoint must be a list, tuple or dict of "
                             "components")

    @classmethod
    def from_structure(cls, structure: Any) -> Signature:
        """A signature from a tuple/list/dict of ``tf.TensorSpec`` (``tf.data``'s ``output_signature``)."""
        if isinstance(structure, Signature):
            return structure
        if isinstance(structure, tf.TensorSpec):
            structure = (structure,)
        if isinstance(structure, Mapping):
            keys, values, is_dict = tuple(structure), list(structure.values()), True
        elif isinstance(structure, (list, tuple)):
            keys, values, is_dict = tuple(range(len(structure))), list(structure), False
        else:
            raise TypeError(f"signature must be a tuple, list or dict of tf.TensorSpec, got "
                            f"{type(structure).__name__}")
        specs = []
        for k, spec in zip(keys, values):
            if not isinstance(spec, tf.TensorSpec):
                raise TypeError(f"signature component {k!r} must be a tf.TensorSpec, got "
                                f"{type(spec).__name__}")
            name = spec.name or (_safe_name(k) if is_dict else f"input{k}")
            specs.append(tf.TensorSpec(spec.shape, spec.dtype, name=name))
        return cls(keys, tuple(specs), is_dict)

    # --- views ----------------------------------------------------------------------------------
    @property
    def structure(self) -> tuple | dict:
        """The specs in the datapoint's structure (a tuple, or a dict keyed like the datapoint)."""
        return self.pack(self.specs)

    @property
    def dtypes(self) -> list[tf.DType]:
        return [s.dtype for s in self.specs]

    @property
    def shapes(self) -> list[tf.TensorShape]:
        return [s.shape for s in self.specs]

    def fully_defined(self) -> bool:
        return all(s.shape.is_fully_defined() for s in self.specs)

    def with_dynamic_batch(self) -> Signature:
        """The same signature with an unknown first dimension on every component of rank >= 1."""
        specs = tuple(tf.TensorSpec([None, *s.shape[1:]], s.dtype, name=s.name) if s.shape.rank else s
                      for s in self.specs)
        return Signature(self.keys, specs, self.is_dict)

    # --- conversion -----------------------------------------------------------------------------
    def flatten(self, dp: Any, who: str = "datapoint") -> list[np.ndarray]:
        """The components of ``dp`` as numpy arrays in signature order, checked against the signature.

        Raises :class:`DatapointError` naming the component whose structure, dtype or shape differs.
        """
        if self.is_dict:
            if not isinstance(dp, Mapping):
                raise DatapointError(f"{who} is a {type(dp).__name__} but the signature expects a dict with "
                                     f"keys {list(self.keys)}")
            missing = [k for k in self.keys if k not in dp]
            if missing:
                raise DatapointError(f"{who} lacks key(s) {missing} of the signature {list(self.keys)}")
            values: Sequence[Any] = [dp[k] for k in self.keys]
        else:
            if not isinstance(dp, (list, tuple)):
                raise DatapointError(f"{who} is a {type(dp).__name__} but the signature expects a list/tuple "
                                     f"of {len(self.keys)} components")
            if len(dp) != len(self.keys):
                raise DatapointError(f"{who} has {len(dp)} components but the signature has {len(self.keys)}")
            values = dp
        return [self._convert(v, k, spec, who) for v, k, spec in zip(values, self.keys, self.specs)]

    @staticmethod
    def _convert(value: Any, key: Hashable, spec: tf.TensorSpec, who: str) -> np.ndarray:
        where = f"{who} component {key!r}"
        arr = _component_array(value, where)
        if spec.dtype == tf.string:
            if arr.dtype.kind not in _STRING_KINDS:
                raise DatapointError(f"{where}: expected strings (tf.string), got {arr.dtype}")
        else:
            target = spec.dtype.as_numpy_dtype
            if arr.dtype != target:
                if arr.dtype.kind in _STRING_KINDS or not np.can_cast(arr.dtype, target, "same_kind"):
                    raise DatapointError(f"{where}: dtype {arr.dtype} does not fit the signature's "
                                         f"{spec.dtype.name}")
                arr = arr.astype(target)
        if not spec.shape.is_compatible_with(arr.shape):
            raise DatapointError(f"{where}: shape {tuple(arr.shape)} does not match the signature's "
                                 f"{spec.shape} (the signature comes from the first datapoint unless given; "
                                 "use dynamic_batch=True for a smaller last batch)")
        return arr

    def pack(self, values: Sequence[Any]) -> tuple | dict:
        """Put flat values (tensors, arrays, specs) back into the datapoint's structure."""
        values = list(values)
        if len(values) != len(self.keys):
            raise ValueError(f"Signature.pack: {len(values)} values for {len(self.keys)} components")
        if self.is_dict:
            return dict(zip(self.keys, values))
        return tuple(values)

    def unpack(self, structure: Any) -> list[Any]:
        """The components of a tuple/dict structure (tensors, specs) as a flat list in signature order."""
        if self.is_dict:
            return [structure[k] for k in self.keys]
        if len(structure) != len(self.keys):
            raise ValueError(f"Signature.unpack: {len(structure)} components for {len(self.keys)}")
        return list(structure)

    def set_shapes(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Give symbolic tensors (from a queue or staging area) the signature's static shapes."""
        out = []
        for t, spec in zip(tensors, self.specs):
            t.set_shape(spec.shape)
            out.append(t)
        return out


def infer_signature(dp: Any, dynamic_batch: bool = False) -> tuple | dict:
    """The ``tf.TensorSpec`` structure of a datapoint (a tuple, or a dict for dict datapoints).

    Example:
        >>> infer_signature([np.zeros((4, 2), "float32"), np.arange(4)], dynamic_batch=True)[0].shape
        TensorShape([None, 2])
    """
    return Signature.from_datapoint(dp, dynamic_batch).structure
