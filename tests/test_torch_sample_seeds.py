"""``DataLoader(seed_per_sample=True)``: a sample's random augmentation is a function of its place in the epoch
(issue 39). The same bytes at 0, 1 and 2 workers, after a resume at any point (mid-epoch, between epochs, in
the next epoch), with persistent workers and with ``in_order=False``; the training loop's own generators are
left as they were with ``num_workers=0``. The SIGKILLed training loop is ``tests/torch_augment_loop.py``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
from deaths import once

from conftest import need

need("torch")

import torch
import torch.utils.data as tud

from bridgeflow import imgaug
from bridgeflow.adapters.torch import DataLoader

HERE = os.path.dirname(os.path.abspath(__file__))
N, BATCH = 26, 4  # 7 batches an epoch, the last one short


class Augmenting(tud.Dataset):
    """An image per index, augmented by bridgeflow's augmentors, with a draw from each global generator."""

    augs = imgaug.AugmentorList([imgaug.RandomCrop(6), imgaug.Flip(horiz=True), imgaug.Brightness(40)])

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        img = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3) + np.uint8(i)
        return self.augs.augment(img), torch.rand(2), np.random.rand(2), random.random(), i


class Quiet(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i


def loader(workers: int, dataset: type = Augmenting, **kwargs) -> DataLoader:
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True, num_workers=workers, seed_per_sample=True,
                      generator=torch.Generator().manual_seed(5), **kwargs)


def as_bytes(batch) -> list:
    return [t.numpy().tobytes() if isinstance(t, torch.Tensor) else repr(t) for t in batch]


def run(make, epochs: int = 2, cuts=(), state=None) -> tuple[list, dict]:
    """Every batch of ``epochs`` epochs (as bytes), and the states after each count of batches in ``cuts``,
    through JSON."""
    df = make()
    if state is not None:
        df.load_state_dict(state)
    out, states = [], {}
    try:
        for _ in range(epochs):
            for batch in df:
                out.append(as_bytes(batch))
                if len(out) in cuts:
                    states[len(out)] = json.loads(json.dumps(df.state_dict()))
    finally:
        df.close()
    return out, states


