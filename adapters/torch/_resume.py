"""Taking up a loaded state at the next ``iter()``: what to restore first, and how the epoch goes on.

``loader.load_state_dict(state)`` only checks the state (:func:`~._state.check_state`); the next ``iter()``
calls :func:`take_up`, which restores what comes before any iterator (the dataset's and the DataFlow's own
states, the chain of global-RNG draws, and at an epoch boundary the generators and the seeds and states of
persistent workers) and, for a state taken inside an epoch, returns a :class:`ResumePlan`: the seeds, which
tasks to replay or skip, which worker gets the next task, and the workers' dataset states. How each kind of
dataset resumes is described in :mod:`._state`.

Example:
    >>> from bridgeflow.adapters.torch import DataLoader
    >>> loader = DataLoader(list(range(6)), batch_size=2)
    >>> it = iter(loader); _ = next(it)
    >>> again = DataLoader(list(range(6)), batch_size=2)
    >>> again.load_state_dict(loader.state_dict())
    >>> [b.tolist() for b in again]                      # take_up ran at this iter()
    [[2, 3], [4, 5]]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._fetch import ITERABLE
from ._state import EpochRecord, apply_generators, chain_from

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["ResumePlan", "take_up"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """How an epoch in progress goes on (from its checked ``state``)."""

    state: dict
    first_task: int  # the first task not delivered: the sampler is replayed up to it
    ahead: frozenset[int] | None  # tasks after it delivered already (in_order=False): skipped
    worker_states: list | None  # each worker's dataset state, restored before its iter(dataset)
    exhausted: list[bool] | None  # workers whose stream had run out
    next_worker: int  # the worker the next task goes to
    discard: int  # batches read again and dropped (an iterable dataset without a state: from its start)

    @classmethod
    def of(cls, state: dict, kind: str, dataset: Any) -> ResumePlan:
        yielded, ahead = state["yielded"], state.get("ahead")
        workers, exhausted, last = state.get("workers"), state.get("exhausted"), state.get("last_worker")
        discard = 0
        if kind == ITERABLE and not workers:  # the whole epoch again, from the start
            if yielded:
                log.warning("resuming %s: neither the dataset nor its iterator has state_dict()/load_state_dict(), "
                            "so the %d batches already delivered this epoch are read again and dropped",
                            type(dataset).__name__, yielded)
            discard, exhausted, last = yielded, None, None
        return cls(state, yielded - len(ahead or ()), None if ahead is None else frozenset(ahead), workers,
                   exhausted, 0 if last is None else last + 1, discard)

    def restore(self, record: EpochRecord) -> None:
        """The epoch's record as it was when the state was taken."""
        s = self.state
        record.rng_first, record.sampler_epoch = s.get("rng_first"), s.get("sampler_epoch")
        record.yielded, record.last_worker = s["yielded"], s.get("last_worker")
        record.workers, record.exhausted = s.get("workers"), s.get("exhausted")
        record.flow, record.flow_ended = s.get("flow"), s.get("flow_ended", False)
        record.rng_next = s.get("rng_next")
        record.ahead = None if self.ahead is None else set(self.ahead)
        record.reuse = s.get("reuse", 0)


def take_up(loader: DataLoader, state: dict | None) -> ResumePlan | None:
    """Apply the parts of a loaded ``state`` that come before an iterator; the plan of the epoch it resumes,
    or None when it was taken outside an epoch (the next epoch then starts fresh from the restored RNGs)."""
    if state is None:
        return None
    bf = loader._bf
    if state.get("dataset") is not None:
        bf.items.load_state_dict(state["dataset"])
    if state.get("flow") is not None:
        flow: Any = loader.dataset  # a DataFlow (check_state found its load_state_dict())
        flow.load_state_dict(state["flow"])
    chain_from(loader, state)
    if state["started"] and not state["finished"]:
        return ResumePlan.of(state, bf.kind, bf.items)
    apply_generators(loader, state.get("rng_now"))
    if state.get("base_seed") is not None and loader.persistent_workers and loader.num_workers > 0:
        # the next epoch runs on the same workers: their seeds, and their datasets' states at the end of the
        # saved epoch (restored in each worker before its next iter(dataset))
        bf.keep(state["base_seed"], state.get("workers"), state.get("reuse", 0) + 1)
    return None
