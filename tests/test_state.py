"""State of the sequential flows: every flow of the package resumes exactly (the contract), custom flows get
the count-and-skip default, flows that cannot resume say so, and a state of another flow is refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import bridgeflow as bf
from bridgeflow import DataFlow, ProxyDataFlow, RNGDataFlow
from bridgeflow._state import NotResumableError, StateMismatchError
from bridgeflow.testing import assert_same_datapoints, check_resumable


def src(n=12, shuffle=True, seed=3, **kw):
    return bf.DataFromList([[i, np.full(2, i, np.int16)] for i in range(n)], shuffle=shuffle, seed=seed, **kw)


def ragged(dp):
    return [np.zeros(dp[0] % 3, np.float32), dp[0]]


def keep_some(dp):
    return None if dp[0] % 4 == 1 else [dp[0] * 10]


class Counter(DataFlow):
    """A custom flow that writes only __iter__: the default state (count and skip)."""

    def __init__(self, n=9):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield [i]


class Noise(RNGDataFlow):
    """A custom random flow that writes only __iter__: the default state restores self.rng."""

    def __init__(self, n=8, seed=None):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            yield [int(self.rng.randint(1 << 30))]


class Doubler(ProxyDataFlow):
    """A custom proxy that writes only __iter__ (and so gets the default, not its parent's state)."""

    def __iter__(self):
        for dp in self.ds:
            yield [dp[0] * 2]
            yield [dp[0] * 2 + 1]

    def __len__(self):
        return 2 * len(self.ds)


FLOWS = {
    "DataFromList shuffled": lambda: src(),
    "DataFromList in order": lambda: src(shuffle=False),
    "DataFromList sharded": lambda: bf.DataFromList(list(range(13)), shuffle=True, seed=1, shard=(2, 3)),
    "DataFromGenerator": lambda: bf.DataFromGenerator(lambda: ([i] for i in range(7)), size=7),
    "DataFromIterable": lambda: bf.DataFromIterable([[i] for i in range(7)]),
    "FakeData": lambda: bf.FakeData([[2, 3], [1]], size=9, seed=1),
    "FakeData fixed": lambda: bf.FakeData([[2]], size=9, random=False, seed=2),
    "FakeData endless": lambda: bf.FixedSizeData(bf.FakeData([[2]], size=None, seed=4), 6, keep_state=False),
    "MapData": lambda: bf.MapData(src(), keep_some),
    "MapDataComponent": lambda: bf.MapDataComponent(src(), lambda x: x + 1, 0),
    "FilterData": lambda: bf.FilterData(src(), lambda dp: dp[0] % 2 == 0),
    "SelectComponent": lambda: bf.SelectComponent(src(), [1]),
    "PrintData": lambda: bf.PrintData(src()),
    "RepeatedData": lambda: bf.RepeatedData(src(5), 3),
    "RepeatedData forever": lambda: bf.FixedSizeData(bf.RepeatedData(src(5), -1), 7),
    "RepeatedDataPoint": lambda: bf.RepeatedDataPoint(src(5), 3),
    "FixedSizeData keep_state": lambda: bf.FixedSizeData(src(5), 7),
    "FixedSizeData fresh": lambda: bf.FixedSizeData(src(5), 3, keep_state=False),
    # the inner one is left mid-epoch by the outer: its epoch (and its list's) must end with the outer's
    "FixedSizeData fresh nested": lambda: bf.FixedSizeData(bf.FixedSizeData(src(9), 13, keep_state=False), 6,
                                                           keep_state=False),
    # left by their parent part-way through an item, over a source whose next epoch continues its generator:
    # a resume reads that item again at iter(), not at the first next() that the parent never makes
    "UnbatchData left mid-batch": lambda: bf.FixedSizeData(bf.UnbatchData(bf.BatchData(
        bf.FakeData([[2]], size=7, seed=3), 3, remainder=True)), 2, keep_state=False),
    "RepeatedDataPoint left mid-repeats": lambda: bf.FixedSizeData(bf.RepeatedDataPoint(
        bf.FakeData([[2]], size=5, seed=3), 3), 2, keep_state=False),
    "CacheData shuffled": lambda: bf.CacheData(src(6), shuffle=True, seed=2),
    "CacheData": lambda: bf.CacheData(src(6)),
    "BatchData": lambda: bf.BatchData(src(11), 3),
    "BatchData remainder": lambda: bf.BatchData(src(11), 3, remainder=True),
    "BatchDataByShape": lambda: bf.BatchDataByShape(bf.MapData(src(20), ragged), 2, 0, remainder=True),
    "UnbatchData": lambda: bf.UnbatchData(bf.BatchData(src(11), 3, remainder=True)),
    "ConcatData": lambda: bf.ConcatData([src(4), src(5, seed=9)]),
    "JoinData": lambda: bf.JoinData([src(6), bf.MapData(src(6, seed=9), lambda dp: [dp[0]])]),
    "RandomChooseData": lambda: bf.RandomChooseData([src(6), (src(6, seed=9), 2.0)], seed=4),
    "RandomMixData": lambda: bf.RandomMixData([src(4), src(5, seed=9)], seed=4),
    "LocallyShuffleData": lambda: bf.LocallyShuffleData(src(10), 4, num_reuse=2, seed=5),
    "LocallyShuffleData one pass": lambda: bf.LocallyShuffleData(src(10), 4, num_reuse=2, seed=5, one_pass=True),
    "ShardData padded": lambda: bf.ShardData(src(10), 1, 3),
    "ShardData first rank": lambda: bf.ShardData(src(10), 0, 3),
    "ShardData drop_last": lambda: bf.ShardData(src(10), 2, 3, drop_last=True),
    "custom DataFlow": lambda: Counter(),
    "custom RNGDataFlow": lambda: Noise(seed=6),
    "custom proxy": lambda: Doubler(src(5)),
    "a pipeline": lambda: bf.BatchData(bf.LocallyShuffleData(bf.MapData(bf.RepeatedData(src(6), 2), keep_some), 3,
                                                             seed=1), 2, remainder=True),
}


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_every_flow_resumes_exactly(name):
    """The contract: after 0, half and all of an epoch, before or after reset_state, through json."""
    check_resumable(FLOWS[name], epochs=3)


@pytest.mark.parametrize("name", ["MapData", "BatchData remainder", "UnbatchData", "RandomMixData",
                                  "LocallyShuffleData", "ShardData padded", "CacheData shuffled",
                                  "RepeatedDataPoint", "FixedSizeData fresh", "FixedSizeData fresh nested",
                                  "UnbatchData left mid-batch", "RepeatedDataPoint left mid-repeats", "a pipeline"])
def test_resumes_after_every_position(name):
    n = len(check_resumable(FLOWS[name], positions=[0]))
    check_resumable(FLOWS[name], positions=range(n + 1))


@pytest.mark.parametrize("name", ["DataFromList shuffled", "a pipeline", "CacheData shuffled", "JoinData"])
def test_resumes_twice(name):
    """A state saved by a resumed flow resumes again (in the next epoch too)."""
    make = FLOWS[name]
    with make() as u:
        u.reset_state()
        runs = [list(u) for _ in range(3)]
    n = len(runs[0])
    flat = runs[0] + runs[1] + runs[2]
    got, state = [], None
    for stop in (n // 3, n, n + 2, 2 * n):  # saved mid-epoch, at an epoch's end, in the next epoch
        with make() as f:
            if state is not None:
                f.load_state_dict(state)
            it = iter(f)
            while len(got) < stop:
                try:
                    got.append(next(it))
                except StopIteration:
                    it = iter(f)
            state = json.loads(json.dumps(f.state_dict()))
            it.close()
    assert_same_datapoints(got, flat[:len(got)])


@pytest.mark.parametrize("make", [lambda: bf.FakeData([[2]], size=9, random=False), lambda: Noise(),
                                  lambda: bf.DataFromList(list(range(9))), lambda: bf.CacheData(src(6), shuffle=True),
                                  lambda: bf.RandomMixData([src(4), src(5)])],
                         ids=["FakeData fixed", "custom RNGDataFlow", "DataFromList", "CacheData", "RandomMixData"])
def test_unseeded_flows_resume_their_own_stream(make):
    """Without a seed, the state carries the entropy: the resumed flow continues the saved flow's stream."""
    for k in (0, 3, None):
        f = make()
        k = len(f) if k is None else k
        it = iter(f)
        got = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(f.state_dict()))
        rest = list(it)
        following = list(f)
        g = make()
        g.load_state_dict(state)
        assert_same_datapoints(list(g), rest)
        assert_same_datapoints(list(g), following)
        assert len(got) == k


def test_state_before_any_iteration_resumes_at_the_start():
    fresh = src()
    state = fresh.state_dict()  # before reset_state(): nothing read yet
    with src() as u:
        expected = [list(u) for _ in range(2)]
    with src() as g:
        g.load_state_dict(state)
        assert_same_datapoints(list(g) + list(g), expected[0] + expected[1])


def test_state_is_small_and_plain():
    """Positions as ints and the shuffle as a seed, not the permutation: small whatever the length."""
    df = bf.BatchData(bf.MapData(bf.DataFromList(list(range(1_000_000)), shuffle=True, seed=0),
                                 lambda x: [x]), 32)
    it = iter(df)
    next(it)
    state = df.state_dict()
    text = json.dumps(state)
    assert len(text) < 600, text
    assert state["class"] == "BatchData" and state["child"]["class"] == "MapData"
    leaf = state["child"]["child"]
    assert leaf["class"] == "DataFromList" and leaf["pos"] == 32 and leaf["version"] == 1


def test_loaded_state_reads_back_before_iterating():
    f = FLOWS["a pipeline"]()
    it = iter(f)
    next(it), next(it)
    state = json.loads(json.dumps(f.state_dict()))
    g = FLOWS["a pipeline"]()
    g.load_state_dict(state)
    assert g.state_dict() == state


def test_end_of_epoch_resumes_with_an_empty_rest_then_the_next_epoch():
    """The documented contract for a state taken right after an epoch's last datapoint."""
    with src() as u:
        e0, e1 = list(u), list(u)
    f = src()
    it = iter(f)
    for _ in range(len(e0)):
        next(it)
    state = f.state_dict()
    g = src()
    g.load_state_dict(state)
    assert list(g) == []
    assert_same_datapoints(list(g), e1)


def test_iterator_dropped_before_its_first_datapoint_ends_the_resumed_epoch():
    """JoinData's zip stops at its first child's end without reading the second: the second's resumed
    epoch must still end, so the next epoch is complete."""
    make = FLOWS["JoinData"]
    with make() as u:
        runs = [list(u) for _ in range(2)]
    f = make()
    it = iter(f)
    for _ in range(len(runs[0])):
        next(it)
    state = f.state_dict()
    g = make()
    g.load_state_dict(state)
    assert list(g) == []
    assert_same_datapoints(list(g), runs[1])


# --- readers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    d = tmp_path_factory.mktemp("state")
    dps = [[np.full(3, i, np.int32), i, f"s{i}"] for i in range(23)]
    wide = [[np.full(40_000, i % 251, np.uint8), i] for i in range(60)]  # several HDF5 blocks
    paths = {"lmdb": str(d / "a.lmdb"), "hdf5": str(d / "a.h5"), "npz": str(d / "a.npz"),
             "hdf5-wide": str(d / "w.h5")}
    bf.LMDBSerializer.save(bf.DataFromList(dps, shuffle=False), paths["lmdb"], progress=False)
    bf.HDF5Serializer.save(bf.DataFromList(dps, shuffle=False), paths["hdf5"], progress=False)
    bf.NumpySerializer.save(bf.DataFromList(dps, shuffle=False), paths["npz"], progress=False)
    bf.HDF5Serializer.save(bf.DataFromList(wide, shuffle=False), paths["hdf5-wide"], progress=False)
    return paths


READER_OPTIONS = [dict(shuffle=True, seed=1), dict(shuffle=False), dict(shuffle=False, shard=(2, 3)),
                  dict(shuffle=True, seed=2, shard=(1, 4)), dict(shuffle=False, shard=(3, 4), drop_last=True)]


@pytest.mark.parametrize("options", READER_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "npz", "hdf5-wide"])
def test_readers_resume_exactly(datasets, fmt, options):
    path = datasets[fmt]
    load = {"lmdb": bf.LMDBSerializer.load, "npz": bf.NumpySerializer.load}.get(fmt, bf.HDF5Serializer.load)
    check_resumable(lambda: load(path, **options), epochs=3)


