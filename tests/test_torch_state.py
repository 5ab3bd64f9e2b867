"""DataLoader.state_dict() / load_state_dict(): after k batches, a new loader given the state yields exactly
what the uninterrupted run yields next, across epoch boundaries, for every kind of dataset and sampler.

Each case runs the loader uninterrupted for a few epochs, then again stopping after k batches; the state
goes through JSON (and torch.save) into a freshly built loader in a "new process" (other global RNG state),
which finishes the epochs. torch's global RNG is restored beside the loader's state, as Lightning restores it
from a checkpoint. Samples carry the worker that read them and that worker's seed.
"""

from __future__ import annotations

import io
import json
import logging
import os

import numpy as np
import pytest

import bridgeflow

# --- datasets ----------------------------------------------------------------------------------------
from conftest import need, wait_for

need("torch")

import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader, ResumeStateError


class Tagged(tud.Dataset):
    """Sample i, the worker that read it and that worker's seed."""

    def __init__(self, n: int = 11) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = tud.get_worker_info()
        return (int(i), -1, -1) if info is None else (int(i), info.id, info.seed)


class Drawing(Tagged):
    """Draws from torch's global RNG: in this process with num_workers=0, seeded per worker otherwise."""

    def __getitem__(self, i: int):
        return (*super().__getitem__(i), torch.randint(1 << 30, ()).item())


class CallCounting(Tagged):
    """A map-style dataset with a state: how many samples this copy has read (one copy per worker)."""

    calls = 0

    def __getitem__(self, i: int):
        self.calls += 1
        return (*super().__getitem__(i), self.calls)

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


class _Cursor:
    """An iterator with a state: its position in a range."""

    def __init__(self, values: list) -> None:
        self.values, self.pos = values, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.values):
            raise StopIteration
        self.pos += 1
        return self.values[self.pos - 1]

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class UnevenStream(tud.IterableDataset):
    """Worker k yields 3 + 4k samples (workers run dry at different times); ``stateful`` picks whether its
    iterator can save its position or must be fast-forwarded."""

    def __init__(self, stateful: bool = True) -> None:
        self.stateful = stateful

    def __iter__(self):
        info = tud.get_worker_info()
        wid = 0 if info is None else info.id
        values = [wid * 100 + j for j in range(3 + 4 * wid + (8 if info is None else 0))]
        return _Cursor(values) if self.stateful else iter(values)


class CountingFlow(bridgeflow.DataFlow):
    """A DataFlow with a hand-written state_dict()/load_state_dict(): a per-epoch shuffled range whose state is
    (epoch, datapoints handed out)."""

    def __init__(self, n: int = 10, seed: int = 7) -> None:
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = np.random.RandomState(self.seed + self.epoch).permutation(self.n)
        while self.pos < self.n:
            i = int(order[self.pos])
            self.pos += 1
            yield [np.int64(i)]
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


# --- the check ----------------------------------------------------------------------------------------


def plain(batch):
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [plain(x) for x in batch]
    return batch


def _epoch_start(loader, epoch):
    for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if hasattr(s, "set_epoch"):
            s.set_epoch(epoch)


def uninterrupted(make, epochs):
    torch.manual_seed(0)
    loader = make()
    out = []
    for e in range(epochs):
        _epoch_start(loader, e)
        out.append([plain(b) for b in loader])
    _close(loader)
    return out


def interrupted(make, k, epochs, through="json"):
    torch.manual_seed(0)
    loader = make()
    out, current, epoch = [], [], 0
    _epoch_start(loader, epoch)
    it = iter(loader)
    while sum(map(len, out)) + len(current) < k:
        try:
            current.append(plain(next(it)))
        except StopIteration:
            out.append(current)
            current, epoch = [], epoch + 1
            _epoch_start(loader, epoch)
            it = iter(loader)
    state, rng = loader.state_dict(), torch.get_rng_state()
    del it
    _close(loader)
    if through == "json":
        state = json.loads(json.dumps(state))
    else:
        buf = io.BytesIO()
        torch.save(state, buf)
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    torch.manual_seed(12345)  # a new process: its own global RNG until the checkpoint's is restored
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    _epoch_start(resumed, epoch)
    current.extend(plain(b) for b in resumed)
    out.append(current)
    while len(out) < epochs:
        _epoch_start(resumed, len(out))
        out.append([plain(b) for b in resumed])
    _close(resumed)
    return out


