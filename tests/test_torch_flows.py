"""A DataFlow as the DataLoader's dataset (adapters/torch/_flows.py): a random-access flow is read by index
as a map-style dataset, each worker reading and mapping its own indices, with samplers, shuffle,
DistributedSampler and resume as any Dataset; a length-free one is read as one stream and says so once."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from test_torch_state import check_resume, plain

import bridgeflow
from conftest import need

need("torch")

import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader, DoubleShuffleWarning, UnsplitFlowWarning

N = 11


def _items(n=N):
    return [[np.full((3,), i, np.int64), i] for i in range(n)]


def _times_ten(dp):
    return [dp[0] * 10, dp[1]]


def _where(dp):
    """The datapoint with the pid of the process that mapped it."""
    return [dp[1], os.getpid()]


def _add_one(dp):
    return [dp[0], dp[1] + 1]


def _drop_fives(dp):
    return None if dp[1] % 5 == 0 else dp


class Listed(tud.Dataset):
    """torch's side: the same datapoints, mapped, in a plain Dataset."""

    def __init__(self, fn=_times_ten):
        self.items = [fn(dp) for dp in _items()]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _mapped(shuffle=False, fn=_times_ten, seed=None):
    return bridgeflow.MapData(bridgeflow.DataFromList(_items(), shuffle=shuffle, seed=seed), fn)


def _same(a, b):
    assert [plain(x) for x in a] == [plain(x) for x in b]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampling", ["sequential", "shuffle", "distributed"])
def test_a_random_access_flow_reads_as_torch_reads_the_same_dataset(sampling, num_workers, leak_check):
    def kwargs(ds):
        return {"sequential": dict(batch_size=3),
                "shuffle": dict(batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(4)),
                "distributed": dict(batch_size=2, sampler=tud.DistributedSampler(ds, 2, 1, seed=5))}[sampling]

    want = list(tud.DataLoader(Listed(), num_workers=num_workers, **kwargs(Listed())))
    flow = _mapped()
    with DataLoader(flow, num_workers=num_workers, **kwargs(flow)) as loader:
        _same(list(loader), want)
    flow.close()


def test_each_worker_reads_and_maps_its_own_indices(leak_check):
    flow = _mapped(fn=_where)
    with DataLoader(flow, batch_size=2, num_workers=2) as loader:
        pids = {int(p) for _, p in loader for p in p}
        workers = {p.pid for p in loader._iterator._source.workers} if loader._iterator else None
    assert len(pids) == 2 and os.getpid() not in pids
    assert workers is None or pids == workers
    flow.close()


def test_a_flow_that_shuffles_itself_is_read_in_a_random_order_from_the_loaders_generator(leak_check):
    orders = []
    for _ in range(2):
        flow = _mapped(shuffle=True, seed=1)
        with DataLoader(flow, batch_size=None, generator=torch.Generator().manual_seed(7)) as loader:
            orders.append([int(dp[1]) for dp in loader])
        flow.close()
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(N)) and orders[0] != list(range(N))
    DataLoader(_mapped(shuffle=True, seed=1), shuffle=False)  # an explicit order: fine


def test_shuffle_true_on_a_flow_that_shuffles_itself_runs_as_torchs_loader_saying_what_to_pass(leak_check, tmp_path):
    """What torch's loader does with the same code: the order its shuffle=True draws (the flow's own is not used),
    said once with what to pass; the README's LMDB case too."""
    flow = _mapped(shuffle=True, seed=1)
    with pytest.warns(DoubleShuffleWarning, match=r"shuffles itself \(MapData/DataFromList has shuffle=True\).*"
                                                  r"LMDBSerializer.load\(path, shuffle=False\)") as seen:
        loader = DataLoader(flow, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(7))
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", DoubleShuffleWarning)  # said at construction, not again per epoch
        got = [[int(dp[1]) for dp in loader] for _ in range(2)]
    torch_order = [int(dp[1]) for dp in tud.DataLoader(Listed(), batch_size=None, shuffle=True,
                                                       generator=torch.Generator().manual_seed(7))]
    assert got[0] == torch_order and sorted(got[1]) == list(range(N)) and got[0] != got[1]
    loader.close()
    flow.close()

    path = str(tmp_path / "d.lmdb")
    bridgeflow.LMDBSerializer.save([[np.full(3, i, np.uint8), i] for i in range(10)], path, progress=False)
    with pytest.warns(DoubleShuffleWarning):
        lmdb_loader = DataLoader(bridgeflow.MapData(bridgeflow.LMDBSerializer.load(path), _add_one), batch_size=4,
                                 shuffle=True, num_workers=2)
    with lmdb_loader:
        labels = sorted(int(x) for b in lmdb_loader for x in b[1])
    assert labels == list(range(1, 11))
    lmdb_loader.dataset.close()


