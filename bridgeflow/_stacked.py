"""Samples read straight into the rows of their batch, so that collating them copies nothing.

Collating a batch copies every sample's arrays into one stacked array. While a batch is read to be collated
(inside :func:`collating`, which the torch adapter enters around reading a batch from a bridgeflow reader and
collating it), a reader may instead read the arrays of the batch's samples straight into the rows of one new
array, a *block* (:func:`new_block`, in ``alloc``'s memory: a worker's shared-memory slab), each sample's array a
view of its row. The collation then asks :func:`take_block` whether the arrays it is about to stack are exactly
the rows of such a block, in order, and takes the block as the stacked batch.

A block is taken only where it was made, inside the same :func:`collating`, and only once: a batch never shares
memory with any array but the samples read for it, which nobody else holds.

Example:
    >>> import numpy as np
    >>> with collating():
    ...     block = new_block(2, (3,), np.dtype(np.int16))
    ...     rows = [block[0], block[1]]
    ...     take_block(rows) is block, take_block(rows)
    (True, None)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["collating", "collating_now", "new_block", "take_block"]

Allocator = Callable[[tuple, Any], np.ndarray]


class _Batch:
    __slots__ = ("alloc", "blocks")

    def __init__(self, alloc: Allocator | None) -> None:
        self.alloc = alloc
        self.blocks: dict[int, np.ndarray] = {}  # the address of its first byte -> a block not yet taken


_batch: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("bridgeflow_collating", default=None)


@contextlib.contextmanager
def collating(alloc: Allocator | None = None) -> Iterator[None]:
    """Read and collate one batch inside this: readers may read into blocks made by ``alloc(shape, dtype)``
    (``np.empty`` when None), and the blocks not taken are let go at the end."""
    token = _batch.set(_Batch(alloc))
    try:
        yield
    finally:
        _batch.reset(token)


def collating_now() -> bool:
    """Whether a batch is being read to be collated (inside :func:`collating`)."""
    return _batch.get() is not None


def new_block(n: int, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
    """A new C-contiguous array of ``n`` rows of ``shape`` and ``dtype`` to read a batch's arrays into, or
    None outside :func:`collating` (no collation follows: read each sample into memory of its own)."""
    batch = _batch.get()
    if batch is None:
        return None
    block = (batch.alloc or np.empty)((n, *shape), dtype)
    if not block.flags.c_contiguous or block.shape != (n, *shape):
        return None
    batch.blocks[block.__array_interface__["data"][0]] = block
    return block


def take_block(arrays: Sequence[Any]) -> np.ndarray | None:
    """The block made by :func:`new_block` whose rows, in order, are ``arrays``; None when they are not (then
    stack them). The block is taken: asked again, this returns None."""
    batch = _batch.get()
    if batch is None or not batch.blocks or not arrays or type(arrays[0]) is not np.ndarray:
        return None
    first = arrays[0]
    address = first.__array_interface__["data"][0]
    block = batch.blocks.get(address)
    if block is None or block.shape != (len(arrays), *first.shape) or block.dtype != first.dtype:
        return None
    step, strides = block.strides[0], block.strides[1:]
    for k, a in enumerate(arrays):
        if (type(a) is not np.ndarray or a.__array_interface__["data"][0] != address + k * step
                or a.shape != first.shape or a.dtype != block.dtype or a.strides != strides):
            return None
    del batch.blocks[address]
    return block
