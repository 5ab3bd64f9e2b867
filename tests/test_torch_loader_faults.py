"""DataLoader faults and corner cases found by probing against torch: a DataFlow that fails part-way, a
worker whose start-up failed asked for more batches, a worker killed from outside, unordered results.

The differential suite (test_torch_loader.py) covers the common argument combinations; these cases need
their own set-up or say more than "equal to torch".
"""

from __future__ import annotations

import os
import signal
import time
import warnings

import numpy as np
import pytest
from test_torch_loader import ArrayDataset, assert_same, failing_init_fn, outcomes

import bridgeflow
from conftest import PROMPTLY_S, need, wait_for

need("torch")

import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader


def records_then_error(bad: int):
    """``[i]`` for ``i < bad``, then a ValueError."""
    for i in range(bad):
        yield [np.int64(i)]
    raise ValueError(f"record {bad} is corrupt")


class FailingFlow(bridgeflow.DataFlow):
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __iter__(self):
        return records_then_error(self.bad)


class FailingIterable(tud.IterableDataset):
    """torch's counterpart of FailingFlow (read in one process: no sharding)."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __iter__(self):
        return records_then_error(self.bad)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("bad", [0, 5, 9, 20])
def test_dataflow_error_comes_after_the_batches_read_before_it(num_workers, bad, leak_check):
    """The flow is read in the consumer and only collated in the workers; its error must come in order,
    after every batch read before it, with no batch lost (torch reading the same data as an
    IterableDataset in one process is the reference)."""
    ref = outcomes(tud.DataLoader(FailingIterable(bad), batch_size=2))
    flow = FailingFlow(bad)
    loader = DataLoader(flow, batch_size=2, num_workers=num_workers)
    got = outcomes(loader)
    assert_same(ref, got)
    assert got[0][-1][:2] == ("raised", ValueError) and got[0][-1][2] == [f"record {bad} is corrupt"]
    assert len(got[0]) == bad // 2 + 1  # every full batch before the error, then the error, then the end
    flow.close()


def test_dataflow_error_then_a_new_persistent_epoch(leak_check):
    flow = FailingFlow(5)
    with DataLoader(flow, batch_size=2, num_workers=2, persistent_workers=True) as loader:
        for _ in range(2):
            got = outcomes(loader)[0]
            assert [b[0].tolist() for b in got[:2]] == [[0, 1], [2, 3]]
            assert got[2][1] is ValueError and len(got) == 3
    flow.close()


def test_worker_whose_start_up_failed_says_so_for_its_later_batches(leak_check):
    """torch raises an UnboundLocalError about ``fetcher`` there; bridgeflow names the start-up error."""
    got = outcomes(DataLoader(ArrayDataset(8), batch_size=2, num_workers=2, worker_init_fn=failing_init_fn))[0]
    assert [type(b) for b in got] == [list, tuple, list, tuple]
    assert got[1][1] is KeyError and "no config for worker 1" in got[1][2][0]
    assert got[3][1] is RuntimeError
    assert "DataLoader worker 1 cannot load data" in got[3][2][0] and "no config for worker 1" in got[3][2][0]


class IterOnceDataset(tud.IterableDataset):
    """``iter()`` works once per process, then raises: a persistent worker's second epoch fails to start."""

    calls = 0

    def __iter__(self):
        type(self).calls += 1
        if type(self).calls > 1:
            raise OSError(f"shard file gone (call {type(self).calls})")
        info = tud.get_worker_info()
        return iter(range(info.id * 10, info.id * 10 + 3))


def test_persistent_epoch_whose_iter_fails_reports_it_at_that_workers_batch(leak_check):
    with DataLoader(IterOnceDataset(), batch_size=None, num_workers=2, persistent_workers=True) as loader:
        assert sorted(int(b) for b in loader) == [0, 1, 2, 10, 11, 12]
        second = outcomes(loader)[0]
        errors = [b for b in second if isinstance(b, tuple)]
        assert errors and all(e[1] is OSError and "shard file gone (call 2)" in e[2][0] for e in errors)


class SleepyDataset(tud.Dataset):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int):
        time.sleep(0.02)
        return i


