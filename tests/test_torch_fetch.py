"""The workers' task function (fetch.WorkerTask): a batch is collated straight into the shared-memory slab it
is sent in, whatever the samples' layout; what cannot leave a worker is named with its index."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from bridgeflow.parallel._transport import shm
from conftest import need

need("torch")

import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader
from bridgeflow.adapters.torch._fetch import MAP, WorkerSpec, WorkerTask


class Views(tud.Dataset):
    """CHW tensors made as torchvision's ``pil_to_tensor`` makes them: a permuted view of an HWC array."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        hwc = torch.from_numpy(np.full((64, 64, 3), i, np.uint8) + np.arange(3, dtype=np.uint8))
        return hwc.permute(2, 0, 1), i


def _task(dataset, writer, **spec):
    spec = WorkerSpec(**{"kind": MAP, "dataset": dataset, "auto_collation": True, "collate_fn": tud.default_collate,
                         "drop_last": False, "base_seed": 0, "num_workers": 1, **spec})
    return WorkerTask(spec, 0, dataset, writer=writer)


def _slab_of(writer, array):
    address = array.__array_interface__["data"][0]
    return [i for i, (_, size, m) in enumerate(writer.slabs)
            if m is not None and m.address <= address < m.address + size]


def test_a_batch_is_collated_in_the_slab_it_is_sent_in(leak_check):
    flags = memoryview(bytearray(8))
    writer = shm.SlabWriter(f"bftest{os.getpid()}_f_", flags, 8)
    reader = shm.SlabReader(flags)
    try:
        task = _task(Views(), writer)
        for first in (0, 4):  # the first batch starts a slab of its own size; the next one is sized alike
            images, labels = task([first, first + 1, first + 2, first + 3]).value
            assert _slab_of(writer, images.numpy())  # stacked in place
            message = writer.dumps([images, labels])
            assert len(message) < 2048  # offsets, no pixel
            got, ids = reader.loads(message)
            want = torch.stack([Views()[i][0] for i in range(first, first + 4)])
            assert torch.equal(got, want) and got.is_contiguous() and ids.tolist() == list(range(first, first + 4))
            del got, images
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_of_permuted_views_are_contiguous_as_torchs(num_workers, leak_check):
    ref = [x for x, _ in tud.DataLoader(Views(), batch_size=4, num_workers=num_workers)]
    with DataLoader(Views(), batch_size=4, num_workers=num_workers) as loader:
        got = [x for x, _ in loader]
    for a, b in zip(got, ref):
        assert torch.equal(a, b) and a.stride() == b.stride() and a.is_contiguous()


class ChannelsLast(tud.Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i):
        return torch.full((2, 3, 64, 64), float(i)).contiguous(memory_format=torch.channels_last)


def test_uncollated_tensors_of_any_layout_arrive_equal(leak_check):
    with DataLoader(ChannelsLast(), batch_size=None, num_workers=2) as loader:
        got = list(loader)
    assert [float(t[0, 0, 0, 0]) for t in got] == [0.0, 1.0, 2.0]
    assert all(t.shape == (2, 3, 64, 64) and torch.equal(t, ChannelsLast()[i]) for i, t in enumerate(got))


# --- what cannot leave a worker ---------------------------------------------------------------------------

class Holding(tud.Dataset):
    def __init__(self, what: str) -> None:
        self.what = what

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i):
        if i != 3:
            return torch.zeros(2), i
        held = open(os.devnull, "rb") if self.what == "file" else threading.Lock()
        return torch.zeros(2), held


class HoldingStream(tud.IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0
        yield torch.zeros(2), threading.Lock()


def _first_error(loader):
    with loader:
        with pytest.raises(TypeError) as info:
            list(loader)
    return str(info.value)


@pytest.mark.parametrize("what,type_name", [("file", "BufferedReader"), ("lock", "lock")])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_sample_that_cannot_leave_its_worker_is_named_with_its_index(what, type_name, batch_size, leak_check):
    message = _first_error(DataLoader(Holding(what), batch_size=batch_size, num_workers=2))
    assert "the sample at index 3" in message and type_name in message and "cannot be sent" in message


def test_with_a_custom_collate_the_batch_is_named_by_its_indices(leak_check):
    message = _first_error(DataLoader(Holding("lock"), batch_size=2, num_workers=2, collate_fn=list))
    assert "the batch of indices [2, 3]" in message and "lock" in message


def test_in_a_stream_the_batch_is_named_by_its_worker(leak_check):
    message = _first_error(DataLoader(HoldingStream(), batch_size=2, num_workers=1, collate_fn=list))
    assert "DataLoader worker 0: a batch of its stream" in message and "lock" in message
