"""Where a :class:`~bridgeflow.adapters.torch.DataLoader` is in its epoch, as plain data.

``loader.state_dict()`` exports an :class:`EpochRecord` (kept up to date by the epoch's iterator, cheaply: a
counter, the worker of the last batch and, for stateful datasets, the states the workers sent with their
batches). ``loader.load_state_dict(state)`` checks the state against the loader (:func:`check_state`) and
the next ``iter()`` resumes from it. The semantics are torchdata's ``StatefulDataLoader``'s: after ``k``
batches, a new loader given the state yields exactly what the uninterrupted run would have yielded next.

How each part resumes:

- **indices** (map-style datasets): the sampler is replayed. The torch generators it may draw from (the
  loader's ``generator``, samplers' own generators, torch's global RNG) are snapshotted just before the
  epoch's first index is drawn; on resume they are set back (the global RNG only for the replay, then
  restored), ``set_epoch`` is re-applied, and the first ``k`` batches of indices are skipped. This is exact
  for every sampler whose randomness comes from torch generators (all of torch's and torchdata's);
- **in_order=False**: batches are handed out as they are ready; the state also lists the tasks delivered
  before an earlier one still in flight (``ahead``), and a resume reads every other task of the epoch: the
  same batches as the uninterrupted run, in the order they are ready;
- **workers**: the epoch's base seed is saved, so every worker gets the seeds (and ``get_worker_info()``)
  of the uninterrupted run, and batch ``k`` goes to the worker it went to. As in torchdata, the workers'
  random streams restart from those seeds: augmentations drawn after a resume are not the ones the
  uninterrupted run would have drawn (derive them from the index to make them so);
- **datasets with ``state_dict``/``load_state_dict``** (or whose ``iter()`` returns such an object): each
  worker attaches its state to its batches; the state of the last delivered batch of each worker is kept
  and restored in that worker (torchdata's convention). An iterable dataset without one is fast-forwarded
  by reading and dropping ``k`` batches (logged);
- **DataFlows** delegate to the flow's ``state_dict()``/``load_state_dict()`` (see the docs' Resuming page,
  ``docs/resuming.md``), recorded before each batch's samples are pulled.

RNG states are base64 text, so a state is ``torch.save``-able and JSON-able when the dataset states are.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import logging
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any

from bridgeflow import StateMismatchError
from bridgeflow.engine import MAX_DEPTH, short

from . import _compat
from ._compat import InfiniteConstantSampler, torch
from ._state_fields import LoaderFacts, check_loader_state, fields_checksum

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = [
    "FORMAT",
    "VERSION",
    "EpochRecord",
    "apply_generators",
    "ResumeStateError",
    "chain_from",
    "check_state",
    "draws_global",
    "export_state",
    "flow_state",
    "is_stateful",
    "loader_draws",
    "replayed_indices",
]

log = logging.getLogger(__name__)

FORMAT = "bridgeflow.adapters.torch.DataLoader"
VERSION = 4  # 2: rng_next/rng_saved (where the next epoch draws from); 3: ahead (in_order=False); 4: reuse
GLOBAL_RNG = "torch"  # key of torch's default CPU generator among the RNG snapshots

_tud = torch.utils.data
_DETERMINISTIC = (_tud.SequentialSampler, _tud.BatchSampler, _tud.distributed.DistributedSampler,
                  InfiniteConstantSampler, list, tuple, range)


class ResumeStateError(StateMismatchError):
    """A ``state_dict`` that does not fit this loader (another dataset length, batch size, sampler...), or a
    damaged one: a :class:`~bridgeflow._state.StateMismatchError` (a ``ValueError``), as a flow's damaged state
    is, so one ``except`` catches both."""


def is_stateful(obj: Any) -> bool:
    """torchdata's ``Stateful``: has both ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def flow_state(flow: Any) -> tuple[Any, str | None]:
    """``(state, None)`` from a DataFlow's state API, or ``(None, why not)``: a flow that cannot say where
    it is must not stop the training loop, only a later ``state_dict()`` that needs it."""
    fn = getattr(flow, "state_dict", None)
    if not callable(fn):
        return None, (f"the dataset, a {type(flow).__name__}, has no state_dict(): a flow that is not a "
                      "bridgeflow DataFlow needs state_dict()/load_state_dict() to be resumed mid-epoch")
    try:
        return fn(), None
    except Exception as exc:
        return None, f"{type(flow).__name__}.state_dict() failed: {exc!r}"


