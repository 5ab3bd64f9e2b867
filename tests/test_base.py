"""The DataFlow lifecycle: reset, one consumer at a time, close, length, pickling, RNGs."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

from bridgeflow import (
    BatchData,
    ConcatData,
    DataFlow,
    DataFlowReentrantError,
    DataFromGenerator,
    DataFromList,
    JoinData,
    LengthUnknownError,
    MapData,
    ProxyDataFlow,
    RNGDataFlow,
    get_rng,
    iter_flows,
    worker_seed_scope,
)
from bridgeflow._iterables import as_dataflow
from bridgeflow.testing import check_dataflow


class Counting(DataFlow):
    """Yields [0], [1], ... [n-1]; counts reset_state() and close() calls."""

    def __init__(self, n: int = 3) -> None:
        self.n = n
        self.resets = 0
        self.closes = 0

    def reset_state(self) -> None:
        self.resets += 1

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield [i]

    def close(self) -> None:
        self.closes += 1
        super().close()


class LengthFree(DataFlow):
    def __iter__(self):
        yield from ([1], [2])


# --- reset_state ----------------------------------------------------------------------------------


def test_first_iter_resets_once():
    df = Counting()
    assert df.resets == 0
    assert list(df) == [[0], [1], [2]]
    assert df.resets == 1
    assert list(df) == [[0], [1], [2]]
    assert df.resets == 1


def test_explicit_reset_is_not_repeated_by_iter():
    df = Counting()
    df.reset_state()
    list(df)
    list(df)
    assert df.resets == 1
    df.reset_state()  # each explicit reset is one call, no more
    assert df.resets == 2


def test_proxy_reset_reaches_the_source_once():
    src = Counting()
    df = MapData(MapData(src, lambda dp: dp), lambda dp: dp)
    assert list(df) == [[0], [1], [2]]  # auto reset through the chain
    assert src.resets == 1
    df.reset_state()
    list(df)
    assert src.resets == 2


def test_multi_flow_reset_reaches_each_child_once():
    a, b = Counting(), Counting()
    df = JoinData([a, MapData(b, lambda dp: dp)])
    assert list(df) == [[0, 0], [1, 1], [2, 2]]
    assert (a.resets, b.resets) == (1, 1)


# --- one consumer at a time -----------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: Counting(), lambda: MapData(Counting(), lambda dp: dp)],
                         ids=["source", "proxy"])
def test_second_concurrent_iter_is_refused(make):
    df = make()
    it = iter(df)
    assert next(it) == [0]
    with pytest.raises(DataFlowReentrantError, match=type(df).__name__):
        iter(df)
    assert list(it) == [[1], [2]]  # the first consumer is not disturbed
    assert list(df) == [[0], [1], [2]]  # exhausted: a new iteration works


def test_two_iterators_created_before_either_starts():
    df = Counting()
    a, b = iter(df), iter(df)
    assert next(a) == [0]
    with pytest.raises(DataFlowReentrantError):
        next(b)
    assert list(a) == [[1], [2]]
    assert list(df) == [[0], [1], [2]]


def test_iteration_allowed_again_after_close_or_delete():
    df = Counting()
    it = iter(df)
    next(it)
    it.close()
    assert list(df) == [[0], [1], [2]]

    it = iter(df)
    next(it)
    del it
    gc.collect()
    assert list(df) == [[0], [1], [2]]

    never_started = iter(df)  # an iterator that never ran holds nothing
    assert list(df) == [[0], [1], [2]]
    del never_started


def test_break_releases_the_flow():
    df = MapData(Counting(5), lambda dp: dp)
    for dp in df:
        if dp == [1]:
            break
    gc.collect()
    assert len(list(df)) == 5


def test_subclass_calling_super_iter_is_not_refused():
    class Base(DataFlow):
        def __iter__(self):
            yield from ([1], [2])

    class Doubled(Base):
        def __iter__(self):
            for dp in super().__iter__():
                yield [dp[0] * 2]

    df = Doubled()
    assert list(df) == [[2], [4]]
    it = iter(df)
    next(it)
    with pytest.raises(DataFlowReentrantError):  # the subclass itself is still guarded
        iter(df)
    it.close()
    check_dataflow(Doubled())


def test_same_source_in_two_branches_is_refused():
    src = DataFromList([[1], [2]], shuffle=False)
    with pytest.raises(DataFlowReentrantError):
        list(JoinData([src, src]))


# --- close ----------------------------------------------------------------------------------------


def test_close_is_recursive_and_idempotent():
    a, b = Counting(), Counting()
    df = BatchData(MapData(JoinData([a, b]), lambda dp: dp), 1)
    list(df)
    df.close()
    assert (a.closes, b.closes) == (1, 1)
    df.close()  # a second close does no harm
    assert (a.closes, b.closes) == (2, 2)


def test_child_listed_twice_is_closed_once():
    a = Counting()
    ConcatData([a, a]).close()
    assert a.closes == 1


def test_with_closes():
    src = Counting()
    with MapData(src, lambda dp: dp) as df:
        assert list(df) == [[0], [1], [2]]
        assert src.closes == 0
    assert src.closes == 1


def test_close_tolerates_a_duck_typed_flow_without_close():
    class TensorpackStyle:  # what a tensorpack DataFlow looks like: no close()
        def reset_state(self):
            self.ready = True

        def __iter__(self):
            yield from ([1], [2])

    inner = TensorpackStyle()
    df = MapData(inner, lambda dp: [dp[0] + 1])
    assert df.ds is inner
    assert list(df) == [[2], [3]]
    assert inner.ready
    df.close()


def test_plain_iterables_are_wrapped():
    assert list(MapData([[1], [2]], lambda dp: dp)) == [[1], [2]]
    assert list(ConcatData([[[1]], ([2],)])) == [[1], [2]]
    assert isinstance(as_dataflow([[1]]), DataFlow)
    with pytest.raises(TypeError, match="MapData wraps a DataFlow or iterable, got int$"):
        MapData(3, lambda dp: dp)


def test_a_dataset_read_by_index_is_refused_saying_how_to_make_it_a_flow():
    class ByIndex:  # what a torch map-style Dataset is to Python: __len__ and __getitem__, no __iter__
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return [i * 10]

    with pytest.raises(TypeError, match=r"MapData wraps a DataFlow or iterable, got ByIndex, a dataset read by "
                                        r"index .*DataFromList\(dataset, shuffle=False\)"):
        MapData(ByIndex(), lambda dp: dp)
    assert list(MapData(DataFromList(ByIndex(), shuffle=False), lambda dp: [dp[0] + 1])) == [[1], [11], [21]]


# --- length ---------------------------------------------------------------------------------------


def test_len_of_length_free_flow():
    df = LengthFree()
    with pytest.raises(LengthUnknownError, match="LengthFree") as info:
        len(df)
    assert isinstance(info.value, TypeError)
    assert list(df) == [[1], [2]]  # list() treats it as length-free
    gen = DataFromGenerator(lambda: iter([[1]]))
    with pytest.raises(TypeError, match="DataFromGenerator"):
        len(gen)
    assert list(MapData(gen, lambda dp: dp)) == [[1]]


def test_len_of_proxy_follows_the_source():
    assert len(MapData(Counting(7), lambda dp: dp)) == 7
    with pytest.raises(LengthUnknownError):
        len(MapData(LengthFree(), lambda dp: dp))


# --- pickling -------------------------------------------------------------------------------------


def test_pickled_copy_starts_fresh():
    df = Counting()
    it = iter(df)
    next(it)
    copy = pickle.loads(pickle.dumps(df))
    resets = copy.resets
    assert list(copy) == [[0], [1], [2]]  # not refused: the original's iteration does not travel
    assert copy.resets == resets + 1  # and it resets itself on first use
    it.close()


def test_pickled_pipeline_of_builtin_flows():
    df = BatchData(DataFromList([[i] for i in range(6)], shuffle=False), 2)
    it = iter(df)
    next(it)
    copy = pickle.loads(pickle.dumps(df))
    assert [b[0].tolist() for b in copy] == [[0, 1], [2, 3], [4, 5]]
    it.close()


# --- random number generators ---------------------------------------------------------------------


def test_get_rng_reproducible_with_seed():
    a = get_rng(None, seed=5).randint(1 << 30, size=8)
    b = get_rng(None, seed=5).randint(1 << 30, size=8)
    c = get_rng(None, seed=6).randint(1 << 30, size=8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    d = get_rng().randint(1 << 30, size=8)  # OS entropy
    e = get_rng().randint(1 << 30, size=8)
    assert not np.array_equal(d, e)


def test_worker_seed_scope_gives_distinct_reproducible_streams():
    def draw(worker):
        with worker_seed_scope(worker):
            return get_rng(None, seed=1).randint(1 << 30, size=8)

    np.testing.assert_array_equal(draw(0), draw(0))
    assert not np.array_equal(draw(0), draw(1))
    outside = get_rng(None, seed=1).randint(1 << 30, size=8)
    assert not np.array_equal(outside, draw(0))
    with worker_seed_scope(3):  # scopes nest and restore
        with worker_seed_scope(4):
            pass
        np.testing.assert_array_equal(get_rng(None, seed=1).randint(1 << 30, size=8), draw(3))


def test_tensorpack_style_rng_dataflow():
    class Noise(RNGDataFlow):  # only __iter__, using self.rng as tensorpack users write it
        def __init__(self, seed=None):
            self.seed = seed

        def __iter__(self):
            for _ in range(4):
                yield [self.rng.rand()]

    a, b = list(Noise(seed=3)), list(Noise(seed=3))
    assert a == b
    assert list(Noise(seed=4)) != a
    assert len({dp[0] for dp in a}) == 4
    check_dataflow(Noise(seed=3), deterministic=False)


def test_rng_reseeded_in_worker_scope():
    df = DataFromList(list(range(50)), shuffle=True, seed=0)
    with worker_seed_scope(1):
        df.reset_state()
    w1 = list(df)
    with worker_seed_scope(2):
        df.reset_state()
    w2 = list(df)
    assert sorted(w1) == sorted(w2) == list(range(50))
    assert w1 != w2


def test_iter_flows_paths():
    src = Counting()
    df = BatchData(MapData(src, lambda dp: dp), 2)
    paths = dict(iter_flows(df))
    assert list(paths) == ["BatchData", "BatchData/MapData", "BatchData/MapData/Counting"]
    assert paths["BatchData/MapData/Counting"] is src


def test_unimplemented_iter():
    class NoIter(ProxyDataFlow):
        pass

    assert list(NoIter(Counting())) == [[0], [1], [2]]  # a proxy forwards by default
    with pytest.raises(NotImplementedError, match="Empty"):
        type("Empty", (DataFlow,), {})().__iter__()


# --- tensorpack's older protocol: get_data() and size() ------------------------------------------


class OldRange(DataFlow):
    """An old-style flow: get_data() and size(), no __iter__ or __len__."""

    def __init__(self, n: int = 4) -> None:
        self.n = n
        self.resets = 0

    def reset_state(self) -> None:
        self.resets += 1

    def get_data(self):
        for i in range(self.n):
            yield [i, i * i]

    def size(self):
        return self.n


class OldDouble(ProxyDataFlow):
    """An old-style proxy that reads its child the old way too."""

    def get_data(self):
        for dp in self.ds.get_data():
            yield [dp[0] * 2]

    def size(self):
        return self.ds.size()


class OldOffset(OldRange):
    """Extends an old-style parent through super().get_data()."""

    def get_data(self):
        for dp in super().get_data():
            yield [dp[0] + 100, dp[1]]


class OldNoise(RNGDataFlow):
    """An old-style random flow (tensorpack's RNGDataFlow idiom)."""

    def __init__(self, n: int = 6, seed: int | None = None) -> None:
        self.n, self.seed = n, seed

    def get_data(self):
        for _ in range(self.n):
            yield [int(self.rng.randint(1 << 30))]

    def size(self):
        return self.n


class NewOverOld(OldRange):
    """A new-style subclass of an old-style flow, reaching the parent both ways."""

    def __iter__(self):
        yield from super().__iter__()
        yield from self.get_data()


def test_old_style_flow_iterates_with_get_data_and_measures_with_size():
    df = OldRange(3)
    assert list(df) == [[0, 0], [1, 1], [2, 4]] and len(df) == 3 and df.size() == 3
    assert df.resets == 1  # iterated before reset_state(): reset once, like any flow
    assert list(df.get_data()) == [[0, 0], [1, 1], [2, 4]]
    assert check_dataflow(OldRange(5), deterministic=True) == [[i, i * i] for i in range(5)]
    assert list(OldDouble(OldRange(3))) == [[0], [2], [4]] and OldDouble(OldRange(3)).size() == 3
    assert list(OldOffset(2)) == [[100, 0], [101, 1]] and list(OldOffset(2).get_data()) == [[100, 0], [101, 1]]
    assert [dp[0] for dp in NewOverOld(2)] == [0, 1, 0, 1]
    assert [dp[0].tolist() for dp in BatchData(OldDouble(OldRange(4)), 2)] == [[0, 2], [4, 6]]


def test_old_style_get_data_has_the_one_consumer_guard():
    df = OldRange(3)
    it = df.get_data()
    assert next(it) == [0, 0]
    with pytest.raises(DataFlowReentrantError):
        next(iter(df))
    with pytest.raises(DataFlowReentrantError):
        next(df.get_data())
    it.close()
    assert len(list(df.get_data())) == 3


def test_old_style_random_flow_is_reproducible_and_resumable():
    from bridgeflow.testing import check_resumable

    a, b = OldNoise(seed=3), OldNoise(seed=3)
    a.reset_state()
    b.reset_state()
    assert list(a) == list(b) and list(a) != list(OldNoise(seed=4))
    assert type(a)._own_state is DataFlow._own_state  # the default state: count and skip
    check_resumable(lambda: OldNoise(8, seed=1), epochs=3)
    check_resumable(lambda: BatchData(OldDouble(OldOffset(7)), 2, remainder=True), positions=range(5))


def test_old_style_flow_goes_to_worker_processes(leak_check):
    from bridgeflow import MultiProcessMapData, MultiProcessRunner

    with MultiProcessMapData(OldDouble(OldRange(20)), 2, lambda dp: [dp[0] + 1]) as df:
        assert [dp[0] for dp in df] == [2 * i + 1 for i in range(20)]
    with MultiProcessRunner(OldNoise(5, seed=2), 4, 2) as df:
        got = [dp[0] for dp in df]
    assert len(got) == 5 and len(set(got)) == 5


def test_what_is_not_the_old_protocol_is_left_alone():
    class Both(DataFlow):  # __iter__ wins; get_data stays a method of its own
        def __iter__(self):
            yield [1]

        def get_data(self):
            return iter([[2]])

    class SizeAttribute(DataFlow):  # a size that is not a method is not a length
        size = 5

        def __iter__(self):
            yield [1]

    assert list(Both()) == [[1]] and list(Both().get_data()) == [[2]]
    with pytest.raises(LengthUnknownError):
        len(SizeAttribute())
    with pytest.raises(NotImplementedError, match="must implement __iter__"):
        list(type("Empty", (DataFlow,), {"size": lambda self: 1})())


# --- the template: public methods on the base, hooks in the subclasses -------------------------------


def test_tensorpack_names_parent_calls_reach_each_parent():
    """tensorpack's own LocallyShuffleData idiom: a reset_state that names its two parents."""

    class Shuffled(ProxyDataFlow, RNGDataFlow):
        def __init__(self, ds, seed):
            ProxyDataFlow.__init__(self, ds)
            self.seed = seed

        def reset_state(self):
            ProxyDataFlow.reset_state(self)
            RNGDataFlow.reset_state(self)
            self.ready = True

        def __iter__(self):
            dps = list(self.ds)
            self.rng.shuffle(dps)
            yield from dps

    src = Counting(6)
    df = Shuffled(src, seed=1)
    got = list(df)
    assert df.ready and src.resets >= 1 and sorted(dp[0] for dp in got) == list(range(6))
    assert got == list(Shuffled(Counting(6), seed=1))  # seeded through RNGDataFlow's reset
    check_dataflow(Shuffled(Counting(6), seed=2))


def test_super_state_dict_in_a_moved_state_dict_gets_the_header():
    class Positioned(DataFlow):
        def __init__(self):
            self.pos = 0

        def __iter__(self):
            while self.pos < 4:
                self.pos += 1
                yield [self.pos - 1]

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, state):
            self.pos = state["pos"]

    class Recorded(Positioned):
        calls = 0

        def state_dict(self):
            type(self).calls += 1
            return dict(super().state_dict(), seen=True)

    df = Recorded()
    it = iter(df)
    next(it)
    state = df.state_dict()
    check = state.pop("check")  # the header: class, version and the checksum of the fields
    assert state == {"pos": 1, "seen": True, "class": "Recorded", "version": 1} and Recorded.calls == 1
    state["check"] = check
    other = Recorded()
    other.load_state_dict(state)
    assert other.state_dict()["pos"] == 1  # a loaded state not begun from yet is the state
    assert list(other) == [[1], [2], [3]]
    with pytest.raises(ValueError, match="saved by a Recorded, this flow is a Positioned"):
        Positioned().load_state_dict(state)


