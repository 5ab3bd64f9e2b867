"""CUDAPrefetcher over bridgeflow's DataLoader: the loader's slabs are page-locked through
``DataLoader.set_mapping_hooks`` and batches reach the device with no host copy; several iterations of one
prefetcher, over any source.

The GPU is stood for by ``DmaBackend`` (copies that run late, reading host memory by address) and the
page-locking by ``FakeRegistrar``; workers, slabs and mappings are real.
"""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest

import bridgeflow
from bridgeflow._errors import WorkerError
from conftest import need

need("torch")

import torch
import torch.utils.data as tud
from torch_backends import DmaBackend, FakePinnedMemory, FakeRegistrar, HostBackend

from bridgeflow.adapters.torch import CUDAPrefetcher, DataLoader
from bridgeflow.adapters.torch._pinning import SlabPinner


class Images(tud.Dataset):
    """Batches of 4 samples are 256 KiB: they travel through shared-memory slabs."""

    def __init__(self, n=40, die_at=None):
        self.n, self.die_at = n, die_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.die_at:
            os._exit(3)
        return {"x": np.full((16, 1024), i, np.float32), "y": i}


def _checked(backend):
    """Unregistering a slab while a copy that reads it has not run yet fails the test."""
    unregister = backend.reg.unregister

    def checked_unregister(address):
        assert not backend.reads_pending(address, address + backend.reg.ranges[address]), \
            "unregistered while a copy still reads the slab"
        unregister(address)

    backend.reg.unregister = checked_unregister
    return backend


# --- DataLoader.set_mapping_hooks ----------------------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
def test_the_slabs_of_the_loaders_pool_are_registered_and_unregistered(persistent, leak_check):
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    loader = DataLoader(Images(), batch_size=4, num_workers=2, persistent_workers=persistent)
    loader.set_mapping_hooks(pinner)
    for _epoch in range(2):
        batches = list(loader)
        assert [b["y"].tolist() for b in batches] == [[4 * k + j for j in range(4)] for k in range(10)]
        assert all(pinner.contains(b["x"].data_ptr()) for b in batches)  # batches lie in registered slabs
        del batches
        gc.collect()
        if not persistent:  # the pool closed with its epoch: nothing stays registered
            assert registrar.ranges == {}
    assert pinner.registrations > 0
    loader.close()
    gc.collect()
    assert registrar.ranges == {} and pinner.registered == {}


def test_hooks_set_during_an_epoch_reach_its_running_pool(leak_check):
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    loader = DataLoader(Images(), batch_size=4, num_workers=2)
    it = iter(loader)
    first = next(it)
    assert registrar.ranges == {}
    loader.set_mapping_hooks(pinner)  # the slabs mapped already are registered at once
    assert pinner.contains(first["x"].data_ptr())
    rest = list(it)
    assert all(pinner.contains(b["x"].data_ptr()) for b in rest)
    loader.set_mapping_hooks(None)  # removed: every registration undone, the batches still readable
    assert registrar.ranges == {} and rest[-1]["x"][0, 0, 0].item() == 36.0
    del it, first, rest


