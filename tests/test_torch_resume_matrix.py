"""Resume at every kind of point, in every loader set-up, and compare with the uninterrupted run (issue 21).

Datasets: map-style, a stateful iterable whose state holds a per-worker epoch counter (it changes in
``__iter__``, so only a restored worker copy gives the next epoch right), and a random-access DataFlow.
Loaders: 0, 1, 2 workers, persistent or not, ``shuffle=True`` with and without ``generator``. States are
taken at k = 0 (after ``iter()``), mid-epoch, after the last batch (before StopIteration), between epochs
and mid-epoch 2; each goes through JSON, into a new loader in a "new process" (torch's global RNG seeded
differently, nothing restored, as Lightning does), which must yield exactly what the uninterrupted run
yields for the rest of the three epochs. Samples carry the worker and its seed, so seeds are compared too.

The same matrix runs under torchdata's StatefulDataLoader as a reference for what "exact" means; where
torchdata and torch draw shuffles differently (torchdata's RandomSampler), each loader is compared with
its own uninterrupted run.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest

import bridgeflow as bf
from conftest import need

need("torch")
need("torchdata")

import torch
import torch.utils.data as tud
from test_torch_state import plain
from torchdata.stateful_dataloader import StatefulDataLoader

from bridgeflow.adapters.torch import DataLoader

N, BATCH, EPOCHS = 9, 2, 3


class Ids(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        info = tud.get_worker_info()
        return i, (-1 if info is None else info.id), (-1 if info is None else info.seed)


class EpochCounted(tud.IterableDataset):
    """A per-copy epoch counter, bumped by ``__iter__``, and the position in the epoch: its state."""

    def __init__(self) -> None:
        self.epoch, self.pos = -1, 0

    def __iter__(self):
        self.epoch, self.pos = self.epoch + 1, 0
        return self

    def __next__(self):
        info = tud.get_worker_info()
        wid, n = (0, 1) if info is None else (info.id, info.num_workers)
        mine = [i for i in range(N) if i % n == wid]
        if self.pos >= len(mine):
            raise StopIteration
        self.pos += 1
        return self.epoch, wid, mine[self.pos - 1]

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]


def make(kind: str, cls, workers: int, persistent: bool, gen: bool):
    kwargs = dict(batch_size=BATCH, num_workers=workers, persistent_workers=persistent)
    if gen:
        kwargs["generator"] = torch.Generator().manual_seed(11)
    if kind == "map":
        return cls(Ids(), shuffle=True, **kwargs)
    if kind == "iterable":
        return cls(EpochCounted(), **kwargs)
    flow = bf.MapData(bf.DataFromList([[i] for i in range(N)], shuffle=False), lambda dp: [dp[0] * 10])
    return cls(flow, shuffle=True, **kwargs)


def saved(loader):
    """The loader's state through JSON (torchdata's holds tensors: through copy.deepcopy instead)."""
    state = loader.state_dict()
    return json.loads(json.dumps(state)) if isinstance(loader, DataLoader) else copy.deepcopy(state)


def run(loader, points=None):
    """All batches of EPOCHS epochs; with ``points``, also the state at each (epoch, k) point, where k is
    batches into the epoch (k = None: between epochs, after StopIteration)."""
    out, states = [], {}
    for epoch in range(EPOCHS):
        it = iter(loader)
        k = 0
        while True:
            if points and (epoch, k) in points:
                states[(epoch, k)] = (len(out), saved(loader))
            try:
                out.append(plain(next(it)))
            except StopIteration:
                break
            k += 1
        if points and (epoch, None) in points:
            states[(epoch, None)] = (len(out), saved(loader))
    return out, states


def resumed(loader, state, epoch):
    """Load ``state`` (taken in ``epoch``) and read the rest of EPOCHS epochs."""
    loader.load_state_dict(state)
    out = []
    finished = state.get("finished") or state.get("_iterator_finished")
    for _ in range(epoch + (1 if finished else 0), EPOCHS):
        out += [plain(b) for b in loader]
    return out


POINTS = [(0, 0), (0, 2), (0, 4), (0, None), (1, 3)]  # 5 batches an epoch: k=4 is the last batch
SETUPS = [(0, False), (1, False), (2, False), (1, True), (2, True)]


def check(kind, cls, workers, persistent, gen):
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, states = run(make(kind, cls, workers, persistent, gen), set(POINTS))
        assert len(states) == len(POINTS)
        for point, (done, state) in states.items():
            torch.manual_seed(1000 + done)  # another process's global RNG, not restored
            loader = make(kind, cls, workers, persistent, gen)
            got = resumed(loader, state, point[0])
            if cls is DataLoader:
                loader.close()
            assert got == ref[done:], f"{cls.__name__}: state at epoch {point[0]}, k={point[1]}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("gen", [False, True], ids=["global_rng", "generator"])
@pytest.mark.parametrize("workers,persistent", SETUPS, ids=[f"{w}w{'-persistent' if p else ''}" for w, p in SETUPS])
@pytest.mark.parametrize("kind", ["map", "iterable", "dataflow"])
def test_resume_gives_the_uninterrupted_run(kind, workers, persistent, gen, leak_check):
    check(kind, DataLoader, workers, persistent, gen)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind,workers,persistent", [("map", 2, True), ("iterable", 0, False),
                                                     ("iterable", 2, True)])
def test_the_matrix_holds_for_torchdata_too(kind, workers, persistent):
    """The premise: torchdata's StatefulDataLoader passes the same checks (with a generator, and without
    one, where its own sampler keeps its generator in its state). Not with a shuffled map-style dataset
    and no workers: a state taken at k = 0 resumes that epoch but gives another order for the next one
    (torchdata 0.11), which bridgeflow gets right (map-0w above)."""
    for gen in (False, True):
        check(kind, StatefulDataLoader, workers, persistent, gen)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("persistent", [False, True])
def test_iterable_epochs_equal_torchdatas(persistent):
    """With a stateful iterable (no shuffle involved), bridgeflow's batches before and after every resume
    equal torchdata's."""
    runs = []
    for cls in (StatefulDataLoader, DataLoader):
        torch.manual_seed(3)
        loader = make("iterable", cls, 2, persistent, False)
        ref, states = run(loader, set(POINTS))
        runs.append((ref, [resumed(make("iterable", cls, 2, persistent, False), s, p[0])
                           for p, (_, s) in sorted(states.items(), key=str)]))
        if cls is DataLoader:
            loader.close()
    assert runs[0] == runs[1]