def test_readers_sequential_resume_every_position(datasets):
    for fmt, n in (("lmdb", 23), ("hdf5-wide", 60)):
        path = datasets[fmt]
        check_resumable(lambda path=path: bf.load_dataset(path), positions=range(0, n + 1, 3))


def test_reader_state_from_another_file_is_refused(datasets, tmp_path):
    other = str(tmp_path / "b.lmdb")
    bf.LMDBSerializer.save(bf.DataFromList([[np.full(9, i), i, "x"] for i in range(23)], shuffle=False), other,
                           progress=False)
    f = bf.LMDBSerializer.load(datasets["lmdb"], shuffle=False)
    next(iter(f))
    state = f.state_dict()
    with pytest.raises(StateMismatchError, match=r"^LMDBDataset: the state was saved reading .*another file"):
        bf.LMDBSerializer.load(other, shuffle=False).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="length 23, this flow has a dataset of length 10"):
        bf.DataFromList(list(range(10))).load_state_dict({**state, "class": "DataFromList"})


# --- what cannot resume ------------------------------------------------------------------------------


def test_generator_object_cannot_resume_and_says_what_to_pass():
    df = bf.BatchData(bf.MapData(bf.DataFromGenerator([i] for i in range(4)), lambda dp: dp), 2)
    with pytest.raises(NotResumableError, match=r"^BatchData/MapData/DataFromGenerator: it was given a generator "
                                                r"object.*pass the generator function"):
        df.state_dict()
    assert [b[0].tolist() for b in df] == [[0, 1], [2, 3]]  # iterating is unaffected
    with pytest.raises(NotResumableError, match="one-shot iterator"):
        bf.DataFromIterable(iter([[1]])).state_dict()