def _close(loader):
    loader.close()
    if isinstance(loader.dataset, bridgeflow.DataFlow):
        loader.dataset.close()


def check_resume(make, ks, epochs=3):
    ref = uninterrupted(make, epochs)
    total = sum(map(len, ref))
    assert total > 0
    for k in ks:
        k = total + k if k < 0 else k
        assert interrupted(make, k, epochs) == ref, f"resumed after {k} batches"
    return ref


# --- map-style datasets --------------------------------------------------------------------------------

def _gen(seed=3):
    return torch.Generator().manual_seed(seed)


SAMPLING = {
    "sequential": lambda ds: dict(batch_size=3),
    "shuffle_generator": lambda ds: dict(batch_size=3, shuffle=True, generator=_gen()),
    "shuffle_global_rng": lambda ds: dict(batch_size=3, shuffle=True),
    "no_auto_batching": lambda ds: dict(batch_size=None, shuffle=True, generator=_gen()),
    "replacement": lambda ds: dict(batch_size=4, sampler=tud.RandomSampler(ds, True, 14, generator=_gen(1))),
    "weighted": lambda ds: dict(batch_size=2, sampler=tud.WeightedRandomSampler([1.0] * 11, 9, generator=_gen())),
    "subset_global_rng": lambda ds: dict(batch_size=2, sampler=tud.SubsetRandomSampler(range(1, 11, 2))),
    "distributed": lambda ds: dict(batch_size=2, sampler=tud.DistributedSampler(ds, 2, 1, shuffle=True, seed=5)),
    "batch_sampler": lambda ds: dict(batch_sampler=tud.BatchSampler(tud.RandomSampler(ds, generator=_gen()), 4,
                                                                     drop_last=True)),
}


