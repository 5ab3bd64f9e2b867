"""A DataLoader state saved on one rank and loaded on another (issue 39).

Lightning writes rank 0's ``loader.state_dict()`` into its checkpoint and every rank loads it; Accelerate's
``save_state()`` writes one rank's; plain DDP code mostly saves on rank 0. The ranks step together, so the
position (batches delivered, the sampler's epoch and seeds, the workers' base seed when every rank seeds
torch alike) is every rank's, and each rank's own ``DistributedSampler`` gives it its own indices from there.
What only the saving rank had (its dataset's states, the batches it handed out of order, datapoints its
DataFlow held) is refused. The ranks here are loaders built with ``DistributedSampler(rank=r)`` in one process,
each from the same global seed, as two rank processes seeded alike are; Lightning's own runs, with ``ddp`` and
``ddp_spawn``, are in tests/test_torch_frameworks.py.
"""

from __future__ import annotations

import json

import pytest

from conftest import need

need("torch")

import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader, ResumeStateError

N, BATCH, CUT = 23, 3, 2


class Drawn(tud.Dataset):
    """Sample ``i`` and a draw from torch's generator (seeded per sample with ``seed_per_sample``)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, torch.randint(1 << 30, ()).item()


class Counting(Drawn):
    """A dataset with a state: how many samples this copy has read."""

    calls = 0

    def __getitem__(self, i: int):
        self.calls += 1
        return i, self.calls

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


def make(rank: int, workers: int, dataset: type = Drawn, **kwargs) -> DataLoader:
    ds = dataset()
    return DataLoader(ds, batch_size=BATCH, num_workers=workers, sampler=tud.DistributedSampler(ds, 2, rank, seed=4),
                      **kwargs)


def batches(loader: DataLoader, epochs: range, cut: int | None = None,
            resumed: bool = False) -> tuple[list, dict | None]:
    """Each batch as plain lists over ``epochs`` (the sampler's epoch set before each but a resumed one); the
    state after ``cut`` batches, through JSON."""
    out, state = [], None
    for epoch in epochs:
        if not (resumed and epoch == epochs[0]):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            out.append([t.tolist() for t in batch])
            if len(out) == cut:
                state = json.loads(json.dumps(loader.state_dict()))
    return out, state


def run_rank(rank: int, workers: int, **kwargs) -> tuple[list, dict | None]:
    torch.manual_seed(0)  # every rank's process seeds torch alike (seed_everything, or torch's default seed)
    loader = make(rank, workers, **kwargs)
    try:
        return batches(loader, range(2), CUT)
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("seed_per_sample", [False, True])
def test_rank_zeros_state_resumes_every_rank_where_it_was(workers, seed_per_sample, leak_check):
    """Rank 0's mid-epoch state, loaded on rank 1 in a new process (another global RNG): rank 1 goes on with
    its own rest of the epoch and its next epoch, each batch what its uninterrupted run gave; with
    ``seed_per_sample`` the draws in ``__getitem__`` too."""
    full = {r: run_rank(r, workers, seed_per_sample=seed_per_sample) for r in (0, 1)}
    assert full[0][1]["config"]["distributed"]["rank"] == 0
    for rank in (0, 1):
        torch.manual_seed(1000 + rank)
        loader = make(rank, workers, seed_per_sample=seed_per_sample)
        loader.load_state_dict(full[0][1])
        got, _ = batches(loader, range(2), resumed=True)
        loader.close()
        ids = lambda bs: [b[0] for b in bs]
        assert ids(got) == ids(full[rank][0][CUT:]), rank
        if seed_per_sample:
            assert got == full[rank][0][CUT:], rank
    assert ids(full[0][0]) != ids(full[1][0])  # each rank its own shard


def test_a_state_between_epochs_resumes_another_rank(leak_check):
    torch.manual_seed(0)
    loader = make(0, 2)
    _ = batches(loader, range(1))
    state = loader.state_dict()
    loader.close()
    want, _ = run_rank(1, 2)
    again = make(1, 2)
    again.load_state_dict(state)
    got, _ = batches(again, range(1, 2))  # a new epoch: set_epoch(1) as the loop does
    again.close()
    assert [b[0] for b in got] == [b[0] for b in want[-len(got):]]


@pytest.mark.parametrize(("dataset", "kwargs", "match"), [
    (Counting, {}, "its dataset's states"),
    (Drawn, {"in_order": False}, "the batches that rank handed out before an earlier one"),
])
def test_what_only_the_saving_rank_had_is_refused(dataset, kwargs, match, leak_check):
    torch.manual_seed(0)
    loader = make(0, 2, dataset, **kwargs)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(ResumeStateError, match=f"saved on rank 0 and holds ({match}).*rank 1.*AllRanksState"):
        make(1, 2, dataset, **kwargs).load_state_dict(state)
    make(0, 2, dataset, **kwargs).load_state_dict(state)  # its own rank takes it


def test_a_dataflow_state_holding_datapoints_is_refused_on_another_rank():
    """A DataFlow over an unordered stage keeps the datapoints it read ahead in its state (``held``): they are
    the saving rank's part of the data."""
    import bridgeflow

    flow = bridgeflow.DataFromList([[i] for i in range(N)], shuffle=False)
    loader = DataLoader(flow, batch_size=BATCH, sampler=tud.DistributedSampler(flow, 2, 0))
    state = loader.state_dict()
    del state["check"]  # a state written by hand is taken on its fields
    state["flow"] = {"class": "X", "child": {"held": "AAAA"}}
    with pytest.raises(ResumeStateError, match="saved on rank 0 and holds datapoints its DataFlow held"):
        DataLoader(flow, batch_size=BATCH, sampler=tud.DistributedSampler(flow, 2, 1)).load_state_dict(state)