def test_iterating_a_flow_that_cannot_resume_still_works():
    df = bf.LocallyShuffleData(bf.DataFromGenerator([i] for i in range(6)), 2, seed=0, one_pass=True)  # no state
    assert sorted(dp[0] for dp in df) == list(range(6))
    with pytest.raises(NotResumableError, match="^LocallyShuffleData/DataFromGenerator: it was given"):
        df.state_dict()


def test_declared_not_resumable():
    class Live(DataFlow, resumable=False):
        def __iter__(self):
            yield [1]

    with pytest.raises(NotResumableError, match=r"^MapData/Live: declared resumable=False"):
        bf.MapData(Live(), lambda dp: dp).state_dict()
    assert list(bf.MapData(Live(), lambda dp: dp)) == [[1]]


def test_bridgeflow_flow_without_state_refuses_rather_than_guess():
    speed = bf.TestDataSpeed(src(), size=3, progress=False, file=open(os.devnull, "w"))
    with pytest.raises(NotResumableError, match=r"TestDataSpeed cannot save its position"):
        speed.state_dict()


def test_custom_flow_that_is_not_deterministic_is_caught_on_resume():
    class Shrinking(DataFlow):
        n = 5

        def __iter__(self):
            Shrinking.n -= 7
            yield from ([i] for i in range(Shrinking.n))

    f = Shrinking()
    Shrinking.n = 20
    it = iter(f)
    [next(it) for _ in range(8)]
    state = f.state_dict()
    g = Shrinking()
    g.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="does not depend only on its children and self.rng"):
        iter(g)