CUTS = (3, 7, 9)  # mid-epoch, at the epoch's end, in the second epoch


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_the_same_bytes_at_any_worker_count_and_after_a_resume(workers, leak_check):
    ref, _ = run(lambda: loader(2))
    full, states = run(lambda: loader(workers), cuts=CUTS)
    assert full == ref
    for k, state in states.items():
        torch.manual_seed(k)  # a new process: other global generators
        np.random.seed(k)
        resumed, _ = run(lambda: loader(workers), epochs=2 - (k - 1) // 7, state=state)
        assert resumed == ref[k:], k


def test_without_it_the_bytes_follow_the_workers_streams(leak_check):
    """torch's semantics (the default): the draws depend on the worker count, and a resume redraws them."""
    make = lambda w: DataLoader(Augmenting(), batch_size=BATCH, shuffle=True, num_workers=w,
                                generator=torch.Generator().manual_seed(5))
    ref, states = run(lambda: make(2), cuts=(3,))
    assert run(lambda: make(1))[0] != ref
    resumed, _ = run(lambda: make(2), state=states[3])
    assert [b[-1] for b in resumed] == [b[-1] for b in ref[3:]]  # the same samples
    assert resumed != ref[3:]  # other augmentations


def test_persistent_workers_draw_anew_each_epoch_and_resume(leak_check):
    make = lambda: loader(2, persistent_workers=True)
    ref, states = run(make, epochs=3, cuts=(7, 10, 16))
    epochs = [ref[:7], ref[7:14], ref[14:]]
    assert [b[-1] for b in epochs[0]] != [b[-1] for b in epochs[1]]
    images = lambda e: {(b[-1], b[0]) for b in e}
    assert not images(epochs[0]) & images(epochs[1])  # the base seed is kept: the epochs still differ
    for k, state in states.items():
        assert state.get("reuse", 0) == (k - 1) // 7  # epochs run on the base seed before this one
        resumed, _ = run(make, epochs=3 - (k - 1) // 7, state=state)
        assert resumed == ref[k:], k


def test_in_order_false_gives_the_same_batches(leak_check):
    ref, _ = run(lambda: loader(2))
    got, _ = run(lambda: loader(2, in_order=False))
    assert sorted(got) == sorted(ref)


class Gaussian(Augmenting):
    def __getitem__(self, i: int):
        return (*super().__getitem__(i), np.random.randn())  # leaves one of numpy's Gaussian pair pending


@pytest.mark.parametrize("pending", [False, True], ids=["", "a-gaussian-pending"])
def test_the_training_loops_generators_are_left_alone_without_workers(pending, leak_check):
    """With num_workers=0 the samples are read in the training process: its generators are put back after each
    sample, so what the loop draws between batches is what it would draw had the dataset drawn nothing (numpy's
    pending legacy Gaussian included, the loop's or the dataset's)."""
    after = []
    for dataset in (Gaussian, Quiet):
        torch.manual_seed(1)
        np.random.seed(1)
        random.seed(1)
        if pending:
            np.random.randn()
        draws = []
        for _ in loader(0, dataset):
            draws.append((torch.rand(()).item(), np.random.randn(), np.random.rand(), random.random()))
        after.append(draws)
    assert after[0] == after[1]


def test_seed_per_sample_is_a_flag():
    with pytest.raises(TypeError, match="seed_per_sample should be True or False"):
        DataLoader(Quiet(), seed_per_sample=1)
    assert DataLoader(Quiet(), seed_per_sample=True).seed_per_sample is True


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_killed_augmenting_training_loop_resumes_byte_for_byte(workers, tmp_path):
    """A training loop (a small model, SGD with momentum, images augmented in the Dataset), checkpointing model,
    optimizer and loader every 5 steps, SIGKILLed at step 12, resumed from step 10 in a new process: every later
    batch is the uninterrupted run's, byte for byte, and so are the final weights."""
    def phase(name: str) -> int:
        proc = subprocess.run([sys.executable, "torch_augment_loop.py", str(tmp_path), name, str(workers)],
                              capture_output=True, text=True, timeout=300, cwd=HERE)
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
        return proc.returncode

    assert [phase(p) for p in ("full", "killed", "resume")] == [0, -signal.SIGKILL, 0]
    read = lambda name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    full, killed, resumed = read("full"), read("killed"), read("resume")
    assert killed == full[:12] and [s["step"] for s in resumed] == list(range(10, len(full)))
    assert resumed == full[10:]  # each batch's bytes (a digest) and the weights after each step


class Faulty(Augmenting):
    """Augmenting, raising for the indices in ``bad`` and SIGKILLing the worker that reads ``kill`` (once)."""

    def __init__(self, bad=(), kill=None, flag="") -> None:
        self.bad, self.kill, self.flag = bad, kill, flag

    def __getitem__(self, i: int):
        if i == self.kill and once(self.flag):
            os.kill(os.getpid(), signal.SIGKILL)
        if i in self.bad:
            raise OSError(f"sample {i}: truncated file")
        return super().__getitem__(i)


def by_index(batches: list) -> dict:
    """Each sample's bytes (image and the three draws) by its index, from batches of ``run``."""
    out = {}
    for batch in batches:
        b = [t.numpy() for t in batch]  # as_bytes' collated columns, read again as arrays
        for j, i in enumerate(b[-1].tolist()):
            out[i] = tuple(col[j].tobytes() for col in b[:-1])
    return out


def run_columns(make) -> list:
    df = make()
    try:
        return [list(batch) for batch in df]
    finally:
        df.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_skipped_samples_leave_the_others_bytes_as_they_were(workers, leak_check):
    """on_error='skip' reads a batch with a failing sample again one sample at a time: each other sample keeps
    the seeds of its place in the batch, so its bytes are those of the run where nothing failed."""
    ref = by_index(run_columns(lambda: loader(2, dataset=Faulty)))
    got = by_index(run_columns(lambda: DataLoader(
        Faulty(bad={5, 17}), batch_size=BATCH, shuffle=True, num_workers=workers, seed_per_sample=True,
        generator=torch.Generator().manual_seed(5), on_error="skip")))
    assert sorted(got) == sorted(set(range(N)) - {5, 17})
    assert got == {i: ref[i] for i in got}


def test_a_replaced_worker_reads_its_batches_again_with_the_same_bytes(tmp_path, leak_check):
    """max_restarts: the batch a SIGKILLed worker held is read again by its replacement, sample by sample,
    each with the seeds of its place: the epoch's bytes are the undisturbed run's."""
    ref, _ = run(lambda: loader(2, dataset=Faulty), epochs=1)
    got, _ = run(lambda: DataLoader(
        Faulty(kill=11, flag=str(tmp_path / "once")), batch_size=BATCH, shuffle=True, num_workers=2,
        seed_per_sample=True, generator=torch.Generator().manual_seed(5), max_restarts=1), epochs=1)
    assert (tmp_path / "once").exists()  # the worker reading sample 11 was killed
    assert got == ref
