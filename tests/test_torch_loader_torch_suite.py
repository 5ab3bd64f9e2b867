"""Differences found by running PyTorch's own test/test_dataloader.py with bridgeflow's DataLoader substituted,
each kept here as a test against torch's loader: being a torch DataLoader (class, generics, re-creation),
DataPipes (shuffle settings, per-worker sharding), nested tensors, multiprocessing objects under spawn,
torch's wording for dead workers and too many workers, and several iterators of one loader.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import multiprocessing as mp
import os
import warnings

import numpy as np
import pytest
from test_torch_loader import ArrayDataset, assert_same, outcomes

import bridgeflow
from conftest import PROMPTLY_S, need

need("torch")

import torch
import torch.utils.data as tud
from torch.utils.data.datapipes.iter import IterableWrapper

from bridgeflow.adapters.torch import DataLoader

LOADERS = (tud.DataLoader, DataLoader)


def both_outcomes(make, epochs=1, seed=0):
    results = []
    for cls in LOADERS:
        torch.manual_seed(seed)
        results.append(outcomes(make(cls), epochs))
    return results


# --- being a torch DataLoader ----------------------------------------------------------------------

def test_is_a_torch_dataloader_and_generic():
    loader = DataLoader(ArrayDataset(4), batch_size=2)
    assert isinstance(loader, tud.DataLoader)
    alias = DataLoader[int]  # torch's loader is Generic; annotations such as DataLoader[Tensor] must work
    assert alias.__origin__ is DataLoader
    assert isinstance(alias(ArrayDataset(4)), DataLoader)


def test_iterators_are_torch_iterators():
    """Lightning's CombinedLoader and others recognise DataLoader iterators by torch's base class."""
    base = tud.dataloader._BaseDataLoaderIter
    assert isinstance(iter(DataLoader(ArrayDataset(4))), base)
    with DataLoader(ArrayDataset(4), num_workers=1) as loader:
        it = iter(loader)
        assert isinstance(it, base)
        del it


def test_recreated_from_its_attributes_with_a_new_sampler(leak_check):
    """What Lightning does under DDP: read the constructor's arguments back from the attributes, inject a
    DistributedSampler, and construct the same class again; the result must still be bridgeflow's."""
    import inspect

    loader = DataLoader(ArrayDataset(12), batch_size=3, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(0))
    params = inspect.signature(type(loader).__init__).parameters
    kwargs = {name: getattr(loader, name) for name in params if name != "self" and hasattr(loader, name)}
    kwargs.update(sampler=tud.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False),
                  shuffle=False, batch_sampler=None)
    again = type(loader)(**kwargs)
    assert type(again) is DataLoader and again.num_workers == 2 and again.batch_size == 3
    assert [int(x) for b in again for x in b[1]] == [1, 3, 5, 7, 9, 11]


def test_a_stream_dataflow_refuses_an_injected_sampler_saying_what_to_do():
    """Lightning under DDP re-creates loaders with a DistributedSampler; a length-free DataFlow cannot be
    indexed (a random-access one takes it: test_torch_flows)."""
    flow = bridgeflow.FilterData(bridgeflow.DataFromList([[i] for i in range(8)], shuffle=False), bool)
    loader = DataLoader(flow, batch_size=2)
    again = type(loader)(flow, batch_size=2, sampler=loader.sampler)  # its own placeholder sampler: fine
    assert [b[0].tolist() for b in again] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="shard the flow per rank.*use_distributed_sampler=False"):
        DataLoader(flow, batch_size=2, sampler=tud.DistributedSampler(range(8), num_replicas=2, rank=0))
    flow.close()


def test_worker_count_warning_has_torchs_words():
    too_many = (os.cpu_count() or 1) + 3
    messages = []
    for cls in LOADERS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(ArrayDataset(4), num_workers=too_many)
        messages.append([str(w.message) for w in caught])
    assert messages[0] == messages[1]
    assert "excessive worker creation might get DataLoader running slow or even freeze" in messages[1][0]


# --- DataPipes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_sharding_filter_gives_each_item_once(num_workers, leak_check):
    """Without torch's per-worker sharding every worker yields the whole pipe: duplicated data."""
    ref, got = both_outcomes(lambda cls: cls(IterableWrapper(range(6)).sharding_filter(), num_workers=num_workers))
    assert_same(ref, got)
    assert sorted(int(x) for x in got[0]) == list(range(6))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_datapipe_shuffle_setting_like_torch(num_workers, leak_check):
    def make(cls):
        pipe = IterableWrapper(range(12)).shuffle().sharding_filter()
        return cls(pipe, batch_size=3, shuffle=True, num_workers=num_workers)

    ref, got = both_outcomes(make, epochs=2, seed=3)
    assert_same(ref, got)
    order = [int(x) for b in got[0] for x in b]
    assert sorted(order) == list(range(12)) and order != list(range(12))
    ref, got = both_outcomes(lambda cls: cls(IterableWrapper(range(12)).shuffle(), shuffle=False))
    assert_same(ref, got)
    assert [int(x) for x in got[0]] == list(range(12))  # shuffle=False turns the pipe's shuffle off


def test_datapipe_persistent_workers_reshuffle_each_epoch_like_torch(leak_check):
    def make(cls):
        pipe = IterableWrapper(range(8)).shuffle().sharding_filter()
        return cls(pipe, batch_size=2, shuffle=True, num_workers=2, persistent_workers=True)

    ref, got = both_outcomes(make, epochs=3, seed=5)
    assert_same(ref, got)