# --- mismatches --------------------------------------------------------------------------------------


def _state_of(df, k=2):
    it = iter(df)
    for _ in range(k):
        next(it)
    return json.loads(json.dumps(df.state_dict()))


def test_another_class_at_some_depth_is_named_with_its_path():
    state = _state_of(bf.BatchData(bf.MapData(src(), lambda dp: dp), 2))
    with pytest.raises(StateMismatchError, match=r"^BatchData/FilterData: the state was saved by a MapData, this "
                                                 r"flow is a FilterData"):
        bf.BatchData(bf.FilterData(src(), bool), 2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^BatchData/MapData/DataFromList: the state is for a dataset of length "
                                         r"12, this flow has a dataset of length 13"):
        bf.BatchData(bf.MapData(src(13), lambda dp: dp), 2).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="batches of 2, this flow makes batches of 3"):
        bf.BatchData(bf.MapData(src(), lambda dp: dp), 3).load_state_dict(state)


def test_children_are_named_by_position():
    state = _state_of(bf.ConcatData([src(4), src(5)]))
    with pytest.raises(StateMismatchError, match=r"^ConcatData/DataFromList\[1\]: the state is for a dataset of "
                                                 r"length 5"):
        bf.ConcatData([src(4), src(6)]).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"^ConcatData: the state has 2 children, this flow reads 3"):
        bf.ConcatData([src(4), src(5), src(1)]).load_state_dict(state)