def _encode(t: Any) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> Any:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _sampler_chain(loader: DataLoader) -> list[tuple[str, Any]]:
    """``(path, sampler)`` from the index sampler down its ``.sampler`` attributes."""
    chain: list[tuple[str, Any]] = []
    seen: set[int] = set()
    obj = _compat.index_sampler(loader)
    path = "batch_sampler" if _compat.auto_collation(loader) else "sampler"
    while obj is not None and id(obj) not in seen and len(chain) < 6:
        seen.add(id(obj))
        chain.append((path, obj))
        obj, path = getattr(obj, "sampler", None), path + ".sampler"
    return chain


def _generators(loader: DataLoader) -> dict[str, Any]:
    """The explicit torch generators the loader and its samplers draw from, by attribute path."""
    gens: dict[str, Any] = {}
    ids: set[int] = set()
    candidates = [("generator", loader.generator)]
    candidates += [(path + ".generator", getattr(s, "generator", None)) for path, s in _sampler_chain(loader)]
    for path, g in candidates:
        if isinstance(g, torch.Generator) and id(g) not in ids:
            ids.add(id(g))
            gens[path] = g
    return gens


def _uses_global_rng(loader: DataLoader) -> bool:
    """Whether a sampler may draw from torch's global RNG (no generator of its own, or unknown kind)."""
    for _, s in _sampler_chain(loader):
        if isinstance(s, _DETERMINISTIC) or isinstance(getattr(s, "generator", None), torch.Generator):
            continue
        return True
    return False


def _epoch_holder(loader: DataLoader) -> tuple[str, Any] | None:
    for path, s in _sampler_chain(loader):
        if callable(getattr(s, "set_epoch", None)) and isinstance(getattr(s, "epoch", None), int):
            return path, s
    return None


def _config(loader: DataLoader) -> dict:
    """What must match between the saving and the loading loader."""
    try:
        length = len(loader.dataset) if isinstance(loader.dataset, Sized) else None
    except Exception:
        length = None
    config: dict[str, Any] = {
        "dataset": type(loader.dataset).__qualname__, "kind": loader._bf.kind, "length": length,
        "batch_size": loader.batch_size, "drop_last": loader.drop_last, "num_workers": loader.num_workers,
        "samplers": [f"{type(s).__module__}.{type(s).__qualname__}" for _, s in _sampler_chain(loader)],
    }
    for _, s in _sampler_chain(loader):
        if isinstance(s, _tud.distributed.DistributedSampler):
            config["distributed"] = {k: getattr(s, k, None)
                                     for k in ("num_replicas", "rank", "shuffle", "seed", "drop_last")}
    world_size, rank = _compat.distributed_settings()
    if world_size > 1:  # the rank that saved it (a stream or an iterable dataset shards itself by it)
        config["world"] = [rank, world_size]
    return config


def _ranks(saved: dict, here: dict) -> tuple[Any, Any]:
    """The rank that saved a state and this loader's: the ``DistributedSampler``'s, else torch.distributed's."""
    def rank(config: dict) -> Any:
        sampler = config.get("distributed")
        if isinstance(sampler, dict) and "rank" in sampler:
            return sampler["rank"]
        world = config.get("world")
        return world[0] if isinstance(world, list) and len(world) == 2 else None
    return rank(saved), rank(here)


def _without_rank(config: dict) -> Any:
    sampler = config.get("distributed")
    return {k: v for k, v in sampler.items() if k != "rank"} if isinstance(sampler, dict) else sampler


def _holds_data(state: Any, depth: int = 0) -> bool:
    """Whether a DataFlow's state holds datapoints (``held``: read over an unordered stage)."""
    if depth > 64:
        return True
    if isinstance(state, dict):
        return state.get("held") is not None or any(_holds_data(v, depth + 1) for v in state.values())
    if isinstance(state, list):
        return any(_holds_data(v, depth + 1) for v in state)
    return False