def test_a_moved_method_iterating_a_flow_of_its_own_class_is_not_a_super_call():
    class Plus(ProxyDataFlow):
        def __iter__(self):
            for dp in self.ds:  # self.ds is a Plus too: its own public __iter__, guarded
                yield [dp[0] + 1]

    inner = Plus(Counting(3))
    df = Plus(inner)
    it = iter(df)
    assert next(it) == [2]
    with pytest.raises(DataFlowReentrantError):
        iter(inner).__next__()
    it.close()
    assert list(df) == [[2], [3], [4]]


def test_a_class_may_not_write_a_public_method_and_its_hook():
    with pytest.raises(TypeError, match="defines both __iter__ and _iter_epoch"):
        class Both(DataFlow):
            def __iter__(self):
                yield [1]

            def _iter_epoch(self):
                yield [2]


def test_bridgeflow_flows_fill_hooks_and_are_never_renamed():
    import importlib
    import pkgutil

    import bridgeflow
    from bridgeflow import _tensorpack_style as tensorpack_style

    for info in pkgutil.walk_packages(bridgeflow.__path__, "bridgeflow."):
        if not info.name.endswith("__main__"):
            try:
                importlib.import_module(info.name)
            except bridgeflow.MissingDependencyError:
                # an adapter whose framework is not installed: installed from a wheel, bridgeflow.adapters.* are
                # subpackages found here (an editable install maps them from adapters/, outside this walk)
                assert info.name.startswith("bridgeflow.adapters."), info.name
    classes, renamed = list(bridgeflow.DataFlow.__subclasses__()), []
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        moved = "_tensorpack_style" in cls.__dict__  # adopt() moved a method: a Public stands in its place
        assert moved == any(isinstance(cls.__dict__.get(name), tensorpack_style.Public)
                            for name in tensorpack_style.MOVES), cls
        if moved and cls.__module__.startswith("bridgeflow."):
            renamed.append(cls.__qualname__)
    assert not renamed