def test_uninterrupted_shuffle_without_generator_is_torchs():
    """Keeping the next epoch's RNG in the state changes nothing uninterrupted: torch's order."""
    orders = []
    for cls in (tud.DataLoader, DataLoader):
        torch.manual_seed(5)
        loader = cls(Ids(), batch_size=BATCH, shuffle=True)
        orders.append([plain(b) for _ in range(EPOCHS) for b in loader])
    assert orders[0] == orders[1]


def test_a_restored_global_rng_is_followed():
    """A framework that restores torch's global RNG with the checkpoint (Accelerate does) continues the
    global stream: the loader then draws later epochs from it, as the uninterrupted run does, even when
    the training draws from it too."""
    torch.manual_seed(5)
    loader = DataLoader(Ids(), batch_size=BATCH, shuffle=True)
    it = iter(loader)
    next(it)
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest = [plain(b) for b in it]
    torch.rand(3)  # the training's own draws between epochs
    later = [plain(b) for b in loader]
    torch.manual_seed(99)
    again = DataLoader(Ids(), batch_size=BATCH, shuffle=True)
    torch.set_rng_state(rng)  # restored by the framework
    again.load_state_dict(state)
    assert [plain(b) for b in again] == rest
    torch.rand(3)
    assert [plain(b) for b in again] == later


def test_state_dict_with_workers_does_not_ask_this_process_copy(leak_check):
    """The dataset's state exists only once iter() ran in a worker: state_dict() must not ask the copy in
    this process (torchdata asks the workers only)."""

    class StateAfterIter(EpochCounted):
        def state_dict(self):
            return {"epoch": self.seen, "pos": self.pos}

        def __iter__(self):
            self.seen = getattr(self, "seen", -1) + 1
            return super().__iter__()

    loader = DataLoader(StateAfterIter(), batch_size=BATCH, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["dataset"] is None and state["workers"][0]["iter"]["epoch"] == 0
    loader.close()


@pytest.mark.parametrize("saved,loaded", [(3, 0), (0, 2), (2, 1)])
def test_a_state_of_another_worker_count_is_refused_before_any_batch(saved, loaded, leak_check):
    from bridgeflow.adapters.torch import ResumeStateError

    loader = DataLoader(Ids(), batch_size=BATCH, num_workers=saved)
    it = iter(loader)  # no batch delivered yet
    state = loader.state_dict()
    loader.close()
    del it
    with pytest.raises(ResumeStateError, match=f"num_workers={saved}.*num_workers={loaded}"):
        DataLoader(Ids(), batch_size=BATCH, num_workers=loaded).load_state_dict(state)


def test_torchdata_constructor_keyword():
    loader = DataLoader(Ids(), batch_size=BATCH, snapshot_every_n_steps=4)
    assert loader.snapshot_every_n_steps == 4 and len(list(loader)) == 5
    assert DataLoader(Ids(), snapshot_every_n_steps=None).snapshot_every_n_steps is None
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="snapshot_every_n_steps"):
            DataLoader(Ids(), snapshot_every_n_steps=bad)


class WorkerRng(tud.Dataset):
    """Samples drawn from the worker's torch RNG, which is also the dataset's state (torchdata's
    DummyMapDataset): only the uninterrupted run's worker seeds give the same samples."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, torch.randint(1000, ()).item()

    def state_dict(self):
        return {"rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_taken_before_iter_resumes_in_a_new_process(persistent, leak_check):
    """torchdata's TestInitialState: the state of a loader never iterated, loaded in a process whose global
    RNG differs, gives the uninterrupted run's workers' seeds and samples (the first epoch's draws start
    where the state says)."""
    torch.manual_seed(3)
    loader = DataLoader(WorkerRng(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=persistent)
    state = saved(loader)
    ref = [plain(b) for _ in range(2) for b in loader]
    loader.close()
    torch.manual_seed(4)
    again = DataLoader(WorkerRng(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=persistent)
    again.load_state_dict(state)
    assert [plain(b) for _ in range(2) for b in again] == ref
    again.close()