def _tenfold(dp):
    return [np.full((64, 1024), dp[0] * 10, np.float32)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hooks_reach_the_parallel_stages_of_a_dataflow_dataset(num_workers, leak_check):
    flow = bridgeflow.MultiProcessMapData(bridgeflow.DataFromList([[i] for i in range(12)], shuffle=False), 2,
                                          _tenfold)
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    with DataLoader(flow, batch_size=3, num_workers=num_workers) as loader:
        loader.set_mapping_hooks(pinner)
        assert [b[0][:, 0, 0].tolist() for b in loader] == [[30.0 * k + 10 * j for j in range(3)] for k in range(4)]
    assert pinner.registrations > 0  # the stage's own slabs (the loader's workers only collate)
    flow.close()
    gc.collect()
    assert registrar.ranges == {}


def test_a_pickled_loader_leaves_its_hooks_behind():
    loader = DataLoader(Images(), batch_size=4, num_workers=2)
    loader.set_mapping_hooks(SlabPinner(FakeRegistrar()))  # holds a lock: could not be pickled
    copy = pickle.loads(pickle.dumps(loader))
    assert copy._bf.mapping_hooks is None and [b["y"].tolist() for b in copy][0] == [0, 1, 2, 3]


# --- CUDAPrefetcher over the DataLoader ---------------------------------------------------------------

@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_prefetched_batches_are_read_in_place_from_the_loaders_slabs(pin_memory, persistent, leak_check):
    """Each batch's big tensor lies in a registered slab and is copied from there (zero copy); the copies
    run late (at the stager's waits) and read by address, so a slab that went back to its worker early
    would show in the values. With pin_memory=True the loader's pin thread hands registered tensors out
    as they are (the prefetcher holds each batch until its copies ran), so nothing more is copied."""
    backend = _checked(DmaBackend())
    loader = DataLoader(Images(), batch_size=4, num_workers=2, persistent_workers=persistent, pin_memory=pin_memory)
    pinned_memory = FakePinnedMemory(registrar=backend.reg)
    if pin_memory:
        loader._bf.pin_backend = pinned_memory
        backend.is_pinned = pinned_memory.is_pinned  # what the loader pinned is pinned for the "device" too
    prefetcher = CUDAPrefetcher(loader, num_stages=2, _backend=backend)
    for _epoch in range(2):
        got = list(prefetcher)
        backend.run_dma()
        assert [(b["x"].min().item(), b["x"].max().item()) for b in got] == [(4.0 * k, 4.0 * k + 3) for k in range(10)]
        assert [b["y"].tolist() for b in got] == [[4 * k + j for j in range(4)] for k in range(10)]
        del got
    stats = prefetcher.stats()
    assert prefetcher.pinner.registrations > 0
    assert stats["zero_copy"] == (40 if pin_memory else 20)  # every "x" (with pin_memory, the pinned "y" too)
    if pin_memory:  # the loader pinned only the small "y" tensors (in-band, not in a slab)
        assert stats["staged"] == 0 and pinned_memory.allocations == 20
    else:
        assert stats["staged"] == 20
    loader.close()
    gc.collect()
    assert backend.reg.ranges == {}


@pytest.mark.parametrize("how", ["worker_death", "ctrl_c", "break"])
@pytest.mark.parametrize("pin_memory", [False, True])
def test_prefetching_from_a_loader_ends_clean(how, pin_memory, leak_check):
    backend = _checked(DmaBackend())
    loader = DataLoader(Images(die_at=21 if how == "worker_death" else None), batch_size=4, num_workers=2,
                        pin_memory=pin_memory)
    loader._bf.pin_backend = FakePinnedMemory(registrar=backend.reg) if pin_memory else None
    prefetcher = CUDAPrefetcher(loader, num_stages=2, _backend=backend)
    expected = {"worker_death": WorkerError, "ctrl_c": KeyboardInterrupt, "break": None}[how]

    def run():
        for seen, batch in enumerate(prefetcher):
            assert batch["y"].shape == (4,)
            if how == "ctrl_c" and seen == 3:
                raise KeyboardInterrupt
            if how == "break" and seen == 3:
                break

    if expected is None:
        run()
    else:
        with pytest.raises(expected):
            run()
    gc.collect()
    assert prefetcher.pinner.registrations > 0 and prefetcher.stats()["zero_copy"] > 0
    assert backend.reg.ranges == {} and prefetcher.pinner.registered == {}


def test_the_loaders_slabs_are_unregistered_when_the_prefetcher_goes(leak_check):
    """Once no prefetcher holds its batches until copied, the loader's slabs must not stay page-locked:
    a training loop reading the loader directly could start a non-blocking copy and drop the batch."""
    backend = DmaBackend()
    loader = DataLoader(Images(), batch_size=4, num_workers=2, persistent_workers=True)
    prefetcher = CUDAPrefetcher(loader, _backend=backend)
    list(prefetcher)
    backend.run_dma()
    assert backend.reg.ranges  # persistent workers: the slabs stay mapped, and registered, between epochs
    del prefetcher
    gc.collect()
    assert backend.reg.ranges == {}
    batches = list(loader)  # read directly now: nothing registers
    assert backend.reg.ranges == {} and len(batches) == 10
    loader.close()


# --- several iterations of one prefetcher ---------------------------------------------------------------

def _flow():
    return bridgeflow.BatchData(bridgeflow.DataFromList([[np.full(2, i), i] for i in range(10)], shuffle=False), 4,
                                remainder=True)


SOURCES = {
    "dataflow": lambda: _flow(),
    "loader-over-flow": lambda: DataLoader(bridgeflow.DataFromList([[np.int64(i)] for i in range(10)], shuffle=False),
                                           batch_size=4, num_workers=2),
    "persistent-loader-over-flow": lambda: DataLoader(
        bridgeflow.DataFromList([[np.int64(i)] for i in range(10)], shuffle=False), batch_size=4, num_workers=2,
        persistent_workers=True),
    "map-loader": lambda: DataLoader([[np.int64(i)] for i in range(10)], batch_size=4, num_workers=2),
}


def _labels(batch):
    return batch[1].tolist() if isinstance(batch[0], torch.Tensor) and batch[0].dim() == 2 else batch[0].tolist()


@pytest.mark.parametrize("device", ["cpu", "fake-cuda"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_new_iteration_abandons_the_held_one(source, device, capfd, leak_check):
    """As Lightning does at each epoch: iter() again while the last iterator is still held. A flow has one
    reader; the prefetcher ends its previous iteration (threads joined, the source let go) first."""
    loader = SOURCES[source]()
    prefetcher = CUDAPrefetcher(loader, "cpu") if device == "cpu" else CUDAPrefetcher(loader, _backend=HostBackend())
    expected = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    first = iter(prefetcher)
    assert _labels(next(first)) == expected[0]
    second = iter(prefetcher)
    assert [_labels(b) for b in second] == expected
    assert list(first) == []  # abandoned: ended
    third = iter(prefetcher)
    assert _labels(next(third)) == expected[0]
    fourth = iter(prefetcher)
    del first, second, third
    assert [_labels(b) for b in fourth] == expected
    del fourth, prefetcher
    gc.collect()
    if isinstance(loader, DataLoader):
        loader.close()
        loader = loader.dataset
    if isinstance(loader, bridgeflow.DataFlow):
        loader.close()
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err


# --- on a GPU ----------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_gpu_the_pin_thread_gives_pinned_batches(leak_check):
    got = list(DataLoader(Images(), batch_size=4, num_workers=2, pin_memory=True))
    assert all(b["x"].is_pinned() and b["y"].is_pinned() for b in got)
    assert [b["y"].tolist() for b in got] == [[4 * k + j for j in range(4)] for k in range(10)]


@needs_cuda
def test_gpu_a_prefetcher_over_a_pinning_loader_reads_its_slabs_in_place(leak_check):
    loader = DataLoader(Images(), batch_size=4, num_workers=2, pin_memory=True, persistent_workers=True)
    prefetcher = CUDAPrefetcher(loader, "cuda")
    for _epoch in range(2):
        got = [(b["x"][:, 0, 0].tolist(), b["y"].tolist()) for b in prefetcher]
        assert got == [([4.0 * k + j for j in range(4)], [4 * k + j for j in range(4)]) for k in range(10)]
    stats = prefetcher.stats()
    assert stats["pinning_failure"] is None, stats["pinning_failure"]
    # "x" is read from the registered slab, "y" from the loader's pinned copy: nothing staged
    assert stats["zero_copy"] == 40 and stats["staged"] == 0 and stats["registered_slabs"] > 0
    loader.close()
    gc.collect()
    assert prefetcher.pinner.registered == {}


# --- resuming through a prefetcher ----------------------------------------------------------------------

def _ids(batch) -> list[int]:
    y = batch["y"] if isinstance(batch, dict) else batch[1]
    return [int(v) for v in y.reshape(-1).tolist()]


def _image_loader(**kwargs):
    return DataLoader(Images(24), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                      **kwargs)


def _image_flow():
    items = [[np.full((16, 1024), i, np.float32), i] for i in range(24)]
    return bridgeflow.BatchData(bridgeflow.DataFromList(items, shuffle=True, seed=2), 4)


@pytest.mark.parametrize("source", ["loader-2-workers", "loader-0-workers", "dataflow"])
@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_a_prefetcher_resumes_from_what_it_handed_out(source, k, leak_check):
    """The prefetcher fetches batches ahead of the loop; its state, and the loader's own state_dict() while
    the prefetcher reads it, are as of the last batch handed out, so a resume loses and repeats nothing."""
    make = {"loader-2-workers": lambda: _image_loader(num_workers=2), "loader-0-workers": lambda: _image_loader(),
            "dataflow": _image_flow}[source]
    with_backend = lambda src: CUDAPrefetcher(src, num_stages=2, _backend=HostBackend())

    src = make()
    whole = [_ids(b) for b in with_backend(src)] + [_ids(b) for b in with_backend(src)]  # two epochs
    src.close()

    src = make()
    prefetcher = with_backend(src)
    it = iter(prefetcher)
    got = [_ids(next(it)) for _ in range(k)]
    state = prefetcher.state_dict()
    assert src.state_dict() == state  # the loader (or flow) answers as its prefetcher does
    prefetcher.close()  # an early break: the batches fetched ahead are dropped...
    assert src.state_dict() == state  # ...and still not counted
    src.close()

    again = make()
    resumed = with_backend(again)
    resumed.load_state_dict(state)
    rest = [_ids(b) for b in resumed] + [_ids(b) for b in resumed]
    again.close()
    assert got + rest == whole, f"resumed after {k} batches"