def test_sigkilled_worker_becomes_an_error_naming_it(leak_check):
    loader = DataLoader(SleepyDataset(), batch_size=1, num_workers=2)
    it = iter(loader)
    assert int(next(it)) == 0
    pid = it._source._pool.pids[1]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(bridgeflow.WorkerError) as info:
        for _ in it:
            pass
    assert time.monotonic() - t0 < PROMPTLY_S
    err = info.value
    assert isinstance(err, RuntimeError) and err.worker == 1 and err.pid == pid
    assert "SIGKILL" in str(err) and str(pid) in str(err)
    assert it.closed
    del it, info, err


@pytest.mark.parametrize("pinned", [False, True])
def test_a_worker_found_dead_when_its_next_task_is_sent_says_so_in_torchs_words(pinned, leak_check):
    """The worker's results were all in its pipe when it died: receiving them works, sending its next task
    fails (a broken pipe). That must read as any dead worker does, and stop the other workers."""
    from torch_backends import FakePinnedMemory

    loader = DataLoader(list(range(40)), batch_size=1, num_workers=2, pin_memory=pinned)
    loader._bf.pin_backend = FakePinnedMemory() if pinned else None
    it = iter(loader)
    assert int(next(it)) == 0
    pool = (it._source._source if pinned else it._source)._pool
    # every task sent so far is done (the workers' counters say so): its result waits in a pipe
    assert wait_for(lambda: pool.results_received + pool._channel.unread(pool.results_received) >= pool._next_task)
    pid = pool.pids[1]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    got = []
    with pytest.raises(bridgeflow.WorkerError) as info:
        for batch in it:
            got.append(int(batch))
    assert got == list(range(1, len(got) + 1)) and len(got) >= 1  # the results it sent before dying
    message = str(info.value)
    assert "is killed by signal: Killed" in message and str(pid) in message and info.value.worker == 1
    assert it.closed and not pool.alive()
    del it, info


class SlowFirstDataset(tud.Dataset):
    """Sample 0 waits until the file ``gate`` exists (the test opens it once a batch came out)."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        if i == 0:
            assert wait_for(lambda: os.path.exists(self.gate), interval=0.005), "the test never opened the gate"
        return i


def test_in_order_false_hands_out_ready_batches_first_like_torch(leak_check, tmp_path):
    results = []
    for k, cls in enumerate((tud.DataLoader, DataLoader)):
        gate = tmp_path / f"gate{k}"
        it = iter(cls(SlowFirstDataset(str(gate)), batch_size=1, num_workers=2, in_order=False))
        first = int(next(it))  # not sample 0, which waits: the slow batch does not hold the others back
        gate.touch()
        results.append([first, *(int(b) for b in it)])
    for got in results:
        assert sorted(got) == list(range(8)) and got[0] != 0
    ordered = [int(b) for b in DataLoader(SlowFirstDataset(str(gate)), batch_size=1, num_workers=2)]
    assert ordered == list(range(8))


def test_pin_memory_device_warning_like_torch(leak_check):
    for cls in (tud.DataLoader, DataLoader):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(cls(ArrayDataset(2), batch_size=2, pin_memory=True, pin_memory_device="cuda"))
        assert any("pin_memory_device is deprecated" in str(w.message) for w in caught), cls


def test_tensor_views_arrive_with_equal_values(leak_check):
    """Samples that are views of one storage (rows and columns of a table) keep dtype, shape and values
    through the workers' transport (strides and storage sharing are not kept: see loader.py)."""

    ref = outcomes(tud.DataLoader(ViewsDataset(), batch_size=None, num_workers=2))
    got = outcomes(DataLoader(ViewsDataset(), batch_size=None, num_workers=2))
    assert_same(ref, got)
    assert torch.equal(got[0][1][1], torch.tensor([1, 11, 21, 31]))


class ViewsDataset(tud.Dataset):
    table = torch.arange(40).reshape(4, 10)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return self.table[i], self.table[:, i]


@pytest.mark.parametrize("num_workers", [True, 2.5])
def test_num_workers_of_other_types_like_torch(num_workers, leak_check):
    results = []
    for cls in (tud.DataLoader, DataLoader):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                results.append([b.tolist() for b in cls(list(range(5)), batch_size=2, num_workers=num_workers)])
            except Exception as exc:
                results.append((type(exc), str(exc)))
    assert results[0] == results[1]
