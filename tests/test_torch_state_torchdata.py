"""Differential resume test: bridgeflow's DataLoader against torchdata's StatefulDataLoader.

Same dataset, same seeds; the state is taken after k batches (k = 0, 1, a middle one, the last), loaded into
a new loader of each kind, and the batches the new loaders yield must be identical. Samples carry the worker
that read them, its seed and one draw from each of numpy's, Python's and torch's global RNGs, so the
workers' seeds and random streams after a resume are compared too (both restart them from the epoch's seeds).

The configurations are those where torch's and torchdata's loaders give the same batches uninterrupted (with
``shuffle=True`` torchdata draws the permutation and the workers' base seed in another order than torch, so
its shuffled batches differ from torch's and bridgeflow's; shuffling comes from an explicit sampler here).

One difference is deliberate: with ``num_workers=0`` torchdata's resumed loader draws a base seed it does not
use from torch's global RNG; bridgeflow draws nothing, so a job that restores the global RNG from its
checkpoint continues it exactly (tests/test_torch_state.py checks that). The torch draw made in this
process is therefore left out of the comparison when there are no workers.
"""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest
from test_torch_state import _Cursor, plain

from conftest import need

need("torch")
need("torchdata")

import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

from bridgeflow.adapters.torch import DataLoader


class Augmented(tud.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        info = tud.get_worker_info()
        wid, seed = (-1, -1) if info is None else (info.id, info.seed)
        return i, wid, seed, int(np.random.randint(1 << 30)), random.random(), torch.rand(()).item()


class Shards(tud.IterableDataset):
    """Each worker reads its own shard through an iterator that can save its position."""

    def __iter__(self):
        info = tud.get_worker_info()
        wid, n = (0, 1) if info is None else (info.id, info.num_workers)
        return _Cursor([i for i in range(13) if i % n == wid])


CONFIGS = {
    "sequential": lambda: (Augmented(), dict(batch_size=3)),
    "sampler_with_generator": lambda: (Augmented(), dict(
        batch_size=3, sampler=tud.RandomSampler(range(10), generator=torch.Generator().manual_seed(4)))),
    "distributed": lambda: (Augmented(), dict(
        batch_size=2, sampler=tud.DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=9))),
    "no_auto_batching": lambda: (Augmented(), dict(batch_size=None)),
    "stateful_iterable": lambda: (Shards(), dict(batch_size=2)),
}


def resumed_batches(cls, config, num_workers, k):
    """The batches a new loader of class ``cls`` yields after loading the state taken after k batches."""
    torch.manual_seed(2024)
    np.random.seed(2024)
    random.seed(2024)
    dataset, kwargs = CONFIGS[config]()
    loader = cls(dataset, num_workers=num_workers, **kwargs)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = loader.state_dict()
    if cls is DataLoader:
        state = json.loads(json.dumps(state))
        loader.close()
    del it, loader
    torch.manual_seed(7)  # the new process's own global RNGs, the same for both loaders
    np.random.seed(7)
    random.seed(7)
    dataset, kwargs = CONFIGS[config]()
    again = cls(dataset, num_workers=num_workers, **kwargs)
    again.load_state_dict(state)
    out = [plain(b) for b in again]
    if num_workers == 0 and config != "stateful_iterable":  # see the module docstring
        out = [b[:5] for b in out]
    if cls is DataLoader:
        again.close()
    del again
    return out


def epoch_length(config):
    dataset, kwargs = CONFIGS[config]()
    return len(list(tud.DataLoader(dataset, **kwargs)))


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_resumed_batches_equal_torchdatas(config, num_workers, leak_check):
    n = epoch_length(config)
    for k in sorted({0, 1, n // 2, n}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = resumed_batches(StatefulDataLoader, config, num_workers, k)
        got = resumed_batches(DataLoader, config, num_workers, k)
        assert len(ref) == n - k, (k, len(ref))
        assert got == ref, f"{config}, {num_workers} workers, state after {k} batches"


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_uninterrupted_batches_equal_torchdatas_and_torchs():
    """The premise of the comparison: uninterrupted, the three loaders agree on these configurations."""
    for config in CONFIGS:
        runs = []
        for cls in (tud.DataLoader, StatefulDataLoader, DataLoader):
            torch.manual_seed(5)
            np.random.seed(5)
            random.seed(5)
            dataset, kwargs = CONFIGS[config]()
            runs.append([plain(b) for b in cls(dataset, **kwargs)])
        assert runs[0] == runs[1] == runs[2], config