@pytest.mark.parametrize("workers", [dict(num_workers=0), dict(num_workers=2),
                                     dict(num_workers=2, persistent_workers=True)],
                         ids=["0-workers", "2-workers", "persistent"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_map_style_resume(sampling, workers, leak_check):
    def make():
        ds = Tagged()
        return DataLoader(ds, **SAMPLING[sampling](ds), **workers)

    ref = check_resume(make, ks=[0, 1, 2, -4, -1])
    if workers["num_workers"]:
        assert {s[1] for b in ref[0] for s in _samples(b)} == {0, 1}


def _samples(batch):
    if isinstance(batch[0], list):  # collated: columns
        return list(zip(*batch))
    return [batch]


def test_resume_draws_nothing_from_the_global_rng(leak_check):
    """With the global RNG restored from the checkpoint (as Lightning does), draws made by the dataset in
    this process continue exactly: resuming must not draw from it (torchdata draws an unused seed). Worker
    processes restart their streams from their seeds instead (as torchdata's do)."""
    ref = check_resume(lambda: DataLoader(Drawing(), batch_size=3, shuffle=True, generator=_gen()),
                       ks=[0, 1, 2, -1])
    assert len({s[-1] for b in ref[0] for s in _samples(b)}) == 11


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_state_per_worker(num_workers, leak_check):
    """Each worker's copy of a stateful dataset is restored to its state after its last delivered batch."""
    check_resume(lambda: DataLoader(CallCounting(), batch_size=2, shuffle=True, generator=_gen(),
                                    num_workers=num_workers), ks=[1, 3, 5, -1])


def test_torch_save_roundtrip_with_weights_only(leak_check):
    def make():
        return DataLoader(Tagged(), batch_size=3, shuffle=True, num_workers=2)

    ref = uninterrupted(make, 2)
    assert interrupted(make, 2, 2, through="torch.save") == ref


def test_state_before_iterating_and_loading_nothing(leak_check):
    loader = DataLoader(Tagged(6), batch_size=2, shuffle=True, generator=_gen())
    state = loader.state_dict()
    assert state["started"] is False and state["version"] == 2
    first = [plain(b) for b in loader]
    again = DataLoader(Tagged(6), batch_size=2, shuffle=True, generator=_gen())
    again.load_state_dict(state)
    assert again.state_dict() == state  # a loaded state is what the loader reports until it is used
    assert [plain(b) for b in again] == first
    again.load_state_dict({})  # torchdata's "no state": ignored
    assert len([plain(b) for b in again]) == 3


class Failing(Tagged):
    def __getitem__(self, i: int):
        if i == 4:
            raise KeyError(f"sample {i} is corrupt")
        return super().__getitem__(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_that_raised_counts_as_consumed(num_workers, leak_check):
    """State taken after a batch raised: the resumed loader neither reads that batch again nor skips one."""
    def make():
        return DataLoader(Failing(), batch_size=2, num_workers=num_workers)

    def take(it, n):
        out = []
        for _ in range(n):
            try:
                out.append(plain(next(it)))
            except KeyError:
                out.append("error")
        return out

    loader = make()
    it = iter(loader)
    first = take(it, 3)
    assert first[2] == "error"
    state = loader.state_dict()
    rest = [plain(b) for b in it]
    del it
    loader.close()
    again = make()
    again.load_state_dict(state)
    assert [plain(b) for b in again] == rest and len(rest) == 3
    again.close()


class SlowIndices(Tagged):
    """Tagged, with the given indices held back until the file ``gate`` exists: their batches are handed out
    after later ones, however slowly the other worker starts (a fixed sleep was not always long enough)."""

    def __init__(self, gate: str, n: int = 10, slow: tuple = (0,), fail: tuple = ()) -> None:
        super().__init__(n)
        self.gate, self.slow, self.fail = gate, slow, fail

    def __getitem__(self, i: int):
        if i in self.slow:
            assert wait_for(lambda: os.path.exists(self.gate), interval=0.005), "the test never opened the gate"
        if i in self.fail:
            raise KeyError(f"sample {i} is corrupt")
        return super().__getitem__(i)


def _indices_of(batches) -> list[int]:
    return [s[0] for b in batches for s in _samples(b)]


def _take(it, n) -> list:
    out = []
    for _ in range(n):
        try:
            out.append(plain(next(it)))
        except KeyError:
            out.append("error")
    return out


@pytest.mark.parametrize("batch_size", [None, 1, 2])
@pytest.mark.parametrize("resumed_in_order", [False, True])
def test_in_order_false_resumes_exactly_the_batches_not_handed_out(batch_size, resumed_in_order, leak_check,
                                                                 tmp_path):
    """torchdata's test_out_of_order_index_ds and more: the slow batch is not handed out before the state is
    taken; the resumed loader (in order or not) hands out every other batch of the epoch once, then full epochs."""
    gate = tmp_path / "gate"

    def make(in_order=False):
        return DataLoader(SlowIndices(str(gate)), batch_size=batch_size, num_workers=2, in_order=in_order)

    loader = make()
    it = iter(loader)
    first = _take(it, 3 if batch_size == 2 else 4)
    assert 0 not in _indices_of(first)  # handed out as they were ready: the slow one is still in flight
    state = json.loads(json.dumps(loader.state_dict()))
    gate.touch()
    assert state["ahead"] and state["started"]
    del it
    loader.close()
    again = make(in_order=resumed_in_order)
    again.load_state_dict(state)
    it = iter(again)
    rest = _take(it, 1)
    mid = json.loads(json.dumps(again.state_dict()))  # a state of the resumed epoch resumes it too
    rest += [plain(b) for b in it]
    del it
    assert sorted(_indices_of(first + rest)) == list(range(10))
    third = make()
    third.load_state_dict(mid)
    assert sorted(_indices_of(first + rest[:1] + [plain(b) for b in third])) == list(range(10))
    assert sorted(_indices_of(plain(b) for b in again)) == list(range(10))  # the next epoch: all of it
    again.close()
    third.close()


def test_in_order_false_a_batch_that_raised_counts_as_consumed(leak_check, tmp_path):
    gate = tmp_path / "gate"

    def make():
        return DataLoader(SlowIndices(str(gate), slow=(0,), fail=(3,)), batch_size=1, num_workers=2,
                          in_order=False)

    loader = make()
    it = iter(loader)
    first = _take(it, 5)
    assert "error" in first and 0 not in _indices_of(x for x in first if x != "error")
    state = loader.state_dict()
    gate.touch()
    del it
    loader.close()
    again = make()
    again.load_state_dict(state)
    rest = _take(iter(again), 5)
    got = _indices_of(x for x in first + rest if x != "error")
    assert sorted(got) == [i for i in range(10) if i != 3] and (first + rest).count("error") == 1
    again.close()


# --- iterable datasets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [dict(num_workers=0), dict(num_workers=2),
                                     dict(num_workers=2, persistent_workers=True)],
                         ids=["0-workers", "2-workers", "persistent"])
def test_iterable_with_state_resumes_per_worker(workers, leak_check):
    ref = check_resume(lambda: DataLoader(UnevenStream(), batch_size=2, **workers), ks=[0, 1, 3, 4, 6, -1])
    if workers["num_workers"]:
        flat = [x for b in ref[0] for x in b]
        assert sorted(flat) == [0, 1, 2, *range(100, 107)]  # worker 0 ran dry first


def test_a_state_taken_is_not_changed_by_iterating_on(leak_check):
    """The state is a snapshot: its list of workers that ran dry was the live iterator's own list, so a
    state kept in memory while iterating on later marked a worker dry that was not, and resuming from it
    dropped that worker's remaining samples."""
    for k in range(1, 10):
        loader = DataLoader(UnevenStream(), batch_size=None, num_workers=2)
        it = iter(loader)
        head = [int(next(it)) for _ in range(k)]
        state = loader.state_dict()
        frozen = json.dumps(state)
        rest = [int(x) for x in it]
        assert json.dumps(state) == frozen, k
        resumed = DataLoader(UnevenStream(), batch_size=None, num_workers=2)
        resumed.load_state_dict(state)
        assert [int(x) for x in resumed] == rest, k
        assert sorted(head + rest) == [0, 1, 2, *range(100, 107)]
        _close(loader)
        _close(resumed)


class RewindingStream(tud.IterableDataset):
    """A stream with its own state that rewinds itself when its iteration ends (a common pattern)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def __iter__(self):
        while self.pos < 5:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0


def test_a_stream_that_rewinds_at_its_end_resumes_after_the_last_short_batch(leak_check):
    """Reading the last, short batch ran the stream to its end (and it rewound): the state says the
    stream ended, so the resumed epoch is empty (it replayed the whole epoch before), as torchdata's."""
    for k in range(3):
        loader = DataLoader(RewindingStream(), batch_size=3)
        it = iter(loader)
        [next(it) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))
        rest = [b.tolist() for b in it]
        resumed = DataLoader(RewindingStream(), batch_size=3)
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == rest, k
        assert [b.tolist() for b in resumed] == [[0, 1, 2], [3, 4]]  # and the next epoch is whole