def test_newer_version_and_damaged_states_are_refused():
    state = _state_of(bf.MapData(src(), lambda dp: dp))
    newer = json.loads(json.dumps(state))
    newer["child"]["version"] = 99
    with pytest.raises(StateMismatchError, match=r"^MapData/DataFromList: the state has format version 99, newer"):
        bf.MapData(src(), lambda dp: dp).load_state_dict(newer)
    with pytest.raises(StateMismatchError, match="names no flow class"):
        src().load_state_dict({"pos": 1})
    with pytest.raises(StateMismatchError, match="a state must be a dict"):
        src().load_state_dict([1, 2])
    damaged = dict(state["child"], pos=-1)
    with pytest.raises(StateMismatchError, match="'pos' of the state is negative"):
        src().load_state_dict(damaged)
    rng = _state_of(bf.FakeData([[1]], size=5, seed=0))
    rng["rng"]["key"] = "zz"
    with pytest.raises(StateMismatchError, match="damaged random generator state"):
        bf.FakeData([[1]], size=5).load_state_dict(rng)
    with pytest.raises(StateMismatchError, match="size=5, this flow has size=6"):
        bf.FakeData([[1]], size=6).load_state_dict(_state_of(bf.FakeData([[1]], size=5, seed=0)))


def test_a_refused_state_changes_nothing():
    df = bf.MapData(src(), lambda dp: dp)
    with pytest.raises(StateMismatchError):
        df.load_state_dict(_state_of(bf.MapData(src(13), lambda dp: dp)))
    with src() as u:
        assert_same_datapoints(list(df), list(bf.MapData(u, lambda dp: dp)))


# --- epochs of shuffled sources ----------------------------------------------------------------------


def test_set_epoch_picks_the_order_and_resumes_it():
    a, b = src(), src()
    b.set_epoch(5)
    orders = [list(a) for _ in range(7)]
    assert_same_datapoints(list(b), orders[5])
    assert_same_datapoints(list(b), orders[6])
    c = src()
    c.set_epoch(3)
    it = iter(c)
    next(it)
    c.set_epoch(3)  # the epoch in progress already reads 3: no effect
    state = c.state_dict()
    assert state["epoch"] == 3 and state["pos"] == 1
    d = src()
    d.load_state_dict(state)
    assert_same_datapoints(list(d), orders[3][1:])


def test_a_second_reset_state_goes_on_with_the_epochs_and_set_epoch_picks_one():
    """reset_state() once per epoch, a tensorpack habit, repeated epoch 0's shuffle of a seeded flow every epoch,
    silently (issue 38): a second reset_state() in the same process keeps the epoch counter and the generator."""
    with src() as u:
        epochs = [list(u) for _ in range(4)]
    df = src()
    first = [list(df) for _ in range(2)]
    df.reset_state()
    assert_same_datapoints(list(df), epochs[2])
    df.reset_state()
    assert_same_datapoints(list(df), epochs[3])
    df.set_epoch(1)
    df.reset_state()
    assert_same_datapoints(list(df), first[1])
    again = src()  # a new flow starts over
    assert_same_datapoints(list(again), first[0])