def _rank_specific(state: dict) -> str | None:
    """What in a state belongs to the rank that saved it (None: its position is every rank's, see
    :func:`check_state`)."""
    if state.get("dataset") is not None or any(w is not None for w in state.get("workers") or ()):
        return "its dataset's states, where that rank's part of the data was read to"
    if state.get("ahead") is not None:
        return "the batches that rank handed out before an earlier one (in_order=False), its timing's"
    if _holds_data(state.get("flow")):
        return "datapoints its DataFlow held (read over an unordered stage), that rank's"
    return None


def _epoch_length(loader: DataLoader) -> int | None:
    """Batches in an epoch when known (without torch's ``len(loader)``, which records the length it saw)."""
    try:
        if loader._bf.kind != "collate":
            return len(_compat.index_sampler(loader))
        n, size = len(loader.dataset) if isinstance(loader.dataset, Sized) else None, loader.batch_size
        if n is None:
            return None
    except Exception:
        return None
    if size is None:
        return n
    return n // size if loader.drop_last else -(-n // size)


class EpochRecord:
    """The progress of one epoch, updated by its iterator as it delivers batches."""

    def __init__(self, loader: DataLoader) -> None:
        self.finished = False
        self.yielded = 0
        self.base_seed: int | None = None
        self.shared_seed: int | None = None
        self.rng_first: dict[str, str] | None = None
        self.sampler_epoch: list | None = None
        self.last_worker: int | None = None
        self.exhausted: list[bool] | None = None
        self.workers: list[Any] | None = None  # per worker: its dataset's state after its last batch
        self.flow: Any = None
        self.flow_ended = False  # the flow ran out while the last delivered batch was read: the epoch is over
        self.problem: str | None = None  # why this epoch's position cannot be exported
        self.length = _epoch_length(loader)
        self.rng_next: str | None = None  # torch's global RNG after this epoch's draws (see loader_draws)
        self.reuse = 0  # epochs run before this one on the same base seed (persistent workers)
        # with in_order=False, the numbers of the tasks delivered before an earlier one still in flight
        self.ahead: set[int] | None = None

    def deliver(self, seq: int, worker: int | None) -> None:
        """Task ``seq`` of the epoch (its ``seq``-th batch of indices) was handed out, by ``worker``."""
        self.yielded += 1
        if worker is not None:
            self.last_worker = worker
        ahead = self.ahead
        if ahead is None:
            return
        low = self.yielded - 1 - len(ahead)  # the first task not delivered before this one
        if seq != low:
            ahead.add(seq)
            return
        low += 1
        while low in ahead:
            ahead.discard(low)
            low += 1

    def at_flow_end(self) -> bool:
        """A DataFlow epoch whose position is unknown but whose batches (by length) were all delivered:
        its state is the flow's at the end of the epoch."""
        return self.problem is not None and self.length is not None and self.yielded >= self.length

    def snapshot_rngs(self, loader: DataLoader) -> None:
        """Before the epoch's first index: the generators the sampler may draw from, and its epoch."""
        snap = {path: _encode(g.get_state()) for path, g in _generators(loader).items()}
        if _uses_global_rng(loader):
            snap[GLOBAL_RNG] = _encode(torch.get_rng_state())
        self.rng_first = snap
        holder = _epoch_holder(loader)
        self.sampler_epoch = None if holder is None else [holder[0], holder[1].epoch]

    def note_epoch_end(self, loader: DataLoader) -> None:
        """The epoch ran out: the next one's draws start from torch's global RNG as it is now (what this
        process drew since the epoch's start, a dataset read here, counts too), unless drawn from a chain."""
        if self.rng_next is not None and loader._bf.rng_chain is None:
            self.rng_next = _encode(torch.get_rng_state())

    def note_worker_state(self, worker: int, num_workers: int, state: Any) -> None:
        if self.workers is None:
            self.workers = [None] * num_workers
        if isinstance(state, Exception):
            self.problem = f"a worker could not give its dataset's state: {state!r}"
        else:
            self.workers[worker] = state

    def note_exhausted(self, worker: int, num_workers: int) -> None:
        if self.exhausted is None:
            self.exhausted = [False] * num_workers
        self.exhausted[worker] = True


def export_state(loader: DataLoader, record: EpochRecord | None) -> dict:
    """The loader's state as plain data (see the module docstring), with the checksum of its own fields."""
    state = _export_state(loader, record)
    state["check"] = fields_checksum(state)
    return state