def test_a_read_ahead_answers_state_dict_until_the_next_iter():
    class Reader:
        def delivered_state(self, source):
            return {"delivered": type(source).__name__}

    df = DataFromList([[i] for i in range(3)], shuffle=False)
    reader = Reader()
    it = iter(df)
    next(it)
    df.attach_read_ahead(reader)
    assert df.state_dict() == {"delivered": "DataFromList"}
    it.close()
    iter(df)  # a new reader: the last one's view is over
    assert df.state_dict()["pos"] == 0
    df.attach_read_ahead(reader)
    del reader
    gc.collect()
    assert "pos" in df.state_dict()  # held weakly


def test_a_decorated_tensorpack_method_reaches_its_parent():
    import functools

    calls = []

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(self, *args):
            calls.append(fn.__name__)
            return fn(self, *args)
        return wrapper

    class Seeded(RNGDataFlow):
        seed = 5

        @logged
        def reset_state(self):
            super().reset_state()  # from inside the wrapped function: RNGDataFlow's reset
            self.first = int(self.rng.randint(1 << 30))

        def __iter__(self):
            yield [self.first]

    assert list(Seeded()) == list(Seeded()) and calls == ["reset_state", "reset_state"]


def test_a_moved_method_calling_another_public_method_gets_this_flows_own():
    class Restarting(DataFlow):
        resets = 0

        def reset_state(self):
            type(self).resets += 1

        def __iter__(self):
            self.reset_state()  # its own reset_state, not a parent's
            yield [type(self).resets]

    df = Restarting()
    assert list(df) == [[2]] and list(df) == [[3]]


def test_a_parent_reached_from_a_helper_of_a_moved_method_is_the_parents_part():
    """Which part a public method means follows from where Python's lookup found it, not from the calling
    function: a helper that a moved reset_state calls reaches the parents' part too (a caller's code told it
    apart before, and the helper's call ran the whole reset_state again, recursing)."""

    class Seeded(RNGDataFlow):
        seed = 7

        def _parents(self):
            RNGDataFlow.reset_state(self)  # seeds self.rng

        def _parents_by_super(self):
            super().reset_state()

        def reset_state(self):
            self._parents() if type(self).by_name else self._parents_by_super()
            self.first = int(self.rng.randint(1 << 30))

        def __iter__(self):
            yield [self.first]

        by_name = True

    class Reference(RNGDataFlow):
        seed = 7

        def __iter__(self):
            yield [int(self.rng.randint(1 << 30))]

    expected = list(Reference())[0][0]
    assert list(Seeded()) == [[expected]]
    Seeded.by_name = False
    assert list(Seeded()) == [[expected]]
