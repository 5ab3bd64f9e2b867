"""``DataLoader``: a ``torch.utils.data.DataLoader`` subclass running on bridgeflow's workers.

Switch by changing one import::

    from bridgeflow.adapters.torch import DataLoader   # instead of torch.utils.data.DataLoader

It *is* a torch DataLoader (``isinstance`` holds, ``DataLoader[T]`` works), built by torch's own
constructor, so arguments, validation errors, attributes, ``len()``, default samplers and DataPipe settings are
torch's, and frameworks that re-create a loader from its ``__init__`` arguments (Lightning injecting a
``DistributedSampler``) get this class back. Only the iterator differs: batches come from a bridgeflow
:class:`~bridgeflow.parallel.WorkerPool` through reused shared memory, with torch's random streams (worker
seeds, shuffles drawn from ``generator``), ``get_worker_info()``, DataPipe sharding and task-to-worker
assignment, so the same arguments give the same batches. ``state_dict()``/``load_state_dict()`` resume an
epoch exactly (see :mod:`bridgeflow.adapters.torch._state`).

Differences, on purpose:

- a bridgeflow :class:`~bridgeflow.DataFlow` is accepted as ``dataset`` (see :mod:`._flows`): a random-access
  one (``len()`` and ``flow[i]``) is read as a map-style dataset, each worker reading and mapping its own
  indices (a flow that shuffles itself is read in the order the loader draws); a length-free one made of
  datapoint transforms over a random-access source is split across the workers, each reading its piece of
  every epoch; any other is iterated once per epoch in this process, and
  with ``num_workers > 0`` only ``collate_fn`` runs in the workers (said once,
  :class:`~._flows.UnsplitFlowWarning`). A length-free flow has one reader at a time: a new ``iter(loader)``
  ends the previous iterator's epoch (persistent workers restart it, as torch's do);
- ``in_order=False`` hands out map-style batches as they are ready, as torch does, and ``state_dict()``
  resumes such an epoch with exactly the batches not yet handed out; iterable datasets and DataFlows keep
  their order (torch allows, never promises, reordering);
- a tensor that a worker returns without collation (``batch_size=None``, a custom ``collate_fn``) arrives
  with the same dtype, shape and values but compact: a view keeps neither its strides nor its sharing of
  storage with other returned tensors (torch ships the whole storage of every view, which costs a copy of
  e.g. a whole in-memory table per sample);
- an exception of a DataFlow comes after the batches read before it, as with ``num_workers=0``;
- a worker whose ``worker_init_fn`` or ``iter(dataset)`` failed raises that error with its first batch
  (as torch), then a ``RuntimeError`` naming it for its later map-style batches; an iterable worker is
  then exhausted (torch raises an ``UnboundLocalError`` for each);
- ``close()`` ends persistent workers now instead of at garbage collection.

Example:
    >>> import torch
    >>> from bridgeflow.adapters.torch import DataLoader
    >>> loader = DataLoader(list(range(10)), batch_size=4)
    >>> [b.tolist() for b in loader]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
"""

from __future__ import annotations

import copy
import multiprocessing as python_multiprocessing
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bridgeflow import DataFlow
from bridgeflow.engine import check_max_restarts, warn_if_unsharded
from bridgeflow.pipeline import iter_flows

from . import _compat
from ._compat import torch
from ._epoch import EpochIterator, EpochStats
from ._fetch import COLLATE, ITERABLE, MAP
from ._flows import FlowItems, FlowShards, indexable, shuffles_itself, split_source, warn_double_shuffle, warn_unsplit
from ._resume import ResumePlan, take_up
from ._state import EpochRecord, check_state, export_state

__all__ = ["DataLoader"]

_tud = torch.utils.data
T_co = TypeVar("T_co", covariant=True)


def _check_flow_args(flow: DataFlow, shuffle: Any, sampler: Any, batch_sampler: Any) -> None:
    """A length-free DataFlow is a stream: like an IterableDataset it takes no shuffle or sampler."""
    if shuffle not in {False, None}:
        how = ("it shuffles itself, so leave shuffle unset" if shuffles_itself(flow) else
               "shuffle it in the flow instead (its source's shuffle=True, or LocallyShuffleData)")
        raise ValueError(f"DataLoader with DataFlow: expected unspecified shuffle option, but got shuffle={shuffle}: "
                         f"{type(flow).__name__} has no len() and flow[i], so it is read as a stream in its own "
                         f"order; {how}")
    if sampler is not None and not isinstance(sampler, _compat.InfiniteConstantSampler):
        hint = ""
        if isinstance(sampler, _tud.distributed.DistributedSampler):
            hint = (" (a distributed sampler: Lightning injects one under DDP; a DataFlow cannot be indexed, "
                    "so shard the flow per rank and pass use_distributed_sampler=False to the Trainer)")
        raise ValueError(f"DataLoader with DataFlow: expected unspecified sampler option, but got "
                         f"sampler={sampler}{hint}")
    if batch_sampler is not None:
        raise ValueError(f"DataLoader with DataFlow: expected unspecified batch_sampler option, but got "
                         f"batch_sampler={batch_sampler}")


