"""The fields of a :class:`~bridgeflow.adapters.torch.DataLoader` state, declared with the core's schema.

:data:`LOADER_FIELDS` declares each field of a loader's state with :mod:`bridgeflow._state_schema`'s
:class:`~bridgeflow._state_schema.Field` kinds, as the core's flows declare theirs: its type, and what can be
checked of it alone against the loading loader (a :class:`LoaderFacts`: how many workers, whether the dataset
has a state, the size of each RNG state). :func:`check_loader_state` checks a state against them with the
core's :func:`~bridgeflow._state_schema.check_fields` (a missing field, an unknown one, a bad one), then
the checks between fields (:func:`_between`, as a flow's ``_take_state``): the state's number of workers,
batches and RNGs against each other and against the loader. A bad field raises
:class:`~bridgeflow.adapters.torch._state.ResumeStateError` naming it and its value, so a damaged or crafted
state is refused at ``load_state_dict()``, where nothing has started yet (no worker, no shared memory),
instead of replaying or skipping batches silently or failing later inside ``iter()``.
The dataset's and a DataFlow's own states are theirs to check (their ``load_state_dict()``).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from bridgeflow import StateMismatchError
from bridgeflow.engine import Count, Field, Flag, Value, check_fields, short

__all__ = ["LOADER_FIELDS", "LoaderFacts", "check_loader_state", "fields_checksum"]

INT64 = (-(1 << 63), 1 << 63)
# the fields that hold the dataset's or the flow's own states (theirs to check), outside the checksum
_THEIRS = ("dataset", "workers", "flow", "check")
_WHERE = "DataLoader.load_state_dict: "


@dataclass
class LoaderFacts:
    """What a state is checked against: the loading loader's settings (the fields' ``flow``)."""

    kind: str  # "map", "iterable" or "collate"
    num_workers: int
    epoch_length: int | None  # batches in an epoch, when known
    dataset_stateful: bool  # the dataset read in the workers has state_dict()/load_state_dict()
    rng_sizes: dict[str, int]  # bytes of each RNG state by path (generators, and "torch" for the global one)
    generators: set[str]  # paths of the loader's torch generators (what rng_now holds)
    epoch_rngs: set[str]  # what an epoch's first index draws from (rng_first holds): generators, "torch"
    draws_global: bool  # an epoch's start draws from torch's global RNG (rng_next says where from)
    error: Callable[[str], Exception]
    rng_valid: Callable[[bytes], bool] | None = None  # whether torch takes these bytes as a CPU RNG state

    @property
    def slots(self) -> int:
        """Entries of a per-worker list: one per worker, one without workers."""
        return max(1, self.num_workers)


def _bad(field: str, value: Any, why: str) -> NoReturn:
    """Refuse ``field`` of a state (its value cut short: a state is untrusted), in the core's wording."""
    raise StateMismatchError(f"field {field!r} of the state is {short(value)}: {why}")


