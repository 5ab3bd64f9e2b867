"""Small helpers to drive a DataFlow (or any iterable) from the adapter's inputs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bridgeflow import DatapointError, engine

__all__ = ["END", "close_iterator", "dynamic_batch_for", "peek", "reset_once", "with_first"]

END = object()  # sentinel: the iterator is exhausted


def reset_once(df: Any) -> None:
    """Call ``df.reset_state()`` unless it ran already (plain iterables have none)."""
    if hasattr(df, "reset_state"):
        engine.reset_once(df)


def close_iterator(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


def peek(df: Any, who: str, hint: str) -> tuple[Any, Iterator]:
    """Reset ``df`` if needed and read its first datapoint; returns it with the live iterator, so the
    caller can hand both on and nothing is read twice."""
    reset_once(df)
    it = iter(df)
    first = next(it, END)
    if first is END:
        close_iterator(it)
        raise DatapointError(f"{who}: {type(df).__name__} yielded no datapoint, so its signature cannot be "
                             f"inferred; pass {hint}")
    return first, it


def with_first(first: Any, it: Iterator) -> Iterator:
    """``first`` followed by the rest of ``it``; closing this closes ``it``."""
    try:
        yield first
        yield from it
    finally:
        close_iterator(it)


def dynamic_batch_for(df: Any, dynamic_batch: bool | None) -> bool:
    """``dynamic_batch`` if given; when None, True if ``df`` batches with ``remainder=True`` (the first
    batching flow found from the top of the pipeline), so its smaller last batch fits the signature."""
    if dynamic_batch is not None:
        return bool(dynamic_batch)
    from bridgeflow import BatchData, BatchDataByShape
    from bridgeflow.pipeline import iter_flows

    for _, flow in iter_flows(df):
        if isinstance(flow, (BatchData, BatchDataByShape)):
            return bool(flow.remainder)
    return False