class RewindingShards(RewindingStream):
    """Per worker a shard of 2 + 3 * id samples read through a position kept on the dataset, which rewinds
    itself when the shard ends (so the next epoch reads it again)."""

    def __iter__(self):
        info = tud.get_worker_info()
        wid = 0 if info is None else info.id
        while self.pos < 2 + 3 * wid:
            self.pos += 1
            yield wid * 100 + self.pos - 1
        self.pos = 0


@pytest.mark.parametrize("batch_size", [None, 2])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_whose_stream_rewinds_at_its_end_resumes_into_the_next_epoch(batch_size, persistent,
                                                                              leak_check):
    """A worker that ran dry sends its dataset's state as it ran out (rewound), not the state of its last
    batch: resumed after that, the worker sat the rest of the epoch out with its position at the end, and
    its next epoch was empty (torchdata re-reads the whole shard there instead)."""
    ref = check_resume(lambda: DataLoader(RewindingShards(), batch_size=batch_size, num_workers=2,
                                          persistent_workers=persistent), ks=[0, 1, 2, 3, 4, 5, -1])
    assert sorted(x for b in ref[1] for x in np.atleast_1d(b)) == [0, 1, 100, 101, 102, 103, 104]


@pytest.mark.parametrize("sampling", ["sequential", "shuffle_generator", "replacement", "batch_sampler"])
def test_persistent_workers_resumed_between_epochs_keep_their_seeds(sampling, leak_check):
    """With persistent workers torch draws the workers' base seed once, for the first epoch; a state taken
    after an epoch ended keeps it, so the resumed loader's next epoch runs on the same seeds and draws
    the same permutation (it drew a new base seed before, which also moved the shuffle's generator)."""
    def make():
        ds = Tagged()
        return DataLoader(ds, **SAMPLING[sampling](ds), num_workers=2, persistent_workers=True)

    ref = uninterrupted(make, 3)
    torch.manual_seed(0)
    loader = make()
    first = [plain(b) for b in loader]
    state, rng = json.loads(json.dumps(loader.state_dict())), torch.get_rng_state()
    _close(loader)
    torch.manual_seed(12345)
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert [first] + [[plain(b) for b in resumed] for _ in range(2)] == ref
    _close(resumed)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_without_state_is_fast_forwarded(num_workers, caplog, leak_check):
    with caplog.at_level(logging.WARNING, logger="bridgeflow.adapters.torch"):
        check_resume(lambda: DataLoader(UnevenStream(stateful=False), batch_size=2, num_workers=num_workers),
                     ks=[1, 4, 5, -1])  # 5 and the last: after worker 0 ran dry
    assert "read again and dropped" in caplog.text


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffled_datapipe_resumes(num_workers, leak_check):
    """A DataPipe reshuffles with a seed drawn per epoch; the state keeps it, the pipe is fast-forwarded."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    def make():
        pipe = IterableWrapper(range(12)).shuffle().sharding_filter()
        return DataLoader(pipe, batch_size=3, shuffle=True, num_workers=num_workers)

    ref = check_resume(make, ks=[0, 1, 3, 5, -1])
    assert ref[0] != ref[1] and sorted(x for b in ref[0] for x in b) == list(range(12))


# --- DataFlows ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [dict(num_workers=0), dict(num_workers=2),
                                     dict(num_workers=2, persistent_workers=True, prefetch_factor=3)],
                         ids=["0-workers", "2-workers", "persistent"])
def test_dataflow_resumes_through_its_state_api(workers, leak_check):
    ref = check_resume(lambda: DataLoader(CountingFlow(), batch_size=3, **workers), ks=[0, 1, 2, 4, 5, -1])
    assert ref[0] != ref[1] and sorted(x for b in ref[1] for x in b[0]) == list(range(10))


def _tenfold(dp):
    return [dp[0] * 10]


def _pipeline(parallel: bool):
    """A bridgeflow pipeline with its own state API: a shuffled list, optionally mapped in 2 processes."""
    flow = bridgeflow.DataFromList([[np.int64(i)] for i in range(14)], shuffle=True, seed=5)
    if parallel:
        flow = bridgeflow.MultiProcessMapData(flow, 2, _tenfold, buffer_size=8)
    return bridgeflow.MapData(flow, lambda dp: [dp[0] + 1])


@pytest.mark.parametrize("parallel", [False, True], ids=["list", "process-map"])
@pytest.mark.parametrize("workers", [dict(num_workers=0), dict(num_workers=2)], ids=["0-workers", "2-workers"])
def test_bridgeflow_pipelines_resume_through_the_loader(parallel, workers, leak_check):
    ref = check_resume(lambda: DataLoader(_pipeline(parallel), batch_size=3, **workers), ks=[0, 1, 3, -1])
    assert ref[0] != ref[1]
    scale = 10 if parallel else 1
    assert sorted(x for b in ref[1] for x in b[0]) == [i * scale + 1 for i in range(14)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataflow_that_cannot_resume_says_why(num_workers, leak_check):
    flow = bridgeflow.DataFromGenerator(iter([[np.int64(i)] for i in range(7)]))  # a one-shot iterator
    with DataLoader(flow, batch_size=3, num_workers=num_workers) as loader:
        assert loader.state_dict()["started"] is False  # epoch boundaries need no position
        it = iter(loader)
        next(it)
        with pytest.raises(NotImplementedError, match=r"DataFromGenerator.*generator function"):
            loader.state_dict()
        assert [len(b[0]) for b in it] == [3, 1]  # asking did not disturb the epoch
        del it
    flow.close()


# --- bad input -----------------------------------------------------------------------------------------

def _state_after_one(**kwargs):
    loader = DataLoader(Tagged(), **kwargs)
    it = iter(loader)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize("saved,here,match", [
    (dict(batch_size=3), dict(batch_size=4), "batch_size=3.*batch_size=4"),
    (dict(batch_size=3, shuffle=True), dict(batch_size=3), "sampler types.*RandomSampler.*SequentialSampler"),
    (dict(batch_size=3, drop_last=True), dict(batch_size=3), "drop_last=True"),
    (dict(batch_size=2, sampler=tud.DistributedSampler(Tagged(), 2, 0)),
     dict(batch_size=2, sampler=tud.DistributedSampler(Tagged(), 3, 0)), "distributed.*'num_replicas': 2"),
    (dict(batch_size=2, sampler=tud.DistributedSampler(Tagged(), 2, 0, seed=1)),
     dict(batch_size=2, sampler=tud.DistributedSampler(Tagged(), 2, 1, seed=2)), "distributed.*'seed': 1"),
])
def test_mismatched_state_is_refused_naming_it(saved, here, match):
    state = _state_after_one(**saved)
    with pytest.raises(ResumeStateError, match=match) as info:
        DataLoader(Tagged(), **here).load_state_dict(state)
    assert isinstance(info.value, ValueError)


def test_state_of_another_dataset_length_is_refused():
    state = _state_after_one(batch_size=3)
    with pytest.raises(ValueError, match="dataset length=11.*dataset length=12"):
        DataLoader(Tagged(12), batch_size=3).load_state_dict(state)


def test_newer_format_and_foreign_states_are_refused():
    state = _state_after_one(batch_size=3)
    with pytest.raises(ValueError, match="format version 5, newer than this bridgeflow reads"):
        DataLoader(Tagged(), batch_size=3).load_state_dict({**state, "version": 5})
    with pytest.raises(ValueError, match="not a state of bridgeflow's DataLoader"):
        DataLoader(Tagged(), batch_size=3).load_state_dict({"_num_yielded": 1, "_sampler_iter_yielded": 1})


def test_a_field_edited_into_another_valid_value_is_refused_by_the_checksum():
    """A one-character change inside a generator's RNG state can still be a valid RNG state (the mutation
    fuzz found one): no field check sees it, the state's checksum does. The checksum survives JSON and
    torch.save, and a state without one (built by hand) is still taken on its fields."""
    def loader():
        return DataLoader(Tagged(40), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))

    first = loader()
    it = iter(first)
    next(it)
    state = first.state_dict()
    expected = [b[0].tolist() for b in it]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    for copy in (json.loads(json.dumps(state)), torch.load(buf, weights_only=True)):
        again = loader()
        again.load_state_dict(copy)
        assert [b[0].tolist() for b in again] == expected
    (path, rng), = state["rng_now"].items()
    at = len(rng) // 2  # a byte of the Mersenne Twister's 624 words: any value is a valid state
    edited = {**state, "rng_now": {path: rng[:at] + ("B" if rng[at] == "A" else "A") + rng[at + 1:]}}
    with pytest.raises(ResumeStateError, match=r"field 'check' of the state.*do not match the checksum"):
        loader().load_state_dict(edited)
    unchecked = {k: v for k, v in edited.items() if k != "check"}
    loader().load_state_dict(unchecked)  # no checksum: the fields' checks alone, which pass


def test_a_workers_entry_emptied_or_marked_ended_is_refused_by_the_checksum(leak_check):
    """A worker's entry of an iterable's state is loader bookkeeping around the dataset's state: emptied
    ({}: the worker would start its stream again) or marked ended, it still passes every field check, and
    resumed batches the uninterrupted run never gave (the mutation fuzz, 2 workers: 9 in 5,000)."""
    def loader():
        return DataLoader(UnevenStream(), batch_size=2, num_workers=2)

    first = loader()
    it = iter(first)
    next(it), next(it)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    assert all(isinstance(w, dict) for w in state["workers"])
    for edit in ({}, {**state["workers"][1], "ended": True}):
        damaged = {**state, "workers": [state["workers"][0], edit]}
        with pytest.raises(ResumeStateError, match=r"field 'check' of the state"):
            loader().load_state_dict(damaged)


def test_iterable_state_needs_the_same_worker_count(leak_check):
    loader = DataLoader(UnevenStream(), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    loader.close()
    with pytest.raises(ValueError, match="num_workers.*=2.*=0"):
        DataLoader(UnevenStream(), batch_size=2).load_state_dict(state)