def _integer(field: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(field, value, f"expected an integer, got a {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value >= high):
        _bad(field, value, f"out of range [{low}, {high})" if high is not None else f"below {low}")
    return value


class _Int(Value):
    """An integer in ``[low, high)`` (or None)."""

    def __init__(self, name: str, low: int, high: int | None = None) -> None:
        super().__init__(name, int, none=True, optional=True)
        self.low, self.high = low, high

    def check(self, flow: Any, value: Any) -> None:
        super().check(flow, value)
        if value is not None:
            _integer(self.name, value, self.low, self.high)


class _Rng(Field):
    """A torch generator's state as base64 text, of the size that ``path``'s generator has (None too)."""

    def __init__(self, name: str, path: str = "torch") -> None:
        super().__init__(name, optional=True)
        self.path = path

    def check(self, flow: Any, value: Any) -> None:
        if value is not None:
            _check_rng(flow, self.name, value, self.path)


class _Rngs(Field):
    """A mapping of generator path to its state (None too)."""

    def check(self, flow: Any, value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, dict):
            _bad(self.name, value, "expected a mapping of generator path to RNG state")
        for path, text in value.items():
            if not isinstance(path, str):
                _bad(f"{self.name}.{path!r}", path, "a generator path must be a string")
            _check_rng(flow, f"{self.name}.{path}", text, path)


def _check_rng(facts: LoaderFacts, field: str, value: Any, path: str) -> None:
    size = facts.rng_sizes.get(path)
    if size is None:
        _bad(field, "...", f"this loader has no torch generator at loader.{path}")
    if not isinstance(value, str):
        _bad(field, value, "expected an RNG state as base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        _bad(field, value, "not valid base64")
    if len(raw) != size:
        _bad(field, f"<{len(raw)} bytes>", f"an RNG state of {size} bytes expected")
    if facts.rng_valid is not None and not facts.rng_valid(raw):
        _bad(field, f"<{len(raw)} bytes>", "not a valid RNG state (torch refuses it)")


def _config(facts: LoaderFacts, config: Any) -> None:
    _integer("config.num_workers", config.get("num_workers"), 0)


def _workers(facts: LoaderFacts, workers: Any) -> None:
    for i, entry in enumerate(workers):
        field = f"workers[{i}]"
        if entry is None:
            continue
        if not isinstance(entry, dict) or not set(entry) <= {"dataset", "iter", "ended"}:
            _bad(field, entry, "expected a worker's dataset state ({'dataset', 'iter', 'ended'})")
        if entry.get("dataset") is not None and not facts.dataset_stateful:
            _bad(f"{field}.dataset", entry["dataset"], "this loader's dataset has no load_state_dict()")
        if entry.get("iter") is not None and facts.kind == "map":
            _bad(f"{field}.iter", entry["iter"], "a map-style dataset has no iterator state")
        if entry.get("ended") is not None and not isinstance(entry["ended"], bool):
            _bad(f"{field}.ended", entry["ended"], f"expected True or False, got a {type(entry['ended']).__name__}")


def _sampler_epoch(facts: LoaderFacts, epoch: Any) -> None:
    if len(epoch) != 2 or not isinstance(epoch[0], str):
        _bad("sampler_epoch", epoch, "expected [sampler path, epoch]")
    _integer("sampler_epoch[1]", epoch[1], 0)


def _flags(field: str) -> Callable[[LoaderFacts, Any], None]:
    def check(facts: LoaderFacts, flags: Any) -> None:
        for i, flag in enumerate(flags):
            if not isinstance(flag, bool):
                _bad(f"{field}[{i}]", flag, f"expected True or False, got a {type(flag).__name__}")
    return check


LOADER_FIELDS: tuple[Field, ...] = (
    Value("format", str),
    Count("version"),  # its bound (VERSION) is checked first, with its own message (check_state)
    Value("config", dict, _config),  # the saving loader's settings, compared to this one's by check_state
    Flag("started"),  # an epoch is in progress
    Flag("finished"),  # the last epoch ran out
    Count("yielded"),  # batches delivered in the epoch
    _Rngs("rng_now", optional=True),  # the loader's generators now
    Field("dataset", optional=True),  # the dataset's state (its own to check)
    Field("flow", optional=True),  # a DataFlow's state (its own to check)
    _Int("base_seed", *INT64),  # the workers' base seed of the epoch
    _Int("shared_seed", *INT64),  # the DataPipes' shared seed
    _Rngs("rng_first", optional=True),  # the RNGs just before the epoch's first index was drawn
    Value("sampler_epoch", (list, tuple), _sampler_epoch, none=True, optional=True),  # [path, set_epoch()]
    _Int("last_worker", 0),  # the worker of the last delivered batch
    Value("exhausted", list, _flags("exhausted"), none=True, optional=True),  # per worker: ran out
    Value("workers", list, _workers, none=True, optional=True),  # per worker: its dataset's state
    Value("flow_ended", bool, none=True, optional=True),  # the flow ran out as the last batch was read
    _Rng("rng_next"),  # torch's global RNG where the next epoch draws from (version 2)
    _Rng("rng_saved"),  # torch's global RNG when the state was taken (version 2)
    Value("ahead", list, none=True, optional=True),  # tasks delivered before an earlier one (version 3)
    _Int("reuse", 1, 1 << 62),  # epochs run before on the same base seed (version 4)
    Field("check", optional=True),  # the checksum of the loader's own fields (see fields_checksum)
)


def check_loader_state(state: dict, facts: LoaderFacts) -> None:
    """Raise ``facts.error`` naming the first field of ``state`` that is missing, unknown, of the wrong type,
    out of range or inconsistent with the others or with the loader (see the module doc)."""
    try:
        check_fields(facts, state, LOADER_FIELDS, ())
        _between(state, facts)
    except StateMismatchError as exc:
        raise facts.error(_WHERE + exc.reason) from None


def _between(state: dict, facts: LoaderFacts) -> None:
    """The checks between fields, once each field passed alone."""
    saved_workers, started, finished = state["config"]["num_workers"], state["started"], state["finished"]
    workers, exhausted = state.get("workers"), state.get("exhausted")
    if (started or workers is not None or exhausted is not None) and saved_workers != facts.num_workers:
        # batches go to the workers in turn and each worker reads its own copy (an iterable its own shard):
        # a state taken in an epoch, even before its first batch, belongs to that number of workers
        raise StateMismatchError(f"the state was saved with num_workers={saved_workers}, this loader has "
                                 f"num_workers={facts.num_workers}")
    for field in ("workers", "exhausted"):
        if state.get(field) is not None and len(state[field]) != facts.slots:
            _bad(field, state[field], f"expected a list of {facts.slots} entries, one per worker")
    if started and finished:
        _bad("finished", finished, "an epoch in progress (started) cannot also be finished")
    yielded, length = state["yielded"], facts.epoch_length
    if not started and yielded:
        _bad("yielded", yielded, "batches delivered in an epoch that has not started")
    if started and length is not None and yielded > length:
        _bad("yielded", yielded, f"this loader's epoch has {length} batches")
    if set(state.get("rng_now") or ()) != facts.generators:
        _bad("rng_now", sorted(state.get("rng_now") or ()), "expected the states of this loader's generators "
             f"{sorted(facts.generators)}")
    for field in ("rng_next", "rng_saved"):
        if state.get(field) is None and facts.draws_global and state["version"] >= 2:
            _bad(field, None, "missing: this loader draws its epochs' seeds from torch's global RNG")
    if state.get("reuse") is not None and state.get("base_seed") is None:
        _bad("reuse", state["reuse"], "epochs run on a base seed, in a state without one")
    if not started and not finished and workers is not None:
        _bad("workers", workers, "workers' states in a state taken before any epoch")
    ahead = _check_ahead(state.get("ahead"), started, yielded, facts)
    for i, entry in enumerate(workers or ()):
        # in turn, the first batches come from each worker (not so as they are ready: in_order=False)
        if entry is None and ahead is None and i < min(yielded, facts.slots):
            _bad(f"workers[{i}]", None, "this worker delivered a batch of a dataset with a state, but its state "
                 "is missing")
    if not started and not finished and state.get("base_seed") is not None:
        _bad("base_seed", state["base_seed"], "a base seed in a state taken before any epoch")
    if not started:
        for field in ("rng_first", "sampler_epoch", "last_worker", "exhausted"):
            if state.get(field) is not None:
                _bad(field, state[field], "set in a state taken outside an epoch")
        return
    _between_in_epoch(state, facts, ahead)


def _between_in_epoch(state: dict, facts: LoaderFacts, ahead: list | None) -> None:
    """The checks between the fields of a state taken in an epoch."""
    yielded, exhausted = state["yielded"], state.get("exhausted")
    if state.get("base_seed") is None:
        _bad("base_seed", None, "an epoch in progress needs its workers' base seed")
    first = state.get("rng_first")
    if first is None and facts.kind == "map" and (yielded or facts.num_workers):
        # only an epoch without workers, before its first batch, has drawn no index yet
        _bad("rng_first", None, "the epoch's indices were drawn from RNGs the state does not hold")
    if first is not None and set(first) != facts.epoch_rngs:
        _bad("rng_first", sorted(first), f"expected the RNG states the sampler draws from, {sorted(facts.epoch_rngs)}")
    last = state.get("last_worker")
    if last is not None and last >= facts.slots:
        _bad("last_worker", last, f"out of range [0, {facts.slots})")
    if last is None and yielded and facts.kind != "collate":
        _bad("last_worker", None, f"{yielded} batches were delivered, by no worker")
    if exhausted is not None and facts.kind == "map":
        _bad("exhausted", exhausted, "a map-style dataset's workers never run out")
    turn = (yielded - 1) % facts.slots
    if last is not None and yielded and not any(exhausted or ()) and ahead is None and last != turn:
        # batches go to the workers in turn from worker 0 while none has run out
        _bad("last_worker", last, f"batch {yielded} of an epoch goes to worker {turn}")


def _check_ahead(ahead: Any, started: bool, yielded: int, facts: LoaderFacts) -> list | None:
    """``ahead`` (in_order=False): the numbers of the tasks delivered before an earlier one, ascending, each
    after the first task not delivered (``yielded - len(ahead)``) and within the epoch."""
    if ahead is None:
        return None
    if not started or facts.kind != "map":
        _bad("ahead", ahead, "only a map-style epoch in progress has batches delivered out of order")
    if len(ahead) > yielded:
        _bad("ahead", ahead, f"expected a list of at most {yielded} task numbers (the batches delivered)")
    low, length = yielded - len(ahead), facts.epoch_length
    for i, seq in enumerate(ahead):
        _integer(f"ahead[{i}]", seq, low + 1, length)
        if i and seq <= ahead[i - 1]:
            _bad(f"ahead[{i}]", seq, "task numbers must be distinct and ascending")
    return ahead


def _crc(value: Any, crc: int) -> int:
    """Fold ``value`` into ``crc`` as it reads after a ``json`` round trip (mapping keys as text, in order;
    tuples as lists), each string length-prefixed so that moving text between fields changes the sum."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            text = str(key).encode()
            crc = _crc(value[key], zlib.crc32(b"k%d:%s" % (len(text), text), crc))
        return zlib.crc32(b"}", crc)
    if isinstance(value, (list, tuple)):
        for item in value:
            crc = _crc(item, zlib.crc32(b",", crc))
        return zlib.crc32(b"]", crc)
    if isinstance(value, str):
        text = value.encode()
        return zlib.crc32(text, zlib.crc32(b"s%d:" % len(text), crc))
    return zlib.crc32(f"{type(value).__name__}:{value!r}".encode(), crc)


def fields_checksum(state: dict) -> str:
    """A CRC-32 of the loader's own fields of ``state`` (of the dataset's, the workers' and the flow's states
    only which are there), the same after ``json`` or ``torch.save`` round trips: the ``check`` field of a
    state. The field checks cannot see every change (a generator's RNG state edited into another valid one
    resumes another order, a worker's state dropped restarts that worker); this sees any change of these."""
    own = {k: v for k, v in state.items() if k not in _THEIRS}
    for key in ("dataset", "flow"):  # whether there is one is the loader's business, what it holds is not
        own[key + "?"] = state.get(key) is not None
    workers = state.get("workers")
    if isinstance(workers, (list, tuple)):  # per worker: whether it has an entry, its 'ended', which states
        own["workers?"] = [{k: v if k == "ended" else v is not None for k, v in w.items()} if isinstance(w, dict)
                           else w is not None for w in workers]
    else:
        own["workers?"] = workers is not None
    return f"{_crc(own, 0):08x}"
