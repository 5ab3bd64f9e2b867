"""Batching, kept apart from parallelism: put it before or after any parallel stage.

How a component is batched depends on its value in the first datapoint of the batch:

- numpy arrays are stacked into one array with a new leading axis (ragged arrays are padded to the
  batch maximum when ``pad_value`` is given);
- Python and numpy numbers and bools become a 1-d array (numpy's default dtypes: int64, float64, bool);
- anything else (str, bytes, objects, nested lists) stays a list.

State: ``BatchData`` holds nothing between two batches, so its state is its child's (a parallel map
stage below it saves the position of its fused batches). ``UnbatchData`` saves its child's state before
the current batch and how many datapoints of it were yielded, or, over an unordered stage, its child's
state after the batch and the batch's rest. ``BatchDataByShape`` keeps partial buckets, which no state
holds: it resumes by replaying its epoch (the default state), so not over an unordered stage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from numbers import Number
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._base import DataFlow, epoch_live, unordered_stage
from ._errors import BatchError, DatapointError, LengthUnknownError
from ._proxy import ProxyDataFlow
from ._state import (
    StateMismatchError,
    child_state,
    held_then,
    pack_held,
    read_first,
    state_or_error,
    unless_error,
    unpack_held,
)
from ._state_schema import Child, Count, Flag, Held, Same
from ._transforms import check_datapoint, get_component

__all__ = ["BatchData", "BatchDataByShape", "BatchesInWorkers", "UnbatchData", "batch_datapoints"]

_NUMERIC_KINDS = frozenset("biufc")
Allocator = Callable[[tuple, Any], np.ndarray]


def _shapes_seen(values: Sequence[Any]) -> str:
    counts = Counter(tuple(np.shape(v)) for v in values)
    return ", ".join(f"{shape} x{n}" for shape, n in counts.most_common(6))


def _same_number(fill: np.ndarray, value: Any) -> bool:
    """Whether casting ``value`` to the integer ``fill`` kept it (0.5 or nan -> uint8 does not)."""
    try:
        return bool(fill == value)
    except (TypeError, ValueError):
        return False


def _pad_stack(values: Sequence[np.ndarray], pad_value: Any, name: str) -> np.ndarray:
    ndims = {v.ndim for v in values}
    if len(ndims) != 1:
        raise BatchError(f"component {name}: cannot pad arrays of different ranks ({sorted(ndims)}); "
                         f"shapes seen: {_shapes_seen(values)}")
    shape = tuple(max(dims) for dims in zip(*(v.shape for v in values)))
    dtype = np.result_type(*{v.dtype for v in values})
    try:
        fill = np.array(pad_value, dtype=dtype)
    except (OverflowError, ValueError, TypeError):
        fill = None
    if fill is None or (dtype.kind in "biu" and not _same_number(fill, pad_value)):
        raise BatchError(f"component {name}: pad_value {pad_value!r} does not fit the arrays' dtype {dtype}")
    out = np.full((len(values), *shape), fill, dtype=dtype)
    for i, v in enumerate(values):
        where: tuple[int | slice, ...] = (i, *(slice(0, d) for d in v.shape))  # not inline: mypy reads
        # x[(i, *s)] as 3.11's x[i, *s]
        out[where] = v
    return out


def _batch_component(values: list[Any], name: str, pad_value: Any, alloc: Allocator | None = None) -> Any:
    first = values[0]
    if isinstance(first, np.ndarray):
        try:
            if alloc is not None:
                shape, dtype = first.shape, first.dtype
                if all(type(v) is np.ndarray and v.shape == shape and v.dtype == dtype for v in values):
                    return np.stack(values, out=alloc((len(values), *shape), dtype))
            return np.stack(values)
        except (ValueError, TypeError):
            if not all(isinstance(v, np.ndarray) for v in values):
                kinds = sorted({type(v).__name__ for v in values})
                raise BatchError(f"component {name}: mixes arrays with {kinds}") from None
            if pad_value is None:
                raise BatchError(
                    f"component {name}: arrays of different shapes cannot be stacked "
                    f"(shapes seen: {_shapes_seen(values)}); pass pad_value= to pad them, or use_list=True"
                ) from None
            return _pad_stack(values, pad_value, name)
    if isinstance(first, (Number, np.bool_, np.number)) and not isinstance(first, (str, bytes)):
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError):
            arr = None
        if arr is None or arr.dtype.kind not in _NUMERIC_KINDS or arr.ndim != 1:
            kinds = sorted({type(v).__name__ for v in values})
            raise BatchError(f"component {name}: numbers mixed with other types ({kinds}); use_list=True "
                             "keeps them as a list")
        return arr
    if isinstance(first, (str, bytes)):
        odd = sorted({type(v).__name__ for v in values if not isinstance(v, (str, bytes))})
        if odd:
            raise BatchError(f"component {name}: strings mixed with {odd}; use_list=True keeps them as a list")
    return list(values)


def batch_datapoints(dps: Sequence[Any], use_list: bool | Collection[Hashable] = False,
                     pad_value: Any = None, alloc: Allocator | None = None) -> Any:
    """Turn a sequence of datapoints into one batch datapoint of the same structure.

    Args:
        dps: list/tuple datapoints of equal length, or dict datapoints with the same keys.
        use_list: ``True`` keeps every component as a list; a collection of positions/keys keeps those.
        pad_value: pad ragged arrays with this value up to the largest shape in the batch.
        alloc: ``alloc(shape, dtype)`` returns the array to stack equal-shaped arrays into (parallel
            workers pass one that allocates in shared memory); default: a new array.

    Example:
        >>> batch_datapoints([[np.zeros(2), 1], [np.ones(2), 2]])[1]
        array([1, 2])
    """
    if not dps:
        raise BatchError("cannot batch an empty list of datapoints")
    first = check_datapoint(dps[0], "BatchData input")
    keep: Collection[Hashable] = () if isinstance(use_list, bool) else use_list
    as_list = (lambda k: True) if use_list is True else (lambda k: k in keep)
    if isinstance(first, dict):
        keys = list(first)
        for j, dp in enumerate(dps):
            if not isinstance(dp, dict) or len(dp) != len(keys):
                _check_keys(dp, keys, j)
        out = {}
        for k in keys:
            try:
                values = [dp[k] for dp in dps]
            except KeyError:  # same number of keys, different names: say which datapoint
                values = [get_component(dp, k, f"BatchData datapoint {j}") for j, dp in enumerate(dps)]
            out[k] = values if as_list(k) else _batch_component(values, repr(k), pad_value, alloc)
        return out
    n = len(first)
    for j, dp in enumerate(dps):
        if type(dp) not in (list, tuple) and not isinstance(dp, (list, tuple)):
            raise DatapointError(f"BatchData: datapoint {j} is a {type(dp).__name__} in a batch of "
                                 f"{type(first).__name__}s")
        if len(dp) != n:
            raise DatapointError(f"BatchData: datapoint {j} of the batch has {len(dp)} components, the first "
                                 f"has {n}")
    columns = list(zip(*dps))
    batched = [list(col) if as_list(i) else _batch_component(list(col), str(i), pad_value, alloc)
               for i, col in enumerate(columns)]
    return tuple(batched) if isinstance(first, tuple) else batched


def _check_keys(dp: Any, keys: list, j: int) -> None:
    if not isinstance(dp, dict):
        raise DatapointError(f"BatchData: datapoint {j} is a {type(dp).__name__} in a batch of dicts")
    missing = [k for k in keys if k not in dp]
    extra = [k for k in dp if k not in keys]
    raise DatapointError(f"BatchData: datapoint {j} of the batch differs in keys from the first "
                         f"(missing {missing}, extra {extra})")


def _check_batch_size(batch_size: Any, who: str) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"{who} batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


@runtime_checkable
class BatchesInWorkers(Protocol):
    """A flow whose workers can make ``BatchData``'s batches (the parallel map stages): ``batched(...)``
    returns the flow of those batches, which ``BatchData`` then reads."""

    def batched(self, batch_size: int, remainder: bool, use_list: Any, pad_value: Any) -> DataFlow: ...


class BatchData(ProxyDataFlow):
    """Group ``batch_size`` consecutive datapoints into one batch (see :func:`batch_datapoints`).

    When the wrapped flow is a parallel map stage (``MultiProcessMapData``, ``MultiThreadMapData``; see
    :class:`BatchesInWorkers`), its workers stack the batches themselves, so the arrays are copied once,
    in parallel, instead of once per worker and again here: this flow reads the stage's
    :class:`~bridgeflow.parallel._fused.WorkerBatching`, which its ``children()`` shows. The batches are
    the same, and so is the state.

    Args:
        remainder: also yield the last, smaller batch of an epoch.
        use_list: keep components as lists instead of stacking (``True`` or a collection of components).
        pad_value: pad ragged arrays to the batch maximum with this value instead of raising.
    """

    state_fields = (Same("batch_size", "batch_size", "the state is for batches of {saved}, this flow makes "
                         "batches of {have}"), Flag("child_done"), Child())

    def __init__(self, ds: DataFlow, batch_size: int, remainder: bool = False,
                 use_list: bool | Collection[Hashable] = False, pad_value: Any = None) -> None:
        super().__init__(ds)
        self.batch_size = _check_batch_size(batch_size, "BatchData")
        self.remainder = remainder
        self.use_list = use_list
        self.pad_value = pad_value
        self._child_done = False
        self._fused = self.ds.batched(self.batch_size, remainder, use_list, pad_value) \
            if isinstance(self.ds, BatchesInWorkers) else None

    def __len__(self) -> int:
        n = len(self.ds)
        return -(-n // self.batch_size) if self.remainder else n // self.batch_size

    def children(self) -> list[DataFlow]:
        return [self.ds if self._fused is None else self._fused]

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        if self._fused is not None:  # the stage's batches: its state was loaded into it already
            return iter(self._fused)
        self._child_done = False
        if resume is not None and resume["child_done"]:
            return iter(())  # the state was taken at the last, partial batch: this epoch has nothing left
        return self._batch(iter(self.ds))

    def _own_state(self) -> dict:
        done = self._child_done and epoch_live(self)
        return {"batch_size": self.batch_size, "child_done": done, "child": child_state(self.ds)}

    def _take_state(self, state: dict) -> None:
        fused = state["child"].get("batch")  # a parallel stage's state saved while it made batches in its workers
        if isinstance(fused, dict) and fused.get("size") != self.batch_size:
            raise StateMismatchError(f"the state's stage made batches of {fused.get('size')!r:.20} in its workers, "
                                     f"this flow makes batches of {self.batch_size}")

    def _batch(self, source: Iterator) -> Iterator:
        bs, use_list, pad = self.batch_size, self.use_list, self.pad_value
        holder: list = []
        for dp in source:
            holder.append(dp)
            if len(holder) == bs:
                yield batch_datapoints(holder, use_list, pad)
                holder = []
        self._child_done = True  # a remainder batch comes after the child's epoch ended
        if self.remainder and holder:
            yield batch_datapoints(holder, use_list, pad)


class BatchDataByShape(ProxyDataFlow):
    """Batch datapoints whose component ``idx`` has the same shape (e.g. images of equal size).

    Datapoints wait in one bucket per shape; a bucket is emitted when full. With ``remainder=True`` the
    partial buckets are emitted at the end of an epoch. Resuming replays the epoch up to the saved
    batch (the buckets' datapoints are not part of the state).
    """

    def __init__(self, ds: DataFlow, batch_size: int, idx: Hashable, remainder: bool = False,
                 use_list: bool | Collection[Hashable] = False) -> None:
        super().__init__(ds)
        self.batch_size = _check_batch_size(batch_size, "BatchDataByShape")
        self.idx = idx
        self.remainder = remainder
        self.use_list = use_list

    def __len__(self) -> int:
        raise LengthUnknownError("BatchDataByShape's number of batches depends on the shapes it sees")

    def _iter_epoch(self) -> Iterator:
        buckets: dict[tuple, list] = {}
        for dp in self.ds:
            shape = np.shape(get_component(dp, self.idx, "BatchDataByShape"))
            bucket = buckets.setdefault(shape, [])
            bucket.append(dp)
            if len(bucket) == self.batch_size:
                yield batch_datapoints(bucket, self.use_list)
                del buckets[shape]
        if self.remainder:
            for bucket in buckets.values():
                yield batch_datapoints(bucket, self.use_list)


def _batch_length(column: Any, key: Hashable) -> int:
    """Entries in one batched component: an array's first axis, or a list's length."""
    if isinstance(column, np.ndarray) and column.ndim > 0:
        return len(column)
    if isinstance(column, (list, tuple)):
        return len(column)
    raise BatchError(f"UnbatchData: component {key!r} is a {type(column).__name__} ({_short(column)}), not a "
                     "batch: expected an array or a list with one entry per datapoint")


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _not_a_batch(dp: Any) -> str | None:
    """Why ``dp`` is not the rest of a batch (components of one length), None when it is."""
    parts = list(dp.values() if isinstance(dp, dict) else dp)
    try:
        lengths = {len(p) for p in parts}
    except TypeError:
        return "not the rest of a batch: a component has no length"
    return None if len(lengths) == 1 else "not the rest of a batch: its components differ in length or it has none"


class UnbatchData(ProxyDataFlow):
    """Split each batch back into datapoints: the inverse of :class:`BatchData`.

    Its state is its child's state before the current batch plus the datapoints of it yielded, so it
    asks its child for a state once per batch. Over an unordered stage, whose next batch on a resume would
    be another one, it is the child's state after the current batch plus the batch's rest (``held``).
    """

    state_fields = (Count("index"), Held(count=1, item=lambda dp: _not_a_batch(dp)), Child())

    def __init__(self, ds: DataFlow) -> None:
        super().__init__(ds)
        self._before: Any = None
        self._index = 0
        self._batch: Any = None  # the batch being split, of self._size datapoints
        self._size = 0
        self._loose: str | None = None  # the unordered stage under this flow, if any

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        self._loose = unordered_stage(self)
        self._index = resume["index"] if resume is not None else 0
        self._batch, self._size = None, 0
        held = resume.get("held") if resume is not None else None
        if self._loose is None:
            self._before = state_or_error(child_state, self.ds)  # before iter(): the loaded state, if any
        source = iter(self.ds)
        if held is not None:
            items = unpack_held(held)
            # the held rest is the batch being split until it is read again: a state taken before then holds it
            batch = items[0]
            column = next(iter(batch.values() if isinstance(batch, dict) else batch), ())
            self._batch, self._size = batch, len(column)
            source = held_then(items, source)
        elif self._index:  # the batch being split, read again now
            source = read_first(source)
        return self._unbatch(source, self._index)

    def _own_state(self) -> dict:
        if not epoch_live(self):
            return {"index": 0, "held": None, "child": child_state(self.ds)}
        if self._loose is None:
            return {"index": self._index, "held": None, "child": unless_error(self._before)}
        held = None
        if self._batch is not None and self._index < self._size:
            held = pack_held([_rest(self._batch, self._index)], self._loose)
        return {"index": 0, "held": held, "child": child_state(self.ds)}

    def _unbatch(self, source: Iterator, skip: int) -> Iterator:
        first = True
        exact = self._loose is None
        for batch in source:
            if not first:
                self._index = 0
            first = False
            check_datapoint(batch, "UnbatchData input")
            keys = list(batch) if isinstance(batch, dict) else range(len(batch))
            sizes = {k: _batch_length(batch[k], k) for k in keys}
            if len(set(sizes.values())) > 1:
                raise BatchError(f"UnbatchData: components of one batch differ in length: {sizes}")
            n = next(iter(sizes.values()), 0)
            self._batch, self._size = batch, n
            if isinstance(batch, dict):
                for i in range(skip, n):
                    self._index = i + 1
                    yield {k: batch[k][i] for k in keys}
            else:
                cls = tuple if isinstance(batch, tuple) else list
                for i in range(skip, n):
                    self._index = i + 1
                    yield cls(batch[k][i] for k in keys)
            skip = 0
            self._batch = None
            if exact:
                self._before = state_or_error(child_state, self.ds)  # before the next batch is read

    def __len__(self) -> int:
        raise LengthUnknownError("UnbatchData's length depends on the sizes of the batches it reads")


def _rest(batch: Any, start: int) -> Any:
    """The datapoints of ``batch`` from ``start`` on, as a batch of the same structure."""
    if isinstance(batch, dict):
        return {k: v[start:] for k, v in batch.items()}
    rest = [v[start:] for v in batch]
    return tuple(rest) if isinstance(batch, tuple) else rest