@dataclass(eq=False)
class Internals:
    """What bridgeflow keeps on a :class:`DataLoader` beside torch's attributes, as one object
    (``loader._bf``): how the dataset is read, and the loader's iterators and states. What the loader's
    running changes is changed by the methods here, which the other modules call (tests set
    ``pin_backend``)."""

    kind: str  # MAP, ITERABLE or COLLATE (a DataFlow read as a stream here, only collation in the workers)
    items: Any  # the dataset as the iterators read it (a random-access DataFlow: by index)
    view: FlowItems | FlowShards | None = None  # how a DataFlow dataset is read (see .flows)
    stream: bool = False  # a DataFlow with one reader at a time: a new iter() ends the previous epoch
    shard_checked: bool = False  # a DataFlow read by one of several ranks: warned if unsharded
    pin_backend: Any = None  # tests: ``alloc(shape, dtype)``/``is_pinned(t)`` standing for pinned memory
    mapping_hooks: Any = None  # told about the slabs of every pool this loader's iterators start
    # --- set as the loader runs -----------------------------------------------------------------------
    record: EpochRecord | None = None  # the progress of the latest iterator's epoch
    stats: EpochStats | None = None  # the latest epoch's figures (kept after its iterator is gone)
    pending: dict | None = None  # a loaded state, taken up by the next iter() (see .resume)
    kept: dict | None = None  # a state between two epochs of persistent workers: their seeds and states
    rng_chain: str | None = None  # see state.loader_draws
    latest: Any = None  # weak reference to the latest iterator
    reader: Any = None  # weak reference to a read-ahead answering state_dict() (attach_read_ahead)
    iters: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # iterators that may still run

    def latest_iterator(self) -> Any:
        return self.latest() if self.latest is not None else None

    # --- changed as the loader runs -------------------------------------------------------------------

    def begin(self, record: EpochRecord, it: EpochIterator) -> None:
        """``iter()`` returned ``it``, whose epoch's progress ``record`` is."""
        self.record = record
        self.latest = weakref.ref(it)

    def started(self, it: EpochIterator) -> None:
        """A new iterator, which may run until it is shut down (told about mapping hooks set meanwhile)."""
        self.iters.add(it)

    def show_stats(self, stats: EpochStats) -> EpochStats:
        """``stats`` are the latest epoch's figures (``loader.stats()``, kept after the iterator is gone)."""
        self.stats = stats
        return stats

    def attach_reader(self, reader: Any) -> None:
        """A read-ahead answers ``state_dict()`` (None: nothing does, the loader's own record answers)."""
        self.reader = None if reader is None else weakref.ref(reader)

    def load(self, checked: dict) -> None:
        """A checked state is taken up by the next ``iter()``; any read-ahead's view of the position is over."""
        self.reader = None
        self.pending = checked

    def take_pending(self) -> dict | None:
        """The loaded state, once: the ``iter()`` that takes it up."""
        pending, self.pending = self.pending, None
        return pending

    def keep(self, base_seed: int, workers: list | None, reuse: int) -> None:
        """A state saved between two epochs of persistent workers: the next epoch runs on ``base_seed`` (the
        ``reuse``-th epoch on it), its workers' datasets restored to ``workers``' states."""
        self.kept = {"base_seed": base_seed, "workers": workers, "reuse": reuse}

    def take_kept(self) -> dict:
        """What :meth:`keep` kept (``{}`` when nothing), once: the epoch that starts from it."""
        kept, self.kept = self.kept or {}, None
        return kept

    def chain(self, rng: str | None) -> None:
        """The global RNG state later epochs draw from (None: torch's global RNG; see state.loader_draws)."""
        self.rng_chain = rng

    def check_shards_once(self) -> bool:
        """Whether the warnings about an unsharded or unsplit DataFlow are still to give (once per loader)."""
        first, self.shard_checked = not self.shard_checked, True
        return first

    def set_hooks(self, hooks: Any) -> None:
        self.mapping_hooks = hooks

    def __getstate__(self) -> dict:
        """Pickled with the loader (for another process): not this process's iterators, record, figures or
        read-ahead, nor its mapping hooks (they act on this process's mappings); a loaded state travels."""
        state = dict(self.__dict__)
        for name in _LOCAL:
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in _LOCAL:
            setattr(self, name, weakref.WeakSet() if name == "iters" else None)