@pytest.mark.parametrize("make", [
    lambda: bf.FakeData([[2]], size=6, dtype="int64", seed=4),
    lambda: bf.RandomMixData([src(4), src(5, seed=8)], seed=2),
    lambda: bf.CacheData(src(), shuffle=True, seed=6),
], ids=["FakeData", "RandomMixData", "CacheData"])
def test_reset_state_every_epoch_gives_the_epochs_of_one_reset(make):
    """(LocallyShuffleData's endless buffer is dropped by a reset, as before: its next epoch is a new stream of
    its source's next epoch, not a repeat.)"""
    with make() as once:
        want = [[repr(dp) for dp in once] for _ in range(3)]
    with make() as df:
        got = []
        for _ in range(3):
            df.reset_state()
            got.append([repr(dp) for dp in df])
    assert got == want


def test_an_unseeded_flow_draws_its_seed_once_so_a_state_before_reset_resumes_its_run():
    """seed=None: a state taken before reset_state() held no generator, and the resumed flow drew another seed
    than the run that saved it went on with (issue 39). The seed is drawn at the first of reset_state() and
    state_dict(), and the state says where the first epoch begins."""
    make = lambda: bf.JoinData([bf.DataFromList([[i] for i in range(8)]), bf.FakeData([[1]], size=8, dtype="int64")])
    df = make()
    saved = json.loads(json.dumps(df.state_dict()))  # before reset_state()
    run = [[repr(dp) for dp in df] for _ in range(2)]
    with make() as g:
        g.load_state_dict(saved)
        assert [[repr(dp) for dp in g] for _ in range(2)] == run
    df.close()


def test_every_exported_flow_saves_its_state_or_says_it_cannot():
    """A flow added to the package without state would be refused (not guessed): list the refusals here."""
    # a network stream, Ray actors, a timer, a queue
    refusing = {"RemoteDataZMQ", "RayMapData", "TestDataSpeed", "DataFromQueue"}
    for name in bf.__all__:
        cls = getattr(bf, name)
        if not (isinstance(cls, type) and issubclass(cls, DataFlow)) or cls in (DataFlow, ProxyDataFlow, RNGDataFlow):
            continue
        if name in refusing:
            assert cls._why_not_resumable is not DataFlow._why_not_resumable, name
        else:  # its own state, or the default (count and replay) with the default beginning of an epoch
            own = cls._own_state is not DataFlow._own_state
            assert own or cls._begin_epoch is DataFlow._begin_epoch, f"{name} has no state"


def test_fixed_size_fresh_epochs_after_one_left_early():
    """FixedSizeData(keep_state=False) starts each epoch with a new iteration of its child; an epoch its
    consumer left early (ShardData taking its part) kept the child's iteration claimed, and the next
    epoch raised DataFlowReentrantError."""
    flow = bf.ShardData(bf.FixedSizeData(bf.DataFromList([[i] for i in range(7)], shuffle=False), 3,
                                         keep_state=False), 0, 2, drop_last=True)
    flow.reset_state()
    assert [[dp[0] for dp in flow] for _ in range(3)] == [[0]] * 3
    inner = bf.FixedSizeData(bf.DataFromList([[i] for i in range(7)], shuffle=False), 3, keep_state=False)
    inner.reset_state()
    for _ in range(3):
        it = iter(inner)
        assert next(it) == [0]
        del it  # left after one datapoint: FixedSizeData still holds its child's iteration
    flow.close()
    inner.close()


def test_a_state_saved_before_reset_then_taken_again_resumes_the_same_later():
    """A state saved before ``reset_state()`` has no generator state yet (``rng`` None: "as seeded"). Loaded and
    taken again after the reset, before the epoch begins, it said None still, and a flow that loaded it later
    (a parallel stage going back in its source) kept its generator as it was then, advanced by an epoch: the
    fuzz's tags of a stage under RandomMixData came out other than the uninterrupted run's (issue 29)."""
    make = lambda: bf.JoinData([src(6), bf.FakeData([[2]], size=6, dtype="int64", seed=4)])
    saved = json.loads(json.dumps(make().state_dict()))  # before reset_state(): no generators yet
    assert saved["children"][1]["rng"] is None
    with make() as g:
        g.load_state_dict(saved)
        g.reset_state()
        again = g.state_dict()  # loaded, not begun from: what the next epoch begins from
        first = [dp[2].tolist() for dp in g]
        g.load_state_dict(again)
        assert [dp[2].tolist() for dp in g] == first
    assert saved["children"][1]["rng"] is None  # the caller's state is not changed
