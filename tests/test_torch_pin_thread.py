"""DataLoader(pin_memory=True) with workers: a background thread reads ahead and pins (torch's pin thread),
while ``state_dict()`` counts only the batches handed to the user.

Pinned memory is stood for by ``FakePinnedMemory`` (``loader._bf.pin_backend``), which also makes pinning
active on this CPU-only machine; what a pin thread changes (who reads the pool, when the record moves, how
the iterator stops) is all real: real worker processes, real DataFlows, real resumes.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

import bridgeflow
from bridgeflow._errors import WorkerError
from conftest import PROMPTLY_S, need, wait_for

need("torch")

import torch
import torch.utils.data as tud
from test_torch_state import CountingFlow, Failing, Tagged, UnevenStream, _pipeline, check_resume, plain
from torch_backends import FakePinnedMemory

from bridgeflow.adapters.torch import DataLoader

PIN_THREAD = "bf-pin-memory"


def pinned_loader(dataset, backend=None, **kwargs):
    loader = DataLoader(dataset, pin_memory=True, **kwargs)
    loader._bf.pin_backend = backend if backend is not None else FakePinnedMemory()
    return loader


def pin_threads():
    return [t for t in threading.enumerate() if t.name == PIN_THREAD]


def tensors(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in tensors(b)]
    if isinstance(batch, dict):
        return [t for b in batch.values() for t in tensors(b)]
    return []


class Images(tud.Dataset):
    """Samples large enough to travel through shared-memory slabs (256 KiB per batch of 4)."""

    def __init__(self, n=24):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full((16, 1024), i, np.float32), "y": i}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pinned_batches_equal_unpinned_ones_in_order(num_workers, leak_check):
    backend = FakePinnedMemory()
    ref = [plain([b["x"], b["y"]]) for b in DataLoader(Images(), batch_size=4, num_workers=num_workers)]
    got = list(pinned_loader(Images(), backend, batch_size=4, num_workers=num_workers))
    assert [plain([b["x"], b["y"]]) for b in got] == ref
    assert all(backend.is_pinned(t) for b in got for t in tensors(b))
    # torch pins in a background thread with workers, in the consumer's thread without
    assert backend.threads == ({PIN_THREAD} if num_workers else {threading.current_thread().name})


def test_the_state_counts_only_batches_handed_out_while_the_thread_reads_ahead(leak_check):
    backend = FakePinnedMemory()
    with pinned_loader(Tagged(40), backend, batch_size=2, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        assert wait_for(lambda: backend.allocations >= 3)  # the thread has pinned batches not handed out
        assert loader.state_dict()["yielded"] == 1
        next(it)
        assert loader.state_dict()["yielded"] == 2
        del it


class RecordingSampler(tud.Sampler):
    """Sequential indices; records the thread of every draw."""

    def __init__(self, n):
        self.n, self.draws = n, []

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            self.draws.append(threading.current_thread().name)
            yield i


def test_the_sampler_is_read_as_far_as_without_the_thread_and_in_the_consumers_thread(leak_check):
    """torch sends the task replacing a batch when that batch is handed out: at most prefetch_factor *
    num_workers batches in flight, pinned or not. So a reading thread draws no index earlier than torch
    would, and an epoch left early has drawn exactly as many (later epochs' shuffles do not depend on how
    far a thread happened to run). Each count is read once the thread has pinned every batch in flight
    (handed out or not): as far as it can read ahead, and past the point where a thread that sent tasks
    itself would have drawn for them."""
    drawn = {}
    for pinned in (False, True):
        sampler = RecordingSampler(40)
        backend = FakePinnedMemory()
        kwargs = dict(batch_size=2, num_workers=2, sampler=sampler, prefetch_factor=2)
        loader = pinned_loader(Tagged(40), backend, **kwargs) if pinned else DataLoader(Tagged(40), **kwargs)
        it = iter(loader)
        counts = []
        for k in range(5):
            batch = next(it)
            if pinned:  # k + 1 batches handed out, 2 workers x prefetch_factor 2 in flight behind them
                want = len(tensors(batch)) * (k + 1 + 4)  # pinned tensors
                assert wait_for(lambda b=backend, want=want: b.allocations >= want)
            counts.append(len(sampler.draws))
        drawn[pinned] = counts
        assert set(sampler.draws) == {threading.current_thread().name}
        del it
        loader.close()
    assert drawn[True] == drawn[False] == [2 * (k + 1 + 4) for k in range(5)]


# --- resuming: a state taken at every point of an epoch ------------------------------------------------

RESUMED = {
    "map-shuffle": lambda: dict(dataset=Tagged(), batch_size=3, shuffle=True,
                                generator=torch.Generator().manual_seed(3)),
    "map-persistent": lambda: dict(dataset=Tagged(), batch_size=3, shuffle=True, persistent_workers=True),
    "iterable-stateful": lambda: dict(dataset=UnevenStream(), batch_size=2),
    "dataflow": lambda: dict(dataset=CountingFlow(), batch_size=3),
    "dataflow-persistent": lambda: dict(dataset=CountingFlow(), batch_size=3, persistent_workers=True),
}


@pytest.mark.parametrize("case", list(RESUMED))
def test_a_state_taken_anywhere_in_an_epoch_resumes_exactly(case, leak_check):
    def make():
        return pinned_loader(num_workers=2, **RESUMED[case]())

    per_epoch = len(list(make()))
    assert per_epoch >= 4
    # every point of the first epoch, its end, and the second epoch's first and last batches
    check_resume(make, ks=[*range(per_epoch + 2), -1], epochs=2)


@pytest.mark.parametrize("parallel", [False, True], ids=["list", "process-map"])
def test_bridgeflow_pipelines_resume_through_a_pinning_loader(parallel, leak_check):
    check_resume(lambda: pinned_loader(_pipeline(parallel), batch_size=3, num_workers=2), ks=[0, 1, 3, 4, -1])


class ThreadRecordingFlow(CountingFlow):
    """Records the thread of every state_dict() call and whether the test was inside an epoch then."""

    calls: list
    inside = False

    def state_dict(self):
        self.calls.append((threading.current_thread().name, type(self).inside))
        return super().state_dict()


def test_the_flow_is_read_and_asked_only_in_the_consumers_thread(leak_check):
    flow = ThreadRecordingFlow(n=12)
    flow.calls = []
    with pinned_loader(flow, batch_size=3, num_workers=2) as loader:
        it = iter(loader)
        ThreadRecordingFlow.inside = True
        states = []
        for _ in it:
            states.append(loader.state_dict()["flow"])
        ThreadRecordingFlow.inside = False
        final = loader.state_dict()
        del it
    inside = {name for name, during in flow.calls if during}
    assert inside == {threading.current_thread().name}  # the pin thread never touches the flow
    assert [s["pos"] for s in states[:-1]] == [3, 6, 9] and final["finished"] and final["flow"]["epoch"] == 1


@pytest.mark.parametrize("persistent", [False, True])
def test_a_flow_that_cannot_resume_still_says_why_and_ends_its_epoch(persistent, leak_check):
    flow = bridgeflow.DataFromGenerator(iter([[np.int64(i)] for i in range(7)]))
    with pinned_loader(flow, batch_size=3, num_workers=2, persistent_workers=persistent) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(NotImplementedError, match="generator function"):
            loader.state_dict()
        assert [len(b[0]) for b in it] == [3, 1]
        assert loader.state_dict()["finished"] is True
        del it
    flow.close()


# --- errors and endings ----------------------------------------------------------------------------------

def test_errors_arrive_in_order_and_count_as_delivered(leak_check):
    def take(it, n):
        out = []
        for _ in range(n):
            try:
                out.append(plain(next(it))[0])  # the sample indices (the worker seeds differ per loader)
            except KeyError as exc:
                out.append(f"error: {exc.args[0]}")
        return out

    ref = take(iter(DataLoader(Failing(), batch_size=2, num_workers=2)), 6)
    assert ref == [[0, 1], [2, 3], "error: sample 4 is corrupt", [6, 7], [8, 9], [10]]
    loader = pinned_loader(Failing(), batch_size=2, num_workers=2)
    it = iter(loader)
    first = take(it, 3)
    assert first == ref[:3] and first[2] == "error: sample 4 is corrupt"
    state = loader.state_dict()
    assert state["yielded"] == 3
    rest = [plain(b)[0] for b in it]
    assert rest == ref[3:]
    del it
    loader.close()
    again = pinned_loader(Failing(), batch_size=2, num_workers=2)
    again.load_state_dict(state)
    assert [plain(b)[0] for b in again] == rest
    again.close()


class DiesAt(tud.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 13:
            os._exit(7)
        return i


def test_a_dead_worker_reaches_the_user_once_and_leaves_nothing(leak_check):
    loader = pinned_loader(DiesAt(), batch_size=2, num_workers=2)
    it = iter(loader)
    got, errors = [], []
    for _ in range(30):
        try:
            got.append(next(it).tolist())
        except StopIteration:
            break
        except WorkerError as exc:
            errors.append(exc)
    assert len(errors) == 1 and "exited unexpectedly" in str(errors[0])
    assert got == [[2 * i, 2 * i + 1] for i in range(len(got))] and len(got) <= 6
    assert wait_for(lambda: not pin_threads())
    del it, errors


class Slow(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i >= 2:
            time.sleep(120)  # stuck, as far as the tests can tell
        return i


def test_a_timeout_reaches_the_user_and_stops_the_thread(leak_check):
    # 3 s: the timeout bounds the first batch too, the workers' start-up with it
    loader = pinned_loader(Slow(), batch_size=2, num_workers=2, timeout=3)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="DataLoader timed out after 3 seconds"):
        next(it)
    assert time.monotonic() - started < PROMPTLY_S  # not the worker's 120 s
    with pytest.raises(StopIteration):
        next(it)
    del it


@pytest.mark.parametrize("how", ["drop", "close", "cycle"])
def test_stopping_early_stops_the_thread_even_while_a_worker_is_stuck(how, leak_check):
    loader = pinned_loader(Slow(), batch_size=2, num_workers=2)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    assert pin_threads()  # now waiting for a batch that takes 120 s
    if how == "close":
        loader.close()
    elif how == "drop":
        del it
    else:  # held by a reference cycle: let go when the cycle collector runs
        cycle = {"it": it}
        cycle["self"] = cycle
        del it, cycle
        gc.collect()
    # bounded well below the stuck worker's 120 s: the thread stops without waiting for it (this asserted
    # < 3 s, which a busy machine broke)
    assert wait_for(lambda: not pin_threads(), timeout=PROMPTLY_S)


def test_persistent_workers_pin_every_epoch_and_restart_the_thread(leak_check):
    def make(pinned):
        kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True, shuffle=True,
                      generator=torch.Generator().manual_seed(1))
        return pinned_loader(Images(), **kwargs) if pinned else DataLoader(Images(), **kwargs)

    plain_loader, loader = make(False), make(True)
    for epoch in range(3):
        if epoch == 1:  # an epoch left early, by both: the next one starts cleanly on the same workers
            for each in (plain_loader, loader):
                it = iter(each)
                next(it)
                del it
        ref = [plain(b["y"]) for b in plain_loader]
        assert [plain(b["y"]) for b in loader] == ref
        assert len(pin_threads()) <= 1  # one thread, waiting for the next epoch's tasks (as torch's)
        pool = loader._iterator._source._source._pool
        if epoch == 0:
            pids = pool.pids
    assert pool.pids == pids and pool.alive()  # the same workers served every epoch
    loader.close()
    assert not pool.alive()
    plain_loader.close()


def test_a_new_iterator_over_a_dataflow_abandons_the_pinning_one(leak_check):
    flow = bridgeflow.FilterData(bridgeflow.DataFromList([[np.int64(i)] for i in range(7)], shuffle=False), bool)
    with pinned_loader(flow, batch_size=3, num_workers=2) as loader:
        first = iter(loader)
        assert next(first)[0].tolist() == [0, 1, 2]
        second = iter(loader)
        assert [b[0].tolist() for b in second] == [[0, 1, 2], [3, 4, 5], [6]]
        assert list(first) == []
        del first, second
    flow.close()


def test_a_pinner_that_fails_gives_that_batch_its_error(leak_check):
    class Refusing(FakePinnedMemory):
        def alloc(self, shape, dtype):
            if self.allocations == 4:  # a batch of Tagged has 3 tensors: the second batch's second one
                self.allocations += 1
                raise RuntimeError("CUDA error: out of memory (pinned)")
            return super().alloc(shape, dtype)

    loader = pinned_loader(Tagged(8), Refusing(), batch_size=2, num_workers=2)
    it = iter(loader)
    out = []
    for _ in range(4):
        try:
            out.append(plain(next(it))[0])
        except RuntimeError as exc:
            out.append(str(exc))
    assert out == [[0, 1], "CUDA error: out of memory (pinned)", [4, 5], [6, 7]]
    assert loader.state_dict()["yielded"] == 4  # the batch that failed counts as delivered
    del it
    loader.close()