_LOCAL = ("record", "stats", "latest", "reader", "mapping_hooks", "iters")


class DataLoader(_compat.TorchDataLoader[T_co]):
    """Drop-in replacement for ``torch.utils.data.DataLoader`` running on bridgeflow's worker pool.

    Takes exactly torch's arguments (see the module docstring for the few differences), plus
    ``seed_per_sample`` (below) and torchdata ``StatefulDataLoader``'s one keyword, ``snapshot_every_n_steps``
    (an integer >= 0 or None, kept as an attribute): it changes nothing here. torchdata sends the workers'
    states to the main process every n steps and replays up to n - 1 batches at a resume; bridgeflow's workers
    send their dataset's state with every batch (only datasets with ``state_dict()`` have one, and it costs
    one small pickle per batch), so ``state_dict()`` is exact at every step whatever n is. ``dataset`` may be a
    map-style dataset, a ``torch.utils.data.IterableDataset`` (DataPipes included) or a bridgeflow ``DataFlow``.

    ``seed_per_sample=True`` reads every sample with Python's ``random``, numpy's and torch's CPU generators
    (and bridgeflow's augmentors) seeded from the sample's place in the epoch and the epoch's base seed
    (:mod:`bridgeflow.adapters.torch._sample_seeds`): random augmentations come out the same at any
    ``num_workers`` and after a resume, byte for byte. Off by default: torch draws them from each worker's
    stream, and seeding costs some microseconds per sample (``docs/torch.md``).

    And two keywords of bridgeflow's own, for faults (see the Faults page), kept as attributes too:

    - ``max_restarts`` (default 0): how many dead worker processes (a signal, the OOM killer, an exit) are
      replaced in an iterator's life (an epoch; the loader's life with ``persistent_workers``) before a
      death is an error, as torch's. A replacement has the dead worker's id, seed and ``get_worker_info()``,
      runs ``worker_init_fn`` and reads the batches the dead one held again: the epoch gives the batches of
      an undisturbed run. Map-style datasets and DataFlows read in this process; an ``IterableDataset``
      worker's stream position dies with it, so it is refused there.
    - ``on_error`` (default ``"raise"``): ``"skip"`` leaves a sample whose ``__getitem__`` raises out of its
      batch (the batch is shorter: batches stay the sampler's; a batch left empty is not handed out),
      counts it in ``stats()["DataLoader"]["skipped"]`` and logs its index and the exception; a sample that
      kills every worker it meets is left out alike (within ``max_restarts``). Map-style datasets only; the
      same with ``num_workers=0``.

    Example:
        >>> loader = DataLoader(list(range(6)), batch_size=2, shuffle=True,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> it = iter(loader); first = next(it)
        >>> state = loader.state_dict()             # plain data: torch.save or json.dump it
        >>> again = DataLoader(list(range(6)), batch_size=2, shuffle=True,
        ...                    generator=torch.Generator().manual_seed(0))
        >>> again.load_state_dict(state)
        >>> [b.tolist() for b in again] == [b.tolist() for b in it]
        True
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable | None = None, pin_memory: bool = False, drop_last: bool = False,
                 timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: Any = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True,
                 snapshot_every_n_steps: int | None = 1, seed_per_sample: bool = False, max_restarts: int = 0,
                 on_error: str = "raise") -> None:
        is_flow = isinstance(dataset, DataFlow)
        by_index = is_flow and indexable(dataset)  # read as a map-style dataset (see .flows)
        if by_index and sampler is None and batch_sampler is None and shuffles_itself(dataset):
            if shuffle:  # as torch's loader: the loader's order; the flow's own is not used (said once)
                warn_double_shuffle(dataset)
            if shuffle is None:  # the flow's own shuffle, drawn from the loader's generator
                shuffle = True
        elif is_flow and not by_index:
            _check_flow_args(dataset, shuffle, sampler, batch_sampler)
            shuffle, sampler = None, _compat.InfiniteConstantSampler()
        split = is_flow and not by_index and split_source(dataset) is not None
        if snapshot_every_n_steps is not None and (
                isinstance(snapshot_every_n_steps, bool) or not isinstance(snapshot_every_n_steps, int)
                or snapshot_every_n_steps < 0):
            raise ValueError(f"snapshot_every_n_steps should be a non-negative integer or None, but got "
                             f"snapshot_every_n_steps={snapshot_every_n_steps!r}")
        # by keyword: a framework that recorded this call (Lightning, when the class is imported inside its
        # hook) and re-creates it with its own sampler= must not collide with a positional argument
        super().__init__(dataset=dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                         pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
                         worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                         generator=generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
                         in_order=in_order)
        self.snapshot_every_n_steps = snapshot_every_n_steps  # accepted, changes nothing (see the class doc)
        if not isinstance(seed_per_sample, bool):
            raise TypeError(f"seed_per_sample should be True or False, but got "
                            f"seed_per_sample={seed_per_sample!r}")
        self.seed_per_sample = seed_per_sample
        view = FlowItems(dataset) if by_index else FlowShards(dataset) if split else None
        if is_flow and not by_index:
            kind = ITERABLE if split else COLLATE
            _compat.read_as_iterable(self, True)
        else:
            kind = ITERABLE if _compat.read_as_iterable(self) else MAP
        self.max_restarts = check_max_restarts(max_restarts, "DataLoader")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"DataLoader: on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        if max_restarts and kind == ITERABLE:
            raise ValueError(f"DataLoader: max_restarts={max_restarts} needs a map-style dataset (or a DataFlow read "
                             f"by index or in this process): a worker of {type(dataset).__name__} reads its own "
                             "stream, and where it was in it dies with it")
        if on_error == "skip" and kind != MAP:
            raise ValueError(f"DataLoader: on_error='skip' leaves out samples whose __getitem__ raises, and "
                             f"{type(dataset).__name__} is not read by index (a map-style dataset, or a DataFlow with "
                             "len() and flow[i]); a DataFlow's map stages take on_error= themselves")
        self._bf = Internals(kind, dataset if view is None else view, view, stream=is_flow and not by_index)

    @property
    def start_method(self) -> str:
        """The start method the workers use (``"fork"``, ``"spawn"`` or ``"forkserver"``).

        It is the ``multiprocessing_context``'s when one is given, else multiprocessing's default.
        """
        ctx = self.multiprocessing_context
        if ctx is not None:
            return ctx.get_start_method()
        return (python_multiprocessing.get_start_method(allow_none=True)
                or python_multiprocessing.get_all_start_methods()[0])

    # --- iteration ----------------------------------------------------------------------------------

    def _new_iterator(self, record: EpochRecord, plan: ResumePlan | None) -> EpochIterator:
        if self.num_workers > 0:
            self.check_worker_number_rationality()
        it = EpochIterator(self, record, plan)
        self._bf.started(it)
        return it

    def _get_iterator(self) -> Any:
        """A fresh epoch iterator (torch's hook; ``iter(loader)`` is what takes up a loaded state)."""
        return self._new_iterator(EpochRecord(self), None)

    def __iter__(self) -> Any:
        bf = self._bf
        bf.attach_reader(None)  # a new reader: the last one's view of the position is over
        latest, held = bf.latest_iterator(), _compat.held_iterator(self)
        if bf.stream and latest is not None and latest is not held:
            latest.shutdown()  # a flow has one reader: the previous iterator's epoch ends here
        if isinstance(self.dataset, DataFlow) and bf.check_shards_once():  # every epoch would repeat them
            samplers = (self.sampler, getattr(self.batch_sampler, "sampler", None))
            if not any(isinstance(s, _tud.distributed.DistributedSampler) for s in samplers):
                warn_if_unsharded(self.dataset, "DataLoader")
            if bf.kind == COLLATE:
                warn_unsplit(self.dataset, self.num_workers)
        plan = take_up(self, bf.take_pending())
        if isinstance(bf.view, FlowShards) and self.num_workers > 0:
            bf.view.start(resumed=plan is not None)  # before the workers start
        record = EpochRecord(self)
        if self.persistent_workers and self.num_workers > 0:
            it = held
            if it is None or it.closed or plan is not None:
                if it is not None:
                    it.shutdown()
                it = self._new_iterator(record, plan)
                _compat.set_held_iterator(self, it)
            else:
                it.reset(self, record)
        else:
            it = self._new_iterator(record, plan)
        bf.begin(record, it)
        return it

    # --- state --------------------------------------------------------------------------------------

    def attach_read_ahead(self, reader: Any) -> None:
        """Let ``reader`` (a :class:`bridgeflow._base.ReadAhead`, e.g. a CUDA prefetcher) answer ``state_dict()``
        until the next ``iter()`` or ``load_state_dict()``."""
        self._bf.attach_reader(reader)

    def state_dict(self) -> dict[str, Any]:
        """Where the latest iterator is in its epoch, as plain data (torchdata's ``StatefulDataLoader``
        semantics: a loader given it yields what this one would have yielded next).

        Read by a :class:`~bridgeflow.adapters.torch.CUDAPrefetcher`, which fetches batches ahead of your
        loop, it is the state as of the last batch the prefetcher handed to you."""
        bf = self._bf
        reader = bf.reader() if bf.reader is not None else None
        if reader is not None:
            delivered = reader.delivered_state(self)
            if delivered is not None:
                return delivered
        if bf.pending is not None:
            return copy.deepcopy(bf.pending)
        return export_state(self, bf.record)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict`` at the next ``iter()``; a state that does not fit this loader raises
        a ``ValueError`` naming the mismatch. ``{}`` is ignored, as torchdata does."""
        if state_dict == {}:
            return
        checked = check_state(self, state_dict)
        it = _compat.held_iterator(self)
        if it is not None and hasattr(it, "shutdown"):
            it.shutdown()
        _compat.set_held_iterator(self, None)
        self._bf.load(checked)

    # --- statistics ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, float]]:
        """The loader's figures in the shape of a DataFlow's ``df.stats()``, so that
        :func:`bridgeflow.pipeline.bottleneck` reads them: under ``"DataLoader"`` the latest epoch's, also
        after it ended or was left (``batches``, ``workers``, ``consumer_wait_s`` and ``consumer_wait_frac``:
        your loop's time spent waiting for batches; with workers ``buffer_fill``: how full the
        ``prefetch_factor * num_workers`` batches in flight were when asked, and ``workers_busy``: the share of
        the workers' time spent reading and collating), and a DataFlow dataset's stages under
        ``"DataLoader/<their path>"``.

        Example:
            >>> from bridgeflow.pipeline import bottleneck
            >>> loader = DataLoader(list(range(8)), batch_size=4)
            >>> _ = list(loader)
            >>> sorted(loader.stats()["DataLoader"])
            ['batches', 'consumer_wait_frac', 'consumer_wait_s', 'workers']
            >>> bottleneck(loader.stats()).startswith("the ")
            True
        """
        out: dict[str, dict[str, float]] = {}
        own = self._bf.stats.figures() if self._bf.stats is not None else {}
        if own:
            out["DataLoader"] = own
        if isinstance(self.dataset, DataFlow):
            for path, values in self.dataset.stats().items():
                out[f"DataLoader/{path}"] = values
        return out

    # --- shared-memory slabs ------------------------------------------------------------------------

    def set_mapping_hooks(self, hooks: Any) -> None:
        """Tell ``hooks`` when a shared-memory slab this loader reads batches from is mapped and before it
        is unmapped (:class:`~bridgeflow.parallel.MappingHooks`; ``None`` removes them): the slabs
        of the worker pool of every iterator, running or started later (persistent workers included),
        and of the parallel stages of a DataFlow dataset. :class:`CUDAPrefetcher` calls it to page-lock
        the slabs (:class:`~bridgeflow.adapters.torch._pinning.SlabPinner`), so its copies read batches
        where the workers wrote them.
        """
        self._bf.set_hooks(hooks)
        for it in list(self._bf.iters):
            it.set_mapping_hooks(hooks)
        if isinstance(self.dataset, DataFlow):
            for _, flow in iter_flows(self.dataset):
                setter = getattr(flow, "set_mapping_hooks", None)
                if callable(setter):
                    setter(hooks)

    # --- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers now: persistent ones, and those of the latest iterator if it is still running."""
        for it in (_compat.held_iterator(self), self._bf.latest_iterator()):
            if it is not None and hasattr(it, "shutdown"):
                it.shutdown()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        """Picklable as torch's loader is (Lightning's ddp_spawn sends loaders to its processes): the running
        iterator and its record stay behind; a loaded, not yet applied state travels."""
        state = self.__dict__.copy()
        state["_iterator"] = None
        return state