def _export_state(loader: DataLoader, record: EpochRecord | None) -> dict:
    state: dict[str, Any] = {
        "format": FORMAT, "version": 2, "config": _config(loader), "started": False, "finished": False,
        "yielded": 0, "rng_now": {path: _encode(g.get_state()) for path, g in _generators(loader).items()},
        "dataset": None, "flow": None,
    }
    bf = loader._bf
    is_flow = bf.kind == "collate"
    own_view = bf.view is not None  # a DataFlow's view: its position lives here
    if not is_flow and (loader.num_workers == 0 or own_view) and is_stateful(bf.items):
        # with workers, a dataset's copies that are read are the workers' (their states come with their
        # batches): this process's copy may have no state at all (torchdata asks the workers only, too)
        state["dataset"] = bf.items.state_dict()
    rng_next = record.rng_next if record is not None else None
    if record is None and draws_global(loader):  # never iterated: its first draws start from here
        rng_next = bf.rng_chain or _encode(torch.get_rng_state())
    if rng_next is not None:
        state["rng_next"] = rng_next
        state["rng_saved"] = _encode(torch.get_rng_state())
    if record is None or record.finished or (is_flow and record.at_flow_end()):  # at an epoch boundary
        state["finished"] = record is not None
        it = _compat.held_iterator(loader)
        if record is not None and loader.persistent_workers and it is not None and not it.closed:
            state["base_seed"] = record.base_seed  # the workers' seeds: kept into the next epoch, not drawn
            _note_reuse(state, record)
            # the workers' dataset copies live on into the next epoch: their states at this epoch's end
            state["workers"] = copy.deepcopy(record.workers)
        if is_flow:
            state["flow"] = flow_state(loader.dataset)[0]
        return state
    if record.problem is not None:
        raise NotImplementedError(
            f"DataLoader.state_dict() after {record.yielded} batches of an epoch: {record.problem}, so the "
            "loader cannot say where the epoch is. Take the state at an epoch boundary, or give the "
            "dataset a working state_dict()/load_state_dict().")
    workers = record.workers
    state.update(
        started=True, yielded=record.yielded, base_seed=record.base_seed, shared_seed=record.shared_seed,
        rng_first=copy.deepcopy(record.rng_first), sampler_epoch=copy.deepcopy(record.sampler_epoch),
        last_worker=record.last_worker, exhausted=copy.deepcopy(record.exhausted),
        workers=copy.deepcopy(workers), flow=copy.deepcopy(record.flow),
        flow_ended=record.flow_ended)
    if record.ahead is not None:  # batches delivered before an earlier one (in_order=False)
        state["ahead"] = sorted(record.ahead)
        state["version"] = 3  # the only change of version 3: a loader of version 2 reads the others
    _note_reuse(state, record)
    return state


def _note_reuse(state: dict, record: EpochRecord) -> None:
    """Persistent workers past their first epoch: how many epochs ran on the base seed before this one (the
    per-sample seeds of ``seed_per_sample`` count it). Version 4's only change: the others keep theirs."""
    if record.reuse:
        state["reuse"] = record.reuse
        state["version"] = 4


def _mismatch(what: str, saved: Any, here: Any) -> ResumeStateError:
    return ResumeStateError(f"DataLoader.load_state_dict: the state was saved with {what}={_say(saved)}, this "
                            f"loader has {what}={_say(here)}")


def _say(value: Any) -> str:
    """``repr`` of a setting, cut short when it is long (a state's are untrusted)."""
    text = short(value)
    return text if "..." in text else repr(value)