@pytest.mark.parametrize("workers", [dict(num_workers=0), dict(num_workers=2),
                                     dict(num_workers=2, persistent_workers=True)],
                         ids=["0-workers", "2-workers", "persistent"])
def test_a_random_access_flow_resumes_exactly(workers, leak_check):
    check_resume(lambda: DataLoader(_mapped(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3),
                                    **workers), ks=[1, 3, -1], epochs=2)


def test_a_dropped_datapoint_makes_its_batch_shorter(leak_check):
    flow = _mapped(fn=_drop_fives)
    with DataLoader(flow, batch_size=4, num_workers=2) as loader:
        got = [b[1].tolist() for b in loader]
    assert got == [[1, 2, 3], [4, 6, 7], [8, 9]]
    flow.close()


def test_an_lmdb_file_is_read_by_index_in_the_workers(tmp_path, leak_check):
    path = str(tmp_path / "items.lmdb")
    bridgeflow.LMDBSerializer.save(bridgeflow.DataFromList(_items(40), shuffle=False), path, progress=False)
    flow = bridgeflow.MapData(bridgeflow.LMDBSerializer.load(path, seed=0), _where)
    with DataLoader(flow, batch_size=5, num_workers=2) as loader:
        for _ in range(2):
            got = [(int(i), int(p)) for b in loader for i, p in zip(*b)]
            assert sorted(i for i, _ in got) == list(range(40))  # every datapoint once, shuffled
            assert [i for i, _ in got] != list(range(40)) and os.getpid() not in {p for _, p in got}
    flow.close()


