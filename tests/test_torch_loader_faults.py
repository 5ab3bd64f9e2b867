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
from deaths import die, once
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


# --- max_restarts and on_error ----------------------------------------------------------------------


class Fragile(tud.Dataset):
    """60 samples of 2,000 numbers (batches travel in shared memory); ``__getitem__`` raises for ``bad``; the worker
    reading ``kill`` is SIGKILLed (the first time only, ``flag``), the one reading ``crash`` segfaults (always, up to
    the bound of deaths counted in ``flag``).
    Each sample carries the worker's id and seed as torch's get_worker_info() gives them."""

    def __init__(self, bad=(), kill=None, flag="", crash=None):
        self.bad, self.kill, self.flag, self.crash = bad, kill, flag, crash

    def __len__(self):
        return 60

    def __getitem__(self, i):
        if i == self.kill and once(self.flag):
            os.kill(os.getpid(), signal.SIGKILL)
        if i == self.crash:
            die("segv", self.flag)
        if i in self.bad:
            raise OSError(f"sample {i}: truncated file")
        info = tud.get_worker_info()
        who = [-1, -1] if info is None else [info.id, info.seed]
        return {"x": torch.full((2000,), i), "who": torch.tensor(who)}


def batches(loader):
    return [(b["x"][:, 0].tolist(), b["who"].tolist()) for b in loader]


def make(num_workers, **kw):
    return DataLoader(Fragile(**kw.pop("ds", {})), batch_size=4, shuffle=True, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(3), **kw)


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("pinned", [False, True])
def test_a_killed_worker_is_replaced_with_its_id_and_seed_and_the_epoch_is_the_undisturbed_one(
        tmp_path, in_order, pinned, leak_check):
    from torch_backends import FakePinnedMemory

    ref = make(2)
    want = batches(ref)
    loader = make(2, ds={"kill": 30, "flag": str(tmp_path / "once")}, max_restarts=1, in_order=in_order,
                  pin_memory=pinned)
    loader._bf.pin_backend = FakePinnedMemory() if pinned else None
    got = batches(loader)
    if in_order:  # each batch from the worker (id and seed) that read it in the undisturbed run
        assert got == want
    else:  # batches as they are ready, from either worker
        assert sorted(x for x, _ in got) == sorted(x for x, _ in want)
    assert loader.stats()["DataLoader"]["restarts"] == 1


def test_a_persistent_worker_replaced_in_one_epoch_serves_the_next(tmp_path, leak_check):
    ref = make(2, persistent_workers=True)
    want = [batches(ref), batches(ref)]
    ref.close()
    loader = make(2, ds={"kill": 50, "flag": str(tmp_path / "once")}, max_restarts=1, persistent_workers=True)
    assert [batches(loader), batches(loader)] == want
    assert loader.stats()["DataLoader"]["restarts"] == 1  # the pool's, over its life
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_leaves_failing_samples_out_of_their_batches_the_same_with_and_without_workers(num_workers, caplog,
                                                                                            leak_check):
    loader = make(num_workers, ds={"bad": (4, 17, 18)}, on_error="skip")
    with caplog.at_level("WARNING", "bridgeflow.adapters.torch._epoch"):
        got = [x for x, _ in batches(loader)]
    full = [x for x, _ in batches(make(0))]
    assert got == [[i for i in b if i not in (4, 17, 18)] for b in full if set(b) - {4, 17, 18}]
    assert loader.stats()["DataLoader"]["skipped"] == 3
    lines = [r.getMessage() for r in caplog.records if "skipped the sample at index" in r.getMessage()]
    assert len(lines) == 3 and any("index 17: OSError: sample 17: truncated file" in m for m in lines), lines


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_that_skips_a_whole_batch_leaves_no_batch(num_workers, leak_check):
    loader = DataLoader(Fragile(bad=(4, 5)), batch_size=2, num_workers=num_workers, on_error="skip")
    got = [b["x"][:, 0].tolist() for b in loader]
    assert [4, 5] not in got and len(got) == 29 and loader.stats()["DataLoader"]["skipped"] == 2
    loader = DataLoader(Fragile(bad=(4,)), batch_size=None, num_workers=num_workers, on_error="skip")
    assert [int(s["x"][0]) for s in loader] == [i for i in range(60) if i != 4]


class ItemsDataset(tud.Dataset):
    """A dataset read a batch at a time (``__getitems__``) that fails on index 7."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices):
        if 7 in indices:
            raise KeyError(7)
        return [torch.tensor(i) for i in indices]


def test_skip_reads_a_batch_dataset_sample_by_sample_only_when_the_batch_fails(leak_check):
    loader = DataLoader(ItemsDataset(), batch_size=4, num_workers=2, on_error="skip")
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6], [8, 9, 10, 11], [12, 13, 14, 15],
                                            [16, 17, 18, 19]]


def test_a_sample_that_segfaults_every_worker_is_named_or_skipped(tmp_path, caplog, leak_check):
    with pytest.raises(bridgeflow.WorkerError) as info:
        batches(make(2, ds={"crash": 21, "flag": str(tmp_path / "raise")}, max_restarts=3))
    text = str(info.value)
    assert "is killed by signal: Segmentation fault" in text
    assert "the sample at index 21: it killed 2 worker processes in turn" in text and "SIGSEGV" in text
    loader = make(2, ds={"crash": 21, "flag": str(tmp_path / "skip")}, max_restarts=3, on_error="skip")
    with caplog.at_level("WARNING"):
        got = [x for x, _ in batches(loader)]
    assert got == [[i for i in b if i != 21] for b in (x for x, _ in batches(make(0)))]
    stats = loader.stats()["DataLoader"]
    assert stats["skipped"] == 1 and stats["restarts"] == 2
    assert any("skipped the sample at index 21: it killed 2 worker processes" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resume_after_skips_is_exact(num_workers, leak_check):
    full = batches(make(num_workers, ds={"bad": (4, 17, 18, 40)}, on_error="skip"))
    loader = make(num_workers, ds={"bad": (4, 17, 18, 40)}, on_error="skip")
    it = iter(loader)
    head = [next(it) for _ in range(7)]
    state = loader.state_dict()
    del it
    again = make(num_workers, ds={"bad": (4, 17, 18, 40)}, on_error="skip")
    again.load_state_dict(state)
    rest = batches(again)
    assert [(b["x"][:, 0].tolist(), b["who"].tolist()) for b in head] + rest == full


def test_restarts_and_skips_are_refused_where_they_cannot_hold():
    with pytest.raises(ValueError, match="max_restarts=2 needs a map-style dataset"):
        DataLoader(FailingIterable(3), num_workers=2, max_restarts=2)
    with pytest.raises(ValueError, match="on_error='skip' leaves out samples whose __getitem__ raises"):
        DataLoader(FailingIterable(3), on_error="skip")
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        DataLoader(list(range(4)), on_error="ignore")
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
        DataLoader(list(range(4)), max_restarts=-1)
    loader = DataLoader(list(range(4)), max_restarts=2, on_error="skip")  # kept, as torch keeps its arguments
    assert (loader.max_restarts, loader.on_error) == (2, "skip")
    assert sorted(DataLoader(list(range(8)), batch_size=4, num_workers=2).stats() or {"DataLoader": {}}) == \
        ["DataLoader"]