# --- values that do not fit the shared-memory path ---------------------------------------------------

class NestedDataset(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return torch.nested.nested_tensor([torch.arange(i + 1.0), torch.ones(2)])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_from_workers(leak_check):
    ref, got = both_outcomes(lambda cls: cls(NestedDataset(), batch_size=None, num_workers=2))
    assert len(got[0]) == 4
    for a, b in zip(ref[0], got[0]):
        assert b.is_nested and all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_through_a_custom_collate(leak_check):
    got = list(DataLoader(NestedDataset(), batch_size=2, num_workers=2, collate_fn=list))
    assert [len(b) for b in got] == [2, 2] and all(t.is_nested for b in got for t in b)


class SharedCounterDataset(tud.Dataset):
    """Holds multiprocessing objects, which pickle only while a worker process is being launched."""

    def __init__(self, ctx) -> None:
        self.offset = ctx.Value("i", 100)
        self.lock = ctx.Lock()
        self.started = ctx.Event()

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        self.started.set()
        with self.lock:
            return i + self.offset.value


@pytest.fixture
def tracker_running():
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_dataset_with_multiprocessing_objects_under_spawn(method, tracker_running, leak_check):
    if method not in mp.get_all_start_methods():
        pytest.skip(f"{method} is not available on this platform")
    ds = SharedCounterDataset(mp.get_context(method))
    got = [int(b) for b in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=method)]
    assert got == [100, 101, 102, 103, 104, 105] and ds.started.is_set()


# --- dead workers and destructors --------------------------------------------------------------------

class SegfaultDataset(tud.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        if i == 3:
            faulthandler.disable()  # pytest's handler would print the worker's stack; the crash is intended
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return i


def test_segfaulted_worker_error_has_torchs_words(leak_check):
    loader = DataLoader(SegfaultDataset(), num_workers=2)
    with pytest.raises(RuntimeError) as info:
        list(loader)
    message = str(info.value)
    assert "is killed by signal: Segmentation fault" in message  # what users and tools search for
    assert isinstance(info.value, bridgeflow.WorkerError) and info.value.worker == 1
    assert "SIGSEGV" in message and str(info.value.pid) in message
    del info, loader


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("iterable", [False, True])
def test_iterator_workers_are_process_handles_that_exit_cleanly(iterable, persistent, leak_check):
    """``it._workers``, which torch's own tests and some user code read for the workers' pids or to wait
    for them: multiprocessing Process handles, alive while iterating, exited with code 0 once the iterator
    and the loader are dropped (the harness's only differences left were reads of it)."""
    from test_torch_loader import RangeIterable

    dataset = RangeIterable(0, 12) if iterable else ArrayDataset(12)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=persistent)
    it = iter(loader)
    next(it)
    workers = it._workers
    assert len(workers) == 2 and all(isinstance(w, mp.process.BaseProcess) for w in workers)
    assert all(w.is_alive() for w in workers) and len({w.pid for w in workers}) == 2
    del it, loader
    gc.collect()
    for w in workers:
        w.join(PROMPTLY_S)
        assert not w.is_alive() and w.exitcode == 0, (w.pid, w.exitcode)


def test_failed_iterator_start_prints_nothing_from_a_destructor(capfd):
    """An iterator whose construction failed is collected without an error printed (the previous
    the in-process iterator's __del__ printed an AttributeError about '_fetcher')."""

    class BadIterable(tud.IterableDataset):
        def __iter__(self):
            raise OSError("shard list unreadable")

    for kwargs in (dict(), dict(timeout=3)):
        with pytest.raises((OSError, ValueError)):
            next(iter(DataLoader(BadIterable(), **kwargs)))
    gc.collect()
    assert "Exception ignored" not in capfd.readouterr().err


# --- several iterators of one loader -----------------------------------------------------------------

def _flow(n: int = 7):
    return bridgeflow.DataFromList([[np.int64(i)] for i in range(n)], shuffle=False)


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_new_iterator_over_a_dataflow_abandons_the_held_one(num_workers, persistent, leak_check):
    """Lightning starts each epoch with iter() while the previous iterator may still be held (a sized
    epoch ends without StopIteration): a DataFlow read as a stream has one reader, so the old epoch ends
    there (a random-access one is read by index, its iterators side by side as a map-style dataset's)."""
    flow = bridgeflow.FilterData(_flow(), bool)
    with DataLoader(flow, batch_size=3, num_workers=num_workers, persistent_workers=persistent) as loader:
        first = iter(loader)
        assert next(first)[0].tolist() == [0, 1, 2]
        second = iter(loader)
        assert [b[0].tolist() for b in second] == [[0, 1, 2], [3, 4, 5], [6]]
        if not persistent:
            assert list(first) == []  # abandoned: ended, not reading the flow any more
        third = iter(loader)
        assert next(third)[0].tolist() == [0, 1, 2]
        del first, second, third
    flow.close()


def test_two_iterators_of_a_map_dataset_run_side_by_side_like_torch(leak_check):
    results = []
    for cls in LOADERS:
        loader = cls(ArrayDataset(8), batch_size=2, num_workers=2)
        a, b = iter(loader), iter(loader)
        results.append([(int(x[1][0]), int(y[1][0])) for x, y in zip(a, b)])
        del a, b, loader
    assert results[0] == results[1] == [(0, 0), (2, 2), (4, 4), (6, 6)]