def test_an_lmdb_reader_given_as_the_dataset_reads_each_batch_at_once(tmp_path, leak_check, monkeypatch):
    """The loader asks a reader with ``__getitems__`` (LMDBDataset) for a batch's datapoints in one call, and
    gets what torch's loader gets from the same reader."""
    from bridgeflow.serialize._lmdb_format import LMDBDataset

    path = str(tmp_path / "items.lmdb")
    bridgeflow.LMDBSerializer.save(bridgeflow.DataFromList(_items(40), shuffle=False), path, progress=False)
    calls = []
    batched = LMDBDataset.__getitems__
    monkeypatch.setattr(LMDBDataset, "__getitems__", lambda self, idx: calls.append(len(idx)) or batched(self, idx))
    with bridgeflow.LMDBSerializer.load(path, shuffle=False) as ds:
        ours = [b for b in DataLoader(ds, batch_size=8, num_workers=0)]
        theirs = [b for b in tud.DataLoader(ds, batch_size=8, num_workers=0)]
    assert calls == [8] * 10  # five batches each, one call a batch
    assert len(ours) == len(theirs) == 5
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class Noisy(bridgeflow.RNGDataFlow):
    """A random-access flow drawing from its generator: reset in each worker under the worker's seed."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return [i, int(self.rng.randint(1 << 30))]

    def __iter__(self):
        return (self[i] for i in range(8))


def test_random_flows_draw_other_numbers_in_each_worker(leak_check):
    with DataLoader(Noisy(), batch_size=1, num_workers=2) as loader:
        draws = [int(b[1]) for b in loader]
    assert len(set(draws)) == 8  # worker 0's stream is not worker 1's


# --- length-free flows -------------------------------------------------------------------------------

def _keep_odd(dp):
    return dp[1] % 2 == 1


def _splittable(fn=_times_ten, shuffle=True):
    """Length-free (a filter), over a random-access source: split across the workers."""
    source = bridgeflow.DataFromList(_items(40), shuffle=shuffle, seed=2)
    return bridgeflow.MapData(bridgeflow.FilterData(source, _keep_odd), fn)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_splittable_flow_is_read_in_the_workers_every_datapoint_once_per_epoch(persistent, shuffle, leak_check):
    flow = _splittable(_where, shuffle)
    odd = list(range(1, 40, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsplitFlowWarning)
        with DataLoader(flow, batch_size=4, num_workers=2, persistent_workers=persistent) as loader:
            epochs = [[(int(i), int(p)) for b in loader for i, p in zip(*b)] for _ in range(3)]
    for epoch in epochs:
        assert sorted(i for i, _ in epoch) == odd
        assert len({p for _, p in epoch}) == 2 and os.getpid() not in {p for _, p in epoch}
    orders = [[i for i, _ in epoch] for epoch in epochs]
    assert orders[0] != orders[1] != orders[2] if shuffle else orders[0] == orders[1] == orders[2]
    flow.close()


@pytest.mark.parametrize("workers", [dict(num_workers=0), dict(num_workers=2),
                                     dict(num_workers=2, persistent_workers=True)],
                         ids=["0-workers", "2-workers", "persistent"])
def test_a_split_flow_resumes_exactly(workers, leak_check):
    check_resume(lambda: DataLoader(_splittable(), batch_size=3, **workers), ks=[1, 4, -1], epochs=2)


def _stream():
    return bridgeflow.FilterData(bridgeflow.DataFromGenerator(lambda: iter(_items())), lambda dp: True)


def test_a_stream_read_with_workers_says_so_once_and_gives_every_datapoint_each_epoch(leak_check):
    flow = _stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DataLoader(flow, batch_size=4, num_workers=2) as loader:
            epochs = [[int(i) for b in loader for i in b[1]] for _ in range(3)]
    told = [w for w in caught if issubclass(w.category, UnsplitFlowWarning)]
    assert len(told) == 1 and "FilterData/DataFromGenerator" in str(told[0].message)
    assert epochs == [list(range(N))] * 3
    flow.close()


@pytest.mark.parametrize("case", ["no workers", "a parallel stage", "random access"])
def test_no_warning_where_nothing_is_lost(case, leak_check):
    flow = {"no workers": _stream, "random access": _mapped,
            "a parallel stage": lambda: bridgeflow.MultiThreadMapData(_stream(), 2, _times_ten)}[case]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsplitFlowWarning)
        with DataLoader(flow, batch_size=4, num_workers=0 if case == "no workers" else 2) as loader:
            assert sorted(int(i) for b in loader for i in b[1]) == list(range(N))
    flow.close()


def test_on_one_of_several_ranks_a_distributed_sampler_shards_a_random_access_flow(monkeypatch, leak_check):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    flow = _mapped()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler = tud.DistributedSampler(flow, 2, 1, shuffle=False)
        ids = [int(i) for b in DataLoader(flow, batch_size=2, sampler=sampler) for i in b[1]]
        told = [w for w in caught if issubclass(w.category, bridgeflow.UnshardedWarning)]
        assert ids == list(range(1, N, 2)) + [0] and not told  # torch's shard of rank 1, padded
        list(DataLoader(flow, batch_size=2))
        told = [w for w in caught if issubclass(w.category, bridgeflow.UnshardedWarning)]
        assert len(told) == 1 and "MapData/DataFromList" in str(told[0].message)
    flow.close()


def test_torchs_own_loader_over_a_length_free_flow_names_bridgeflows_loader():
    flow = bridgeflow.MapData(bridgeflow.DataFromGenerator(lambda: ([i] for i in range(4))), lambda dp: dp)
    with pytest.raises(TypeError, match=r"DataFromGenerator has no known length; pass size= to give one; "
                                        r"torch.utils.data.DataLoader reads a dataset by index .* "
                                        r"bridgeflow.adapters.torch.DataLoader"):
        list(tud.DataLoader(flow, batch_size=2))
    with pytest.raises(TypeError, match=r"pass size= to give one$"):
        len(flow)  # asked by anyone else: no word of torch
    assert [[t.tolist() for t in b] for b in DataLoader(flow, batch_size=2)] == [[[0, 1]], [[2, 3]]]
