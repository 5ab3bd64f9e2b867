"""Read-ahead bounded in bytes as well as in count: the worker pool keeps what its tasks and results in
flight occupy under a budget (``max_bytes_in_flight``, default ``read_ahead_budget()``), so large
datapoints are not multiplied by ``buffer_size``, chunks or ``prefetch_factor``. Real worker processes;
the shared memory of the pool is measured in ``/dev/shm`` as the consumer iterates."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import bridgeflow as bf
from bridgeflow.parallel import MultiProcessMapData, WorkerPool
from bridgeflow.parallel._transport import pool as pool_mod
from conftest import SHM_DIR, need

MIB = 1 << 20


def pool_bytes() -> int:
    """The bytes of shared memory this process's pools hold (their slabs and control segments)."""
    total = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"bf{os.getpid()}_"):
            try:
                total += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class Peak:
    """The most shared memory this process's pools held, sampled every 10 ms while the block runs."""

    def __enter__(self) -> Peak:
        self.most, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, pool_bytes())
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def plus_one_init(ctx):
    return lambda a: a + 1  # a new array: the result is as large as the task


def test_the_default_budget_is_a_share_of_memory_and_of_dev_shm():
    budget = pool_mod.read_ahead_budget()
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    st = os.statvfs(SHM_DIR)
    assert 256 * MIB <= budget <= max(256 * MIB, min(memory // 16, st.f_blocks * st.f_frsize // 8))
    with pytest.raises(ValueError, match="max_bytes_in_flight must be a positive number of bytes"):
        WorkerPool(plus_one_init, 1, max_bytes_in_flight=0)


def test_the_pool_keeps_tasks_back_once_the_bytes_in_flight_reach_the_budget(leak_check):
    """20 tasks of 24 MiB put at once (a caller bounding only the count) under a 128 MiB budget: at most
    a few travel at a time, each alone, and every result comes back right."""
    big = np.zeros(24 * MIB, np.uint8)
    with Peak() as peak, WorkerPool(plus_one_init, 2, chunk_size=16, max_bytes_in_flight=128 * MIB) as pool:
        pool.start()
        for i in range(20):
            pool.put(big + i)
        assert pool.saturated and pool.outstanding == 20
        for i in range(20):
            _, out = pool.get()
            assert out[0] == i + 1 and out.nbytes == 24 * MIB
        assert not pool.saturated
    # twice the budget (slabs reused: two a worker and direction), plus a task and a result past it
    assert peak.most < 2 * 128 * MIB + 4 * 24 * MIB, peak.most / MIB
    assert peak.most > 24 * MIB  # it did travel through shared memory


def copy_plus_one(dp):
    return [dp[0] + 1]


@pytest.mark.parametrize("strict", [False, True])
def test_a_large_datapoint_through_a_map_stage_with_default_options(leak_check, monkeypatch, strict):
    """One 48 MiB datapoint, default buffer_size=200: non-strict stages read ahead into later epochs, and the
    workers took chunks of 16 (0.75 GB each here; a 0.75 GiB datapoint got a worker OOM-killed at 12.6 GB).
    The budget (256 MiB for the test) bounds it, and every epoch gives the datapoint, mapped."""
    monkeypatch.setattr(pool_mod, "read_ahead_budget", lambda: 256 * MIB)
    big = np.zeros(48 * MIB, np.uint8)
    with Peak() as peak, MultiProcessMapData(bf.DataFromList([[big]], shuffle=False), 2, copy_plus_one,
                                             strict=strict) as df:
        df.reset_state()
        for _ in range(4):
            epoch = list(df)
            assert len(epoch) == 1 and epoch[0][0][0] == 1 and epoch[0][0].nbytes == 48 * MIB
            del epoch
    assert peak.most < 2 * 256 * MIB + 4 * 48 * MIB, peak.most / MIB  # without the budget: 1.2 GB


def test_small_datapoints_still_travel_in_chunks(leak_check):
    """Below 1 MiB a task, once what they cost is known, tasks travel a chunk to a message as before."""
    sent = []
    with WorkerPool(plus_one_init, 2, chunk_size=8) as pool:
        pool.start()
        channel = pool._channel
        send = channel.send
        channel.send = lambda worker, chunk: sent.append(len(chunk)) or send(worker, chunk)
        for i in range(4):  # the first results: the cost is learned one task at a time
            pool.put(np.full(10, i))
            pool.get()
        for i in range(64):
            pool.put(np.full(10, i))
        results = [int(pool.get()[1][0]) for _ in range(64)]
    assert results == [i + 1 for i in range(64)]
    assert max(sent) == 8 and sent.count(8) == 8, sent


def test_the_torch_loader_inherits_the_budget(leak_check, monkeypatch):
    """The torch DataLoader's prefetch (prefetch_factor * num_workers batches) runs on the same pool."""
    torch = need("torch")

    from bridgeflow.adapters.torch import DataLoader

    monkeypatch.setattr(pool_mod, "read_ahead_budget", lambda: 256 * MIB)

    class Big(torch.utils.data.Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return torch.full((40 * MIB,), i % 100, dtype=torch.uint8)

    with Peak() as peak:
        loader = DataLoader(Big(), batch_size=1, num_workers=2, prefetch_factor=8)
        seen = [int(batch[0, 0]) for batch in loader]
        loader.close()
    assert seen == [i % 100 for i in range(24)]
    assert peak.most < 2 * 256 * MIB + 4 * 40 * MIB, peak.most / MIB  # 16 batches of 40 MiB were in flight