def _too_deep(state: Any) -> bool:
    """Whether dicts and lists nest deeper than ``MAX_DEPTH`` levels in ``state`` (walked without recursion)."""
    stack = [(state, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)
    return False


def check_state(loader: DataLoader, state: Any) -> dict:
    """Validate ``state`` for ``loader`` (its settings here, its fields with :mod:`._state_fields`'s declaration)
    and return a private copy of it; ResumeStateError names a mismatch."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ResumeStateError("DataLoader.load_state_dict: not a state of bridgeflow's DataLoader (no "
                               f"'format': {FORMAT!r} entry); states of other loaders cannot be loaded")
    if _too_deep(state):
        raise ResumeStateError(f"DataLoader.load_state_dict: the state is nested deeper than {MAX_DEPTH} levels: no "
                               "loader saves one")
    version = state.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ResumeStateError(f"DataLoader.load_state_dict: field 'version' of the state is {short(version)}: not a "
                               "format version")
    if version > VERSION:
        raise ResumeStateError(f"DataLoader.load_state_dict: the state has format version {version!r}, newer "
                               f"than this bridgeflow reads ({VERSION}); upgrade bridgeflow to load it")
    saved, here = state.get("config"), _config(loader)
    if not isinstance(saved, dict):
        raise ResumeStateError(f"DataLoader.load_state_dict: field 'config' of the state is {short(saved)}: "
                               "expected the saving loader's settings (a mapping)")
    for key in ("kind", "batch_size", "drop_last", "samplers"):
        if saved.get(key) != here.get(key):
            raise _mismatch({"samplers": "sampler types", "kind": "dataset kind"}.get(key, key),
                            saved.get(key), here.get(key))
    if _without_rank(saved) != _without_rank(here):
        raise _mismatch("distributed", saved.get("distributed"), here.get("distributed"))
    saved_world, world = saved.get("world"), here.get("world")
    if saved_world is not None and world is not None and \
            (not isinstance(saved_world, list) or len(saved_world) != 2 or saved_world[1] != world[1]):
        raise _mismatch("world size", saved_world[1] if isinstance(saved_world, list) and len(saved_world) == 2
                        else saved_world, world[1])
    saved_rank, rank = _ranks(saved, here)
    if saved_rank != rank:
        # Lightning writes rank 0's state and loads it on every rank (Accelerate writes one rank's, plain DDP
        # code mostly rank 0's): the ranks step together, so the position (batches delivered, the sampler's
        # epoch and seeds) is every rank's, and each rank's own sampler gives it its own indices from there.
        # What only the saving rank had is refused.
        why = _rank_specific(state)
        if why is not None:
            raise ResumeStateError(
                f"DataLoader.load_state_dict: the state was saved on rank {saved_rank!r:.20} and holds {why}; this "
                f"loader is rank {rank!r}. Save every rank's state: AllRanksState(loader) (see the docs' "
                "Training frameworks)")
        log.debug("DataLoader.load_state_dict: a state saved on rank %r resumes rank %r at the same position",
                  saved_rank, rank)
    if saved.get("length") is not None and here.get("length") is not None and saved["length"] != here["length"]:
        raise _mismatch("dataset length", saved["length"], here["length"])
    sizes = {path: g.get_state().numel() for path, g in _generators(loader).items()}
    sizes[GLOBAL_RNG] = torch.get_rng_state().numel()
    gens = set(_generators(loader))
    check_loader_state(state, LoaderFacts(
        kind=loader._bf.kind, num_workers=loader.num_workers, epoch_length=_epoch_length(loader),
        dataset_stateful=is_stateful(loader._bf.items), rng_sizes=sizes, generators=gens,
        epoch_rngs=gens | ({GLOBAL_RNG} if _uses_global_rng(loader) else set()),
        draws_global=draws_global(loader), error=ResumeStateError, rng_valid=_valid_rng))
    for path in list(state.get("rng_now") or ()) + list(state.get("rng_first") or ()):
        if path != GLOBAL_RNG and path not in gens:
            raise ResumeStateError(f"DataLoader.load_state_dict: the state has the RNG state of a torch "
                                   f"generator at loader.{path}, this loader has none there")
    if state.get("flow") is not None and not callable(getattr(loader.dataset, "load_state_dict", None)):
        raise ResumeStateError(f"DataLoader.load_state_dict: the state holds a DataFlow position but the dataset, "
                               f"a {type(loader.dataset).__name__}, has no load_state_dict()")
    target = loader._bf.items
    if state.get("dataset") is not None and not is_stateful(target):
        raise ResumeStateError(f"DataLoader.load_state_dict: the state holds a dataset state but the dataset, "
                               f"a {type(target).__name__}, has no load_state_dict()")
    saved = state.get("check")
    if saved is not None and saved != fields_checksum(state):  # a state without one (by hand) is taken as is
        raise ResumeStateError(f"DataLoader.load_state_dict: field 'check' of the state is {saved!r:.40}: the state's "
                               "fields do not match the checksum it was saved with (it was changed or damaged after "
                               "state_dict() returned it)")
    return copy.deepcopy(state)


def _valid_rng(raw: bytes) -> bool:
    """Whether torch takes ``raw`` as a CPU generator's state (tried on a scratch generator)."""
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError:
        return False
    return True


def apply_generators(loader: DataLoader, rng: dict[str, str] | None) -> None:
    """Set the loader's explicit generators (never the global RNG) to saved states."""
    gens = _generators(loader)
    for path, text in (rng or {}).items():
        if path != GLOBAL_RNG:
            gens[path].set_state(_decode(text))


@contextlib.contextmanager
def _rngs_of_epoch_start(loader: DataLoader, rng: dict[str, str]) -> Iterator[None]:
    saved_global = None
    if GLOBAL_RNG in rng:
        saved_global = torch.get_rng_state()
        torch.set_rng_state(_decode(rng[GLOBAL_RNG]))
    apply_generators(loader, rng)
    try:
        yield
    finally:
        if saved_global is not None:  # the replay borrowed the global RNG; the user's state is theirs
            torch.set_rng_state(saved_global)


def draws_global(loader: DataLoader) -> bool:
    """Whether an epoch's start draws from torch's global RNG (the workers' base seed without a
    ``generator``, or a sampler without a generator of its own)."""
    return loader.generator is None or _uses_global_rng(loader)


@contextlib.contextmanager
def loader_draws(loader: DataLoader, record: EpochRecord) -> Iterator[None]:
    """Around the draws an epoch's start makes (base seed, DataPipe seed, the sampler's first index).

    Uninterrupted, they come from torch's global RNG, as torch's loader draws them, and the record notes
    the global RNG after them: where the next epoch's draws start when nothing else draws in between. A
    loader resumed from such a state in a process whose global RNG was not restored (Lightning restores
    none) draws from that saved RNG instead, kept as ``loader._bf.rng_chain`` from epoch to epoch, so every
    later epoch is the uninterrupted run's without a ``generator``; the process's global RNG is untouched.
    """
    if not draws_global(loader):
        yield
        return
    chain = loader._bf.rng_chain
    if chain is None:
        yield
        record.rng_next = _encode(torch.get_rng_state())
        return
    saved = torch.get_rng_state()
    torch.set_rng_state(_decode(chain))
    try:
        yield
    finally:
        record.rng_next = _encode(torch.get_rng_state())
        loader._bf.chain(record.rng_next)
        torch.set_rng_state(saved)


def chain_from(loader: DataLoader, state: dict) -> None:
    """After loading ``state``: draw later epochs from its saved global RNG (see :func:`loader_draws`),
    unless this process's global RNG is where it was when the state was taken (a framework restored it:
    Accelerate does), then from the global RNG as torch does."""
    rng_next = state.get("rng_next")
    restored = state.get("rng_saved") is not None and torch.equal(torch.get_rng_state(),
                                                                   _decode(state["rng_saved"]))
    loader._bf.chain(None if rng_next is None or restored else rng_next)


def replayed_indices(loader: DataLoader, state: dict, skip: int) -> Iterator[Any]:
    """The index sampler's iterator of the resumed epoch, ``skip`` batches in."""
    if state.get("sampler_epoch"):
        path, epoch = state["sampler_epoch"]
        holder = _epoch_holder(loader)
        if holder is not None and holder[0] == path:
            holder[1].set_epoch(epoch)
    rng = state.get("rng_first")
    if rng is None:  # the state was taken before the first index was drawn
        apply_generators(loader, state.get("rng_now"))
        return iter(_compat.index_sampler(loader))
    with _rngs_of_epoch_start(loader, rng):
        it = iter(_compat.index_sampler(loader))
        for done in range(skip):
            try:
                next(it)
            except StopIteration:
                raise ResumeStateError(
                    f"DataLoader.load_state_dict: the state was taken after {skip} batches, but this loader's "
                    f"sampler gives only {done} (the dataset or sampler changed)") from None
        try:
            first = next(it)  # drawn here: the sampler's first draw must see the epoch's RNG states
        except StopIteration:
            return iter(())
    return _chain_first(first, it)


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
