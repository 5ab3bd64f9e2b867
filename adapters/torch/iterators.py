"""The epoch iterators behind :class:`~bridgeflow.adapters.torch.DataLoader`: what they share, and the one
that reads in this process (``num_workers=0``); :mod:`.pool_iter` has the one that drives worker processes.

Both draw the workers' base seed from the loader's ``generator`` before the sampler runs, exactly where torch
draws it (after a DataPipe's shuffle seed), so the random streams of sampler and workers match torch's.
They are ``_BaseDataLoaderIter`` subclasses, so code that recognises torch's iterators by class (Lightning's
``CombinedLoader``) treats them as such, but none of torch's iterator code runs. Each keeps its epoch's
:class:`~bridgeflow.adapters.torch.state.EpochRecord` up to date for ``loader.state_dict()``.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

from bridgeflow.errors import BridgeflowError

from . import _compat
from ._compat import torch
from .fetch import COLLATE, ITERABLE, MAP, Fetcher, make_fetcher, resolve_collate
from .reader import EpochIterator, loader_pinner, update_pinner
from .state import EpochRecord, apply_generators, flow_state, replayed_indices

__all__ = ["LoaderStateError", "SingleLoaderIter", "close_source", "pins"]

log = logging.getLogger(__name__)


def close_source(fetcher: Fetcher | None) -> None:
    """End the iteration a fetcher holds (a DataFlow's generator releases the flow for its next reader)."""
    close = getattr(getattr(fetcher, "iterator", None), "close", None)
    if close is not None:
        close()


def _seeded(seed: int) -> Any:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def pins(loader: Any) -> bool:
    """Whether the loader's batches are pinned: ``pin_memory=True`` and an accelerator to pin for (not MPS,
    as torch), or a test backend standing for pinned memory (``loader._bf_pin_backend``)."""
    if not loader.pin_memory:
        return False
    if getattr(loader, "_bf_pin_backend", None) is not None:
        return True
    return _compat.accelerator_available() and _compat.current_accelerator_type() != "mps"


class LoaderStateError(BridgeflowError, ValueError, AssertionError):
    """Options that torch accepts at construction but refuses when iteration starts (with an
    ``AssertionError``; this error is one too, and a ``ValueError``)."""


class LoaderIter(EpochIterator):
    """What both iterators share: seeds, the sampler (replayed on resume), pinning, the epoch record, and
    torch's warning for an over-long iterable.

    ``resume`` is a checked ``state_dict`` of an epoch in progress; None starts a fresh epoch.
    """

    def __init__(self, loader: Any, record: EpochRecord, resume: dict | None) -> None:
        self._loader_ref = weakref.ref(loader)  # weak: a persistent iterator is held by its loader
        self._kind = loader._bf_kind
        self._dataset = loader.dataset
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._collate_fn = loader.collate_fn
        self._num_workers = loader.num_workers
        self._timeout = loader.timeout
        self._persistent_workers = loader.persistent_workers
        self._world_size, self._rank = _compat.distributed_settings()
        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn("pin_memory_device is deprecated, the current accelerator will be used as the "
                          f"device, ignore pin_memory_device='{loader.pin_memory_device}'.", stacklevel=4)
        if (loader.pin_memory and getattr(loader, "_bf_pin_backend", None) is None
                and not _compat.accelerator_available()):
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then device "
                          "pinned memory won't be used.", stacklevel=4)
        self._pin_memory = pins(loader)
        self._pinner: Any = None  # pins in this thread (num_workers=0, as torch does); see _pin
        self.closed = False
        self._seed_group = _compat.seed_group() if isinstance(self._dataset, _compat.IterDataPipe) else None
        self._start(loader, record, resume)

    def _start(self, loader: Any, record: EpochRecord, resume: dict | None, first: bool = True) -> None:
        """Start an epoch: the first (``first``), or another on the same workers (persistent workers keep
        their seeds, as torch's ``_reset`` does). Draws from the loader's generator in torch's order."""
        self._record = record
        self._len_called = loader._IterableDataset_len_called
        self._sampler_iter = None
        if first:
            self._shared_seed = None
            self._new_shared_seed(loader, resume)
        if resume is None:
            self._sampler_iter = iter(self._index_sampler)
            if first:
                # a state saved between two epochs of persistent workers keeps their seed: torch draws none then
                kept = loader.__dict__.pop("_bf_kept_base_seed", None)
                self._base_seed = (kept if kept is not None else
                                   torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
            else:
                self._new_shared_seed(loader, None)
            self._rng_pending = self._kind == MAP
            self._num_yielded = 0
        else:
            self._base_seed = resume["base_seed"]
            if self._kind == MAP:
                self._sampler_iter = replayed_indices(loader, resume, resume["yielded"])
            else:  # placeholders: nothing to replay; the generators continue from where they were
                apply_generators(loader, resume.get("rng_now"))
                self._sampler_iter = iter(self._index_sampler)
            self._rng_pending = False
            self._num_yielded = resume["yielded"]
            record.rng_first, record.sampler_epoch = resume.get("rng_first"), resume.get("sampler_epoch")
            record.yielded, record.last_worker = resume["yielded"], resume.get("last_worker")
            record.workers, record.exhausted = resume.get("workers"), resume.get("exhausted")
            record.flow, record.flow_ended = resume.get("flow"), resume.get("flow_ended", False)
        record.base_seed, record.shared_seed = self._base_seed, self._shared_seed

    def _new_shared_seed(self, loader: Any, resume: dict | None) -> None:
        """A DataPipe's shuffle seed for the epoch, and its graph reshuffled with it (torch's order)."""
        if isinstance(self._dataset, _compat.IterDataPipe):
            self._shared_seed = (resume["shared_seed"] if resume
                                 else _compat.share_seed(loader.generator, self._seed_group))
            self._dataset = _compat.apply_random_seed(self._dataset, _seeded(self._shared_seed))

    def _next_index(self) -> Any:
        if self._rng_pending:  # the epoch's first index: snapshot what the sampler may draw from
            self._rng_pending = False
            loader = self._loader_ref()
            if loader is not None:
                self._record.snapshot_rngs(loader)
        return next(self._sampler_iter)

    def _note_flow(self, record: EpochRecord, fetcher: Fetcher) -> None:
        """After a DataFlow batch is delivered: the flow's position between it and the next one."""
        record.flow_ended = fetcher.ended
        if record.problem is None:
            record.flow, record.problem = flow_state(self._dataset)

    def __iter__(self) -> LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __next__(self) -> Any:
        data = self._next_data()
        self._count_yield()
        if self._pin_memory and self._pins_here:
            data = self._pin(data)
        return data

    def _count_yield(self, stacklevel: int = 3) -> None:
        """One more batch handed out; torch's warning when an iterable gives more than its ``len()``."""
        self._num_yielded += 1
        if self._kind == ITERABLE and self._len_called is not None and self._num_yielded > self._len_called:
            msg = (f"Length of IterableDataset {self._dataset} was reported to be {self._len_called} (when "
                   f"accessing len(dataloader)), but {self._num_yielded} samples have been fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly configuring "
                        "the IterableDataset replica at each worker.")
            warnings.warn(msg, stacklevel=stacklevel)

    _pins_here = True  # False where a reading thread pins (pool_iter)

    def _pin(self, data: Any) -> Any:
        if self._pinner is None:
            loader = self._loader_ref()
            if loader is None:
                return data
            self._pinner = loader_pinner(loader, threads=1)  # torch's copy_ only: no helper threads
        return self._pinner(data)

    def set_mapping_hooks(self, hooks: Any) -> None:
        """The loader's slab-mapping hooks changed (see ``DataLoader.set_mapping_hooks``)."""
        if self._pinner is not None:
            update_pinner(self._pinner, hooks)

    def _next_data(self) -> Any:
        raise NotImplementedError

    def reset(self, loader: Any, record: EpochRecord) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        self.closed = True


class SingleLoaderIter(LoaderIter):
    """One epoch read in this process."""

    def __init__(self, loader: Any, record: EpochRecord, resume: dict | None = None) -> None:
        if loader.timeout != 0:
            raise LoaderStateError(f"timeout={loader.timeout} needs num_workers > 0: with num_workers=0 "
                                   "batches are read in this process and cannot time out")
        self._fetcher: Fetcher | None = None
        super().__init__(loader, record, resume)
        if isinstance(self._dataset, (_compat.IterDataPipe, _compat.MapDataPipe)):
            _compat.apply_sharding(self._dataset, self._world_size, self._rank)
        kind = ITERABLE if self._kind == COLLATE else self._kind
        if self._kind == COLLATE and resume is None:
            record.flow, record.problem = flow_state(self._dataset)  # where this epoch starts
        saved = resume["workers"][0] if resume and resume.get("workers") else None
        self._fetcher = make_fetcher(kind, self._dataset, self._auto_collation,
                                     resolve_collate(self._collate_fn, in_worker=False), self._drop_last, saved)
        if self._fetcher.stateful and self._kind != COLLATE:
            record.live = self._fetcher  # its state is read when the loader's state is asked for
        if resume and resume.get("flow_ended"):
            self._fetcher.ended = True  # the flow ran out with the last batch delivered: nothing is left
        if resume and self._kind == ITERABLE and saved is None and resume["yielded"]:
            self._fast_forward(resume["yielded"])

    def _fast_forward(self, batches: int) -> None:
        log.warning("resuming %s: neither the dataset nor its iterator has state_dict()/load_state_dict(), so "
                    "the %d batches already delivered this epoch are read again and dropped",
                    type(self._dataset).__name__, batches)
        for _ in range(batches):
            try:
                self._fetcher.fetch(next(self._sampler_iter))
            except StopIteration:
                break
            except Exception as exc:  # raised to the consumer in the interrupted run already
                log.debug("fast-forward: a dropped batch raised %r again", exc)

    def _next_data(self) -> Any:
        try:
            data = self._fetcher.fetch(self._next_index())
        except StopIteration:
            self._record.finished = True
            if self._kind == COLLATE:
                self._note_flow(self._record, self._fetcher)
            self.shutdown()
            raise
        except Exception:  # a batch that raised is consumed too: a resume must not read it again
            self._consumed()
            raise
        self._consumed()
        return data

    def _consumed(self) -> None:
        self._record.yielded += 1
        if self._kind == COLLATE:
            self._note_flow(self._record, self._fetcher)

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            close_source(self._fetcher)
