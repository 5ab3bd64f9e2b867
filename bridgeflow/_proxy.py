"""``ProxyDataFlow``: a flow that wraps one other flow and, by default, forwards everything to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ._base import DataFlow
from ._iterables import as_dataflow
from ._state import child_state
from ._state_schema import Child, Field

__all__ = ["ProxyDataFlow"]


class ProxyDataFlow(DataFlow):
    """A flow that wraps one other flow, ``self.ds`` (a plain iterable is wrapped in ``DataFromIterable``).

    Its state is its child's, under ``"child"``: a flow that holds nothing between two datapoints (a map,
    a filter) is wherever its child is.
    """

    state_fields: tuple[Field, ...] | None = (Child(),)

    def __init__(self, ds: DataFlow) -> None:
        self.ds = as_dataflow(ds, type(self).__name__)

    def __len__(self) -> int:
        return len(self.ds)

    def children(self) -> list[DataFlow]:
        return [self.ds]

    def _on_reset(self) -> None:
        for child in self.children():
            child.reset_state()
        super()._on_reset()

    def _begin_epoch(self, resume: dict | None) -> Iterator[Any]:
        return iter(self.ds)

    def _own_state(self) -> dict:
        return {"child": child_state(self.ds)}
