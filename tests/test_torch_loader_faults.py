"""DataLoader faults and corner cases found by probing against torch: a DataFlow that fails part-way, a
worker whose start-up failed asked for more batches, a worker killed from outside, unordered results.

The differential suite (test_torch_loader.py) covers the common argument combinations; these cases need
their own set-up or say more than "equal to torch".
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.utils.data as tud
from test_torch_loader import assert_same, outcomes

import bridgeflow
from bridgeflow.adapters.torch import DataLoader


class FailingFlow(bridgeflow.DataFlow):
    """Yields ``[i]`` for ``i < bad``, then raises."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __iter__(self):
        for i in range(self.bad):
            yield [np.int64(i)]
        raise ValueError(f"record {self.bad} is corrupt")


class FailingIterable(tud.IterableDataset):
    """torch's counterpart of FailingFlow (read in one process: no sharding)."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __iter__(self):
        for i in range(self.bad):
            yield [np.int64(i)]
        raise ValueError(f"record {self.bad} is corrupt")


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
