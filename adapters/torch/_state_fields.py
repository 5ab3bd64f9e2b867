"""Field-by-field validation of a :class:`~bridgeflow.adapters.torch.DataLoader` state, before anything uses it.

:func:`check_fields` checks every field of a state that ``load_state_dict()`` was given: its type, its range
and its agreement with the other fields and with the loader (how many workers, whether the dataset has a
state, how many batches an epoch has, the size of each RNG state). A bad field raises
:class:`~bridgeflow.adapters.torch._state.ResumeStateError` naming the field and its value, so a damaged or
crafted state is refused at ``load_state_dict()``, where nothing has started yet (no worker, no shared
memory), instead of replaying or skipping batches silently or failing later inside ``iter()``.
The dataset's and a DataFlow's own states are theirs to check (their ``load_state_dict()``).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["LoaderFacts", "check_fields", "fields_checksum"]

INT64 = (-(1 << 63), 1 << 63)
_KNOWN = {"format", "version", "config", "started", "finished", "yielded", "rng_now", "dataset", "flow",
          "base_seed", "shared_seed", "rng_first", "sampler_epoch", "last_worker", "exhausted", "workers",
          "flow_ended", "rng_next", "rng_saved", "ahead", "reuse", "check"}
# the fields that hold the dataset's or the flow's own states (theirs to check), outside the checksum
_THEIRS = ("dataset", "workers", "flow", "check")


@dataclass
class LoaderFacts:
    """What a state is checked against: the loading loader's settings."""

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


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Checker:
    def __init__(self, facts: LoaderFacts) -> None:
        self.facts = facts

    def fail(self, field: str, value: Any, why: str) -> NoReturn:
        raise self.facts.error(f"DataLoader.load_state_dict: state[{field}] = {_show(value)}: {why}")

    def integer(self, field: str, value: Any, low: int | None = None, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(field, value, f"expected an integer, got a {type(value).__name__}")
        if (low is not None and value < low) or (high is not None and value >= high):
            self.fail(field, value, f"out of range [{low}, {high})" if high is not None else f"below {low}")
        return value

    def boolean(self, field: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(field, value, f"expected True or False, got a {type(value).__name__}")
        return value

    def rng(self, field: str, value: Any, path: str) -> None:
        size = self.facts.rng_sizes.get(path)
        if size is None:
            self.fail(field, "...", f"this loader has no torch generator at loader.{path}")
        if not isinstance(value, str):
            self.fail(field, value, "expected an RNG state as base64 text")
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            self.fail(field, value, "not valid base64")
        if len(raw) != size:
            self.fail(field, f"<{len(raw)} bytes>", f"an RNG state of {size} bytes expected")
        if self.facts.rng_valid is not None and not self.facts.rng_valid(raw):
            self.fail(field, f"<{len(raw)} bytes>", "not a valid RNG state (torch refuses it)")

    def rngs(self, field: str, value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, dict):
            self.fail(field, value, "expected a mapping of generator path to RNG state")
        for path, text in value.items():
            if not isinstance(path, str):
                self.fail(f"{field}.{path!r}", path, "a generator path must be a string")
            self.rng(f"{field}.{path}", text, path)

    def per_worker(self, field: str, value: Any) -> list | None:
        if value is None:
            return None
        slots = max(1, self.facts.num_workers)
        if not isinstance(value, list) or len(value) != slots:
            self.fail(field, value, f"expected a list of {slots} entries, one per worker")
        return value


def check_fields(state: dict, facts: LoaderFacts) -> None:
    """Raise ``facts.error`` naming the first field of ``state`` that is missing, of the wrong type, out of
    range or inconsistent with the others or with the loader (see the module doc)."""
    c = _Checker(facts)
    unknown = sorted(set(state) - _KNOWN, key=str)
    if unknown:
        c.fail(unknown[0], state[unknown[0]], "not a field of this state format")
    config = state.get("config")
    if not isinstance(config, dict):
        c.fail("config", config, "expected the saving loader's settings (a mapping)")
    saved_workers = c.integer("config.num_workers", config.get("num_workers"), 0)
    started = c.boolean("started", state.get("started"))
    if (started or state.get("workers") is not None or state.get("exhausted") is not None) \
            and saved_workers != facts.num_workers:
        # batches go to the workers in turn and each worker reads its own copy (an iterable its own shard):
        # a state taken in an epoch, even before its first batch, belongs to that number of workers
        raise facts.error(f"DataLoader.load_state_dict: the state was saved with num_workers={saved_workers}, "
                          f"this loader has num_workers={facts.num_workers}")
    finished = c.boolean("finished", state.get("finished"))
    if started and finished:
        c.fail("finished", finished, "an epoch in progress (started) cannot also be finished")
    yielded = c.integer("yielded", state.get("yielded"), 0)
    if not started and yielded:
        c.fail("yielded", yielded, "batches delivered in an epoch that has not started")
    length = facts.epoch_length
    if started and length is not None and yielded > length:
        c.fail("yielded", yielded, f"this loader's epoch has {length} batches")
    c.rngs("rng_now", state.get("rng_now"))
    if set(state.get("rng_now") or ()) != facts.generators:
        c.fail("rng_now", sorted(state.get("rng_now") or ()), f"expected the states of this loader's generators "
               f"{sorted(facts.generators)}")
    for field in ("rng_next", "rng_saved"):
        if state.get(field) is not None:
            c.rng(field, state[field], "torch")
        elif facts.draws_global and state.get("version", 1) >= 2:
            c.fail(field, None, "missing: this loader draws its epochs' seeds from torch's global RNG")
    for field in ("base_seed", "shared_seed"):
        if state.get(field) is not None:
            c.integer(field, state[field], *INT64)
    if state.get("reuse") is not None:
        c.integer("reuse", state["reuse"], 1, 1 << 62)
        if state.get("base_seed") is None:
            c.fail("reuse", state["reuse"], "epochs run on a base seed, in a state without one")
    if state.get("flow_ended") is not None:
        c.boolean("flow_ended", state["flow_ended"])
    workers = c.per_worker("workers", state.get("workers"))
    if not started and not finished and workers is not None:
        c.fail("workers", workers, "workers' states in a state taken before any epoch")
    ahead = _check_ahead(c, state.get("ahead"), started, yielded, facts)
    for i, entry in enumerate(workers or ()):
        _check_worker_entry(c, f"workers[{i}]", entry, facts)
        # in turn, the first batches come from each worker (not so as they are ready: in_order=False)
        if entry is None and ahead is None and i < min(yielded, max(1, facts.num_workers)):
            c.fail(f"workers[{i}]", None, "this worker delivered a batch of a dataset with a state, but "
                   "its state is missing")
    if not started and not finished and state.get("base_seed") is not None:
        c.fail("base_seed", state["base_seed"], "a base seed in a state taken before any epoch")
    if not started:
        for field in ("rng_first", "sampler_epoch", "last_worker", "exhausted"):
            if state.get(field) is not None:
                c.fail(field, state[field], "set in a state taken outside an epoch")
        return
    if state.get("base_seed") is None:
        c.fail("base_seed", None, "an epoch in progress needs its workers' base seed")
    first = state.get("rng_first")
    c.rngs("rng_first", first)
    if first is None and facts.kind == "map" and (yielded or facts.num_workers):
        # only an epoch without workers, before its first batch, has drawn no index yet
        c.fail("rng_first", None, "the epoch's indices were drawn from RNGs the state does not hold")
    if first is not None and set(first) != facts.epoch_rngs:
        c.fail("rng_first", sorted(first), f"expected the RNG states the sampler draws from, "
               f"{sorted(facts.epoch_rngs)}")
    epoch = state.get("sampler_epoch")
    if epoch is not None:
        if not isinstance(epoch, (list, tuple)) or len(epoch) != 2 or not isinstance(epoch[0], str):
            c.fail("sampler_epoch", epoch, "expected [sampler path, epoch]")
        c.integer("sampler_epoch[1]", epoch[1], 0)
    if state.get("last_worker") is not None:
        c.integer("last_worker", state["last_worker"], 0, max(1, facts.num_workers))
    elif yielded and facts.kind != "collate":
        c.fail("last_worker", None, f"{yielded} batches were delivered, by no worker")
    exhausted = c.per_worker("exhausted", state.get("exhausted"))
    if exhausted is not None:
        if facts.kind == "map":
            c.fail("exhausted", exhausted, "a map-style dataset's workers never run out")
        for i, flag in enumerate(exhausted):
            c.boolean(f"exhausted[{i}]", flag)
    last, turn = state.get("last_worker"), (yielded - 1) % max(1, facts.num_workers)
    if last is not None and yielded and not any(exhausted or ()) and ahead is None and last != turn:
        # batches go to the workers in turn from worker 0 while none has run out
        c.fail("last_worker", last, f"batch {yielded} of an epoch goes to worker {turn}")


def _check_ahead(c: _Checker, ahead: Any, started: bool, yielded: int, facts: LoaderFacts) -> list | None:
    """``ahead`` (in_order=False): the numbers of the tasks delivered before an earlier one, ascending, each
    after the first task not delivered (``yielded - len(ahead)``) and within the epoch."""
    if ahead is None:
        return None
    if not started or facts.kind != "map":
        c.fail("ahead", ahead, "only a map-style epoch in progress has batches delivered out of order")
    if not isinstance(ahead, list) or len(ahead) > yielded:
        c.fail("ahead", ahead, f"expected a list of at most {yielded} task numbers (the batches delivered)")
    low, length = yielded - len(ahead), facts.epoch_length
    for i, seq in enumerate(ahead):
        c.integer(f"ahead[{i}]", seq, low + 1, length if length is not None else None)
        if i and seq <= ahead[i - 1]:
            c.fail(f"ahead[{i}]", seq, "task numbers must be distinct and ascending")
    return ahead


def _check_worker_entry(c: _Checker, field: str, entry: Any, facts: LoaderFacts) -> None:
    if entry is None:
        return
    if not isinstance(entry, dict) or not set(entry) <= {"dataset", "iter", "ended"}:
        c.fail(field, entry, "expected a worker's dataset state ({'dataset', 'iter', 'ended'})")
    if entry.get("dataset") is not None and not facts.dataset_stateful:
        c.fail(f"{field}.dataset", entry["dataset"], "this loader's dataset has no load_state_dict()")
    if entry.get("iter") is not None and facts.kind == "map":
        c.fail(f"{field}.iter", entry["iter"], "a map-style dataset has no iterator state")
    if entry.get("ended") is not None:
        c.boolean(f"{field}.ended", entry["ended"])



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
