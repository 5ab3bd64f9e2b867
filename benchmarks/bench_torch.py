"""Benchmark: bridgeflow's torch DataLoader against torch.utils.data.DataLoader (the anchor), same run.

Every case runs a map-style dataset through both loaders with ``num_workers=2`` and ``fork``, one epoch
timed from ``iter()`` to exhaustion (worker start-up included, as in every non-persistent epoch),
repetitions interleaved (torch, bridgeflow, torch, ...) after a warm-up epoch each. Each line is one JSON
object: per loader the median seconds per epoch, samples/s, and CPU per sample of the **workers** and of the
**main process**; then the ratio torch_median / bridgeflow_median (and the median of the per-repetition
ratios) with the target, and the workers' CPU per sample of bridgeflow over torch's.

How CPU is read: the workers' from ``getrusage(RUSAGE_CHILDREN)`` across the epoch (both loaders join their
workers when an epoch ends, so they have been reaped; the script checks that no child is left), the main
process's from ``time.process_time()`` (all its threads). Persistent-worker cases keep one loader per side
for the whole run, so their workers' CPU is read once both loaders are closed and covers all their epochs
(start-up included once).

The shapes users bring (sizes as torch's, Hugging Face's and torchrec's examples use them):

- ``numpy``: 3x224x224 uint8 numpy arrays + an int label, batch 64 (ImageNet-sized, as torch's examples);
- ``tensor``: the same samples as torch tensors;
- ``transform_2ms``: numpy samples through a ~2 ms CPU-bound per-sample transform;
- ``pil_folder``: a folder of JPEGs (3,000 of 300-500 px, generated once into ``--data``) decoded with
  PIL (``Image.open().convert("RGB")``), RandomResizedCrop(224) and a random flip written as torchvision
  writes them (torchvision itself is not needed), and a CHW uint8 tensor made as torchvision's
  ``pil_to_tensor`` makes it (a permuted view of the HWC array), batch 64, shuffled;
- ``flow_decode``: the same JPEGs as bytes in an LMDB file, read as the README shows,
  ``DataLoader(MapData(LMDBSerializer.load(path), decode), batch_size=64)``, with ``num_workers=2`` against
  ``num_workers=0`` of the same loader (the anchor here), and torch's DataLoader over a ``Dataset`` that
  reads the same file's datapoints by index (``num_workers=2``) for reference;
- ``scalar_int``: an int per sample (an id, a click label), batch 4,096 (torchrec's DLRM examples train
  at 2,048-8,192 per rank), shuffled;
- ``dict_rows``: tabular rows as dicts, ``{"dense": float32[13], "label": int}`` (Criteo's 13 dense
  features, as in torchrec's DLRM example), batch 1,024, shuffled;
- ``nested``: nested dicts and lists of small arrays, ``{"image": uint8[3,32,32], "target": {"boxes":
  float32[4,4], "labels": int64[4]}, "views": [float32[8], float32[8]], "meta": {"id": int, "scale":
  float}}`` (CIFAR-sized images with detection-style targets), batch 128, shuffled;
- ``var_tokens``: ``{"input_ids": list of 16-128 ints, "label": int}`` (a tokenized text dataset, lengths up
  to run_glue's default max_seq_length=128), padded by a user ``collate_fn`` as Hugging Face's
  ``DataCollatorWithPadding`` pads (``input_ids``, ``attention_mask``, ``labels``), batch 256, shuffled;
- ``tokens_built``: the token lists built per sample in ``__getitem__`` (as a tokenizer called per item
  builds them), padded by the same ``collate_fn`` to torch tensors, batch 256, shuffled;
- ``var_tokens_512``: ``var_tokens`` at batch 512;
- ``ragged_lists``: a list of 3 arrays of different lengths per sample (``float32[8-256]``, ``int64[4-64]``,
  ``uint8[100-2000]``: features, ids, bytes), and a user ``collate_fn`` that returns the 3 lists of 64 arrays
  as they are (``[list(c) for c in zip(*samples)]``), batch 64, shuffled;
- ``first_batch_fork``, ``first_batch_spawn``: the time from ``iter()`` to the first batch of ``numpy``
  samples (worker start-up included) under each start method; the epoch ends at that first batch;
- ``strings_bytes``: ``(text str of 40-200 chars, raw bytes of 0.5-4 KB, int label)``, batch 256, shuffled
  (strings and bytes are collated into lists);
- ``no_collate``: ``batch_size=None`` (no auto-collation: ``default_convert`` per sample, one task per
  sample), the ``dict_rows`` samples;
- ``*_persistent``: ``numpy`` and ``dict_rows`` with ``persistent_workers=True`` (one loader per side,
  epochs on the same workers);
- ``*_pin``: ``numpy`` and ``dict_rows`` with ``pin_memory=True``, pinned by each loader's background
  thread. On a machine without an accelerator both loaders skip pinning (torch warns and pins nothing), so
  there the variant only shows the option costs nothing else;
- ``seed_per_sample``: bridgeflow's loader with ``seed_per_sample=True`` against itself without, at 0 and 2
  workers, over ints (the seeding's own cost) and over 64x64 images through three augmentors
  (:func:`bench_seed_per_sample`);
- ``lmdb_dataset``: bridgeflow's ``LMDBDataset`` (150 KB arrays) against a raw-lmdb ``Dataset`` in the same
  loader (:func:`bench_lmdb_dataset`), with CPU seconds per item;
- ``cuda`` (GPU machines only; one "skipped" line elsewhere): CUDAPrefetcher's host-to-device throughput
  from pageable input (staged by torch's ``copy_``, or as the prefetcher chooses), pinned and registered
  shared-memory input and bridgeflow's DataLoader output, against a raw pinned ``copy_`` of the same
  bytes; and a loop with a GPU step of known length (the copy should hide behind it).

``--busy N`` keeps N processes spinning on the CPU for the whole run (a machine with other work on it).

Run: python benchmarks/bench_torch.py [--reps 5] [--scale 1] [--cases scalar_int,dict_rows] [--busy 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import resource
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader as BFDataLoader

BATCH = 64
SHAPE = (3, 224, 224)
# ratio of torch's median epoch to bridgeflow's: at least this much (every case: never slower than torch)
TARGETS = {"numpy": 2.5, "tensor": 2.5, "pil_folder": 1.1, "flow_decode": 1.6}
DEFAULT_TARGET = 1.0
JPEGS = 3000
WORKERS = 2


class ImageDataset(tud.Dataset):
    """``n`` samples cycling over 64 distinct random images (reading them costs next to nothing)."""

    def __init__(self, n: int, as_tensor: bool = False, transform_ms: float = 0.0) -> None:
        rng = np.random.default_rng(0)
        self.images = [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(64)]
        if as_tensor:
            self.images = [torch.from_numpy(im) for im in self.images]
        self.n = n
        self.transform_s = transform_ms / 1000.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = self.images[i % 64]
        if self.transform_s:
            end = time.perf_counter() + self.transform_s  # stands for a CPU-bound augmentation
            while time.perf_counter() < end:
                pass
        return image, i


# --- the image-folder and DataFlow cases -----------------------------------------------------------

def make_jpegs(folder: str, n: int = JPEGS) -> list[str]:
    """``n`` JPEGs of 300-500 px a side (smooth colour fields with noise, quality 90), made once."""
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"{i:05d}.jpg") for i in range(n)]
    if all(os.path.exists(p) for p in paths):
        return paths
    rng = np.random.default_rng(0)
    for path in paths:
        w, h = (int(v) for v in rng.integers(300, 501, 2))
        coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((w, h), Image.BILINEAR)
        pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
        tmp = f"{path}.tmp{os.getpid()}"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(tmp, "JPEG", quality=90)
        os.replace(tmp, path)
    return paths


def random_resized_crop(img, size: int = 224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's ``RandomResizedCrop(size)`` on a PIL image (its ``get_params``, then crop and
    bilinear resize), drawing from torch's RNG as torchvision does."""
    import math

    from PIL import Image

    width, height = img.size
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            break
    else:  # central crop
        in_ratio = width / height
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            w, h = int(round(height * max(ratio))), height
        else:
            w, h = width, height
        i, j = (height - h) // 2, (width - w) // 2
    return img.crop((j, i, j + w, i + h)).resize((size, size), Image.BILINEAR)


def augment(img):
    """RandomResizedCrop(224) + RandomHorizontalFlip, then torchvision's ``pil_to_tensor``: the HWC array
    viewed as CHW by a permute (not contiguous)."""
    from PIL import Image

    img = random_resized_crop(img)
    if torch.rand(1) < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    t = torch.as_tensor(np.array(img, copy=True))
    return t.view(img.size[1], img.size[0], 3).permute((2, 0, 1))


class ImageFolder(tud.Dataset):
    """A user's image-folder dataset: a list of files, decoded with PIL per item."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image

        with open(self.paths[i], "rb") as f:
            img = Image.open(f).convert("RGB")
        return augment(img), i % 1000


def decode(dp):
    """The DataFlow case's map: JPEG bytes to an augmented CHW tensor."""
    import io

    from PIL import Image

    return [augment(Image.open(io.BytesIO(dp[0])).convert("RGB")), dp[1]]


def make_lmdb(paths: list[str], path: str) -> str:
    from bridgeflow import DataFromList, LMDBSerializer

    if not os.path.exists(path):
        rows = []
        for i, p in enumerate(paths):
            with open(p, "rb") as f:
                rows.append([np.frombuffer(f.read(), np.uint8), i % 1000])
        LMDBSerializer.save(DataFromList(rows, shuffle=False), path, progress=False)
    return path


class IndexedLMDB(tud.Dataset):
    """torch's side of the DataFlow case: the same file's datapoints by index, decoded per item."""

    def __init__(self, path: str) -> None:
        from bridgeflow import LMDBSerializer

        self.ds = LMDBSerializer.load(path, shuffle=False)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return decode(self.ds[i])


# --- the shapes users bring ---------------------------------------------------------------------------

class Scalars(tud.Dataset):
    """An int per sample."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return i


class DictRows(tud.Dataset):
    """Tabular rows: ``{"dense": float32[13], "label": int}``, each row an array of its own."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.dense = list(rng.standard_normal((n, 13)).astype(np.float32))
        self.labels = rng.integers(0, 2, n).tolist()

    def __len__(self) -> int:
        return len(self.dense)

    def __getitem__(self, i: int):
        return {"dense": self.dense[i], "label": self.labels[i]}


class Nested(tud.Dataset):
    """Nested dicts and lists of small arrays (256 distinct samples, cycled)."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.n = n
        self.pool = [{"image": rng.integers(0, 256, (3, 32, 32), dtype=np.uint8),
                      "target": {"boxes": rng.random((4, 4), dtype=np.float32),
                                 "labels": rng.integers(0, 80, 4)},
                      "views": [rng.random(8, dtype=np.float32), rng.random(8, dtype=np.float32)]}
                     for _ in range(256)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        s = self.pool[i % 256]
        return {"image": s["image"], "target": s["target"], "views": s["views"],
                "meta": {"id": i, "scale": 1.0 + (i % 7) / 10}}


class Tokens(tud.Dataset):
    """Tokenized text: ``{"input_ids": list of 16-128 ints, "label": int}`` (lists, as datasets give them)."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        lengths = rng.integers(16, 129, n)
        self.ids = [rng.integers(1, 30522, k).tolist() for k in lengths]
        self.labels = rng.integers(0, 2, n).tolist()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "label": self.labels[i]}


def pad_collate(samples: list) -> dict:
    """A user's padding ``collate_fn``, as Hugging Face's ``DataCollatorWithPadding`` pads: to the longest."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = torch.tensor(s["input_ids"])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["label"] for s in samples])}


class BuiltTokens(tud.Dataset):
    """Token lists built per sample in ``__getitem__`` (16-128 ints each), as a tokenizer called per item
    builds them."""

    def __init__(self, n: int) -> None:
        self.lengths = np.random.default_rng(0).integers(16, 129, n).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        return {"input_ids": [(i * 7919 + k * 104729) % 30522 for k in range(self.lengths[i])], "label": i % 2}


def _tokens_512(n: int) -> Any:
    return Tokens(n)


class Ragged(tud.Dataset):
    """A list of 3 arrays of different lengths per sample (512 distinct samples, cycled)."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.n = n
        self.pool = [[rng.random(int(rng.integers(8, 257)), dtype=np.float32),
                      rng.integers(0, 1 << 20, int(rng.integers(4, 65))),
                      rng.integers(0, 256, int(rng.integers(100, 2001)), dtype=np.uint8)] for _ in range(512)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.pool[i % 512]


def list_collate(samples: list) -> list:
    """A user's ``collate_fn`` for ragged samples: the components as lists, nothing stacked."""
    return [list(c) for c in zip(*samples)]


class StringsBytes(tud.Dataset):
    """``(text, raw bytes, label)`` (512 distinct samples, cycled)."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        words = ["data", "loader", "worker", "tensor", "batch", "sample", "epoch", "shared", "memory", "token"]
        self.n = n
        self.pool = []
        for _ in range(512):
            text = " ".join(words[int(k)] for k in rng.integers(0, len(words), 40))[:int(rng.integers(40, 201))]
            self.pool.append((text, rng.integers(0, 256, int(rng.integers(512, 4097)), dtype=np.uint8).tobytes()))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        text, raw = self.pool[i % 512]
        return text, raw, i % 10


@dataclass
class Case:
    """A dataset (made once per case), how many samples, and the loader's arguments (both loaders')."""

    dataset: Callable[[int], Any]
    samples: int
    options: dict = field(default_factory=dict)
    persistent: bool = False
    context: str = "fork"  # the start method, both loaders'
    first_only: bool = False  # an epoch ends at its first batch: the time to first batch


def _images(n: int) -> Any:
    return ImageDataset(n)


def _tensors(n: int) -> Any:
    return ImageDataset(n, as_tensor=True)


def _transformed(n: int) -> Any:
    return ImageDataset(n, transform_ms=2.0)


CASES = {
    "numpy": Case(_images, 100 * BATCH, {"batch_size": BATCH}),
    "tensor": Case(_tensors, 100 * BATCH, {"batch_size": BATCH}),
    "transform_2ms": Case(_transformed, 25 * BATCH, {"batch_size": BATCH}),
    "scalar_int": Case(Scalars, 150 * 4096, {"batch_size": 4096, "shuffle": True}),
    "dict_rows": Case(DictRows, 100 * 1024, {"batch_size": 1024, "shuffle": True}),
    "nested": Case(Nested, 100 * 128, {"batch_size": 128, "shuffle": True}),
    "var_tokens": Case(Tokens, 60 * 256, {"batch_size": 256, "shuffle": True, "collate_fn": pad_collate}),
    "tokens_built": Case(BuiltTokens, 60 * 256, {"batch_size": 256, "shuffle": True, "collate_fn": pad_collate}),
    "var_tokens_512": Case(_tokens_512, 40 * 512, {"batch_size": 512, "shuffle": True, "collate_fn": pad_collate}),
    "ragged_lists": Case(Ragged, 150 * 64, {"batch_size": 64, "shuffle": True, "collate_fn": list_collate}),
    "first_batch_fork": Case(_images, 100 * BATCH, {"batch_size": BATCH}, first_only=True),
    "first_batch_spawn": Case(_images, 100 * BATCH, {"batch_size": BATCH}, context="spawn", first_only=True),
    "strings_bytes": Case(StringsBytes, 60 * 256, {"batch_size": 256, "shuffle": True}),
    "no_collate": Case(DictRows, 10_000, {"batch_size": None, "shuffle": True}),
    "numpy_persistent": Case(_images, 100 * BATCH, {"batch_size": BATCH, "persistent_workers": True},
                             persistent=True),
    "dict_rows_persistent": Case(DictRows, 100 * 1024, {"batch_size": 1024, "shuffle": True,
                                                         "persistent_workers": True}, persistent=True),
    "numpy_pin": Case(_images, 100 * BATCH, {"batch_size": BATCH, "pin_memory": True}),
    "dict_rows_pin": Case(DictRows, 100 * 1024, {"batch_size": 1024, "shuffle": True, "pin_memory": True}),
}


# --- timing ---------------------------------------------------------------------------------------------

def children_cpu() -> float:
    """CPU seconds of this process's children that have been waited for (the workers of ended epochs)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def reap(persistent: bool = False) -> None:
    """Collect what an epoch left and wait for its workers: their CPU time is then counted (persistent
    workers stay: only the garbage is collected)."""
    gc.collect()
    if persistent:
        return
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:  # also reaps the ended ones
        time.sleep(0.01)
    left = multiprocessing.active_children()
    if left:
        raise RuntimeError(f"workers still alive after the epoch: {left}")


@dataclass
class Epoch:
    seconds: float
    first_s: float
    batches: int
    main_cpu: float  # this process, all threads
    worker_cpu: float | None  # None: read once for the whole run (persistent workers)


def timed_epoch(loader_or_make: Any, persistent: bool = False, first_only: bool = False) -> Epoch:
    """One epoch from ``iter()`` to exhaustion (a fresh loader from ``loader_or_make()`` unless persistent), or
    to its first batch (``first_only``: the loader is then dropped, its workers stopped and reaped)."""
    reap(persistent)
    kids0, main0 = children_cpu(), time.process_time()
    start = time.perf_counter()
    loader = loader_or_make if persistent else loader_or_make()
    first, batches = None, 0
    for _ in loader:  # the batch is dropped at once, as a training step would drop it
        if first is None:
            first = time.perf_counter() - start
        batches += 1
        if first_only:
            break
    elapsed = first if first_only else time.perf_counter() - start
    main = time.process_time() - main0
    if persistent:
        return Epoch(elapsed, first, batches, main, None)
    del loader, _
    reap()
    return Epoch(elapsed, first, batches, main, children_cpu() - kids0)


def compare(case: str, loaders: dict[str, Callable[[], Any]], reps: int, machine: dict, anchor: str,
            target: float | None, samples: int, persistent: bool = False, extra: dict | None = None,
            first_only: bool = False) -> None:
    """Time ``loaders`` (name -> a function making a fresh loader) interleaved ``reps`` times after a
    warm-up epoch each; print one line per loader and the ratio of every other loader to ``anchor``.
    ``persistent``: each function is called once, its loader runs every epoch and is closed at the end."""
    made = {name: make() for name, make in loaders.items()} if persistent else loaders
    whole_run_cpu: dict[str, float] = {}
    runs: dict[str, list[Epoch]] = {name: [] for name in loaders}
    try:
        for name in loaders:
            timed_epoch(made[name], persistent, first_only)
        for _ in range(reps):
            for name in loaders:
                runs[name].append(timed_epoch(made[name], persistent, first_only))
    finally:
        if persistent:  # one loader at a time, so each one's reaped workers are told apart
            for name in list(made):
                loader = made.pop(name)
                workers = list(getattr(loader._iterator, "_workers", None) or ())
                before = children_cpu()
                close = getattr(loader, "close", None)
                if callable(close):
                    close()
                del loader
                gc.collect()
                for proc in workers:
                    proc.join(10)
                whole_run_cpu[name] = children_cpu() - before
            reap()
    med: dict[str, float] = {}
    worker_cpu: dict[str, float] = {}
    for name, rs in runs.items():
        med[name] = statistics.median(r.seconds for r in rs)
        if persistent:
            worker_cpu[name] = whole_run_cpu[name] / (samples * (reps + 1))
        else:
            worker_cpu[name] = statistics.median(r.worker_cpu for r in rs) / samples
        print(json.dumps({
            "bench": "torch_dataloader", "case": case, "loader": name, "reps": reps, "samples": samples,
            "batches": rs[0].batches, "num_workers": WORKERS, "median_s": round(med[name], 4),
            "samples_per_s": round(samples / med[name], 1),
            "worker_cpu_us_per_sample": round(worker_cpu[name] * 1e6, 3),
            "main_cpu_us_per_sample": round(statistics.median(r.main_cpu for r in rs) / samples * 1e6, 3),
            "first_batch_median_s": round(statistics.median(r.first_s for r in rs), 4),
            "all_s": [round(r.seconds, 3) for r in rs], **(extra or {}), **machine}), flush=True)
    for name in loaders:
        if name != anchor:
            ratio = med[anchor] / med[name]
            # each repetition's pair ran back to back: its ratio sees the same load on the machine
            paired = statistics.median(a.seconds / b.seconds for a, b in zip(runs[anchor], runs[name]))
            print(json.dumps({"bench": "torch_dataloader", "case": case, "loader": name, "anchor": anchor,
                              "ratio": round(ratio, 3), "paired_ratio": round(paired, 3), "target": target,
                              "meets_target": None if target is None else ratio >= target,
                              "worker_cpu_ratio": round(worker_cpu[name] / max(worker_cpu[anchor], 1e-12), 3),
                              "worker_cpu_target_max": 1.0 if target is not None else None}), flush=True)


def bench_case(name: str, case: Case, reps: int, scale: float, machine: dict) -> None:
    samples = max(1, int(case.samples * scale))
    dataset = case.dataset(samples)

    def make(cls):
        return lambda: cls(dataset, num_workers=WORKERS, multiprocessing_context=case.context, **case.options)

    options = {k: v.__name__ if callable(v) else v for k, v in case.options.items()}
    per_epoch = case.options.get("batch_size") or 1 if case.first_only else samples  # CPU per sample of what ran
    compare(name, {"torch": make(tud.DataLoader), "bridgeflow": make(BFDataLoader)}, reps, machine, "torch",
            TARGETS.get(name, DEFAULT_TARGET), per_epoch, case.persistent,
            {"options": options, "context": case.context}, case.first_only)


def bench_pil_folder(reps: int, machine: dict, data: str) -> None:
    dataset = ImageFolder(make_jpegs(os.path.join(data, "jpegs")))

    def make(cls):
        return lambda: cls(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                           multiprocessing_context="fork")

    compare("pil_folder", {"torch": make(tud.DataLoader), "bridgeflow": make(BFDataLoader)}, reps, machine,
            "torch", TARGETS["pil_folder"], len(dataset), extra={"batch": BATCH})


def bench_flow_decode(reps: int, machine: dict, data: str) -> None:
    from bridgeflow import LMDBSerializer, MapData

    path = make_lmdb(make_jpegs(os.path.join(data, "jpegs")), os.path.join(data, "jpegs.lmdb"))

    def flow(workers: int):
        context = "fork" if workers else None
        return lambda: BFDataLoader(MapData(LMDBSerializer.load(path), decode), batch_size=BATCH,
                                    num_workers=workers, multiprocessing_context=context)

    def torch_loader():
        return tud.DataLoader(IndexedLMDB(path), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                              multiprocessing_context="fork")

    compare("flow_decode", {"bridgeflow_workers_0": flow(0), "bridgeflow_workers_2": flow(2),
                            "torch_indexed_workers_2": torch_loader}, reps, machine, "bridgeflow_workers_0",
            None, JPEGS, extra={"batch": BATCH})
    print(json.dumps({"bench": "torch_dataloader", "case": "flow_decode", "target": TARGETS["flow_decode"],
                      "note": "the target is bridgeflow_workers_2's ratio to bridgeflow_workers_0"}), flush=True)


class Augmented(tud.Dataset):
    """64x64x3 images through bridgeflow's augmentors (a crop, a flip, a brightness change) and a torch draw."""

    def __init__(self, n: int) -> None:
        from bridgeflow import imgaug

        self.n = n
        self.image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        self.augs = imgaug.AugmentorList([imgaug.RandomCrop(56), imgaug.Flip(horiz=True), imgaug.Brightness(30)])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.augs.augment(self.image), torch.rand(()), i


def bench_seed_per_sample(reps: int, scale: float, machine: dict) -> None:
    """``seed_per_sample=True`` against the same loader without it (the anchor), at 0 and 2 workers: samples of
    an int (the seeding alone) and augmented 64x64 images. The cost per sample is the difference of the CPU
    figures (the workers' with workers, the main process's without)."""
    for name, dataset, samples, batch in (("seed_per_sample_int", Scalars, int(20_000 * scale), 256),
                                          ("seed_per_sample_augment", Augmented, int(4_000 * scale), 64)):
        ds = dataset(samples)
        for workers in (0, 2):
            def make(seeded: bool, workers: int = workers, ds: Any = ds, batch: int = batch) -> Callable[[], Any]:
                return lambda: BFDataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                            multiprocessing_context="fork" if workers else None,
                                            seed_per_sample=seeded)

            compare(f"{name}_workers_{workers}", {"bridgeflow": make(False), "bridgeflow_seeded": make(True)},
                    reps, machine, "bridgeflow", None, samples, extra={"batch": batch, "workers": workers})


def _median_time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


class _ShmBatches:
    """Batches that lie in one shared-memory mapping, announced to the slab-mapping hook as the core
    announces a worker's slab (``set_mapping_hooks`` / ``opened`` / ``closing``): with CUDAPrefetcher's
    pinner attached, the mapping is page-locked and the batches are copied from where they lie."""

    def __init__(self, source: list, batches: int) -> None:
        import mmap

        self.batches = batches
        self.nbytes = sum(t.numel() for t in source)
        path = f"/dev/shm/bf{os.getpid()}_bench_torch"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self.mm = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
            os.unlink(path)
        self.address = np.frombuffer(self.mm, np.uint8).ctypes.data
        self.views, off = [], 0
        for t in source:
            v = torch.frombuffer(self.mm, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
            v.copy_(t)
            self.views.append(v)
            off += t.numel() * t.element_size()
        self.hooks = None

    def set_mapping_hooks(self, hooks) -> None:
        self.hooks = hooks
        hooks.opened(self.mm, self.address, self.nbytes)

    def __iter__(self):
        return (self.views[i % len(self.views)] for i in range(self.batches))

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.closing(self.mm, self.address, self.nbytes)
        self.views = []


class _WholeBatches(tud.Dataset):
    """Each item is a finished batch (a worker returns it as is): the loader's transport is what is timed."""

    def __init__(self, source: list, n: int) -> None:
        self.source = [t.numpy() for t in source]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.source[i % len(self.source)]


def bench_cuda(reps: int, batches: int, machine: dict) -> None:
    """GPU cases: CUDAPrefetcher's host-to-device throughput from each kind of input (pageable, staged by
    one or several threads; pinned; a registered shared-memory mapping, read in place; the output of
    bridgeflow's DataLoader with 2 workers) against a raw pinned ``copy_`` of the same bytes, and a loop
    whose GPU step takes a known time (the copy should hide behind it)."""
    from bridgeflow.adapters.torch import CUDAPrefetcher

    if not torch.cuda.is_available():
        print(json.dumps({"bench": "torch_cuda", "skipped": "no CUDA device on this machine", **machine}))
        return
    machine = {**machine, "gpu": torch.cuda.get_device_name()}
    shape = (BATCH, *SHAPE)
    nbytes = int(np.prod(shape))
    rng = np.random.default_rng(0)
    pageable = [torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(4)]
    pinned = [t.pin_memory() for t in pageable]
    dev = torch.empty(shape, dtype=torch.uint8, device="cuda")

    def raw_copy():
        for i in range(batches):
            dev.copy_(pinned[i % 4], non_blocking=True)

    def prefetch(source, **kwargs):
        def run():
            for _ in CUDAPrefetcher([source[i % 4] for i in range(batches)], device="cuda", **kwargs):
                pass
        return run

    registered = _ShmBatches(pageable, batches)
    registered_prefetcher = CUDAPrefetcher(registered, device="cuda")

    def prefetch_registered():
        for _ in registered_prefetcher:
            pass

    loader = BFDataLoader(_WholeBatches(pageable, batches), batch_size=None, num_workers=2,
                          persistent_workers=True)
    loader_prefetcher = CUDAPrefetcher(loader, device="cuda")  # one for the run: slabs are registered once

    def prefetch_loader():
        for _ in loader_prefetcher:
            pass

    cases = {"raw_pinned_copy": raw_copy, "prefetcher_pageable_in": prefetch(pageable),
             "prefetcher_pageable_in_torch_copy_": prefetch(pageable, copy_threads=1),
             "prefetcher_pinned_in": prefetch(pinned), "prefetcher_registered_shm_in": prefetch_registered,
             "prefetcher_bf_dataloader_2_workers": prefetch_loader}
    for fn in cases.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            times[name] += _median_time(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, m in med.items():
        print(json.dumps({"bench": "torch_cuda", "case": "h2d_throughput", "variant": name, "reps": reps,
                          "GB_per_s": round(batches * nbytes / m / 1e9, 2), "median_s": round(m, 4),
                          **machine}))
    print(json.dumps({"bench": "torch_cuda", "case": "h2d_throughput", "variant": "prefetcher_registered_shm_in",
                      "prefetcher": registered_prefetcher.stats()}))
    for name in cases:
        if name != "raw_pinned_copy":
            print(json.dumps({"bench": "torch_cuda", "case": "h2d_throughput", "variant": name,
                              "ratio_vs_raw_pinned_copy": round(med["raw_pinned_copy"] / med[name], 3),
                              "target": 0.85}))

    # A step of known length: a chain of matmuls whose time is measured alone first.
    a = torch.randn(2048, 2048, device="cuda")
    copy_per_batch = med["raw_pinned_copy"] / batches
    k = 1
    while statistics.median(_median_time(lambda k=k: [a @ a for _ in range(k)], 3)) < 2 * copy_per_batch:
        k *= 2

    def step(x):
        for _ in range(k):
            a @ a
        return x.float().mean()

    step_alone = statistics.median(_median_time(lambda: [step(dev) for _ in range(batches)], reps)) / batches

    def loop(source):
        def run():
            for x in source():
                step(x)
        return run

    loops = {"pageable_in": loop(lambda: CUDAPrefetcher([pageable[i % 4] for i in range(batches)], device="cuda")),
             "registered_shm_in": loop(lambda: registered_prefetcher)}
    for name, fn in loops.items():
        fn()
        per_batch = statistics.median(_median_time(fn, reps)) / batches
        bound = max(step_alone, copy_per_batch)
        print(json.dumps({"bench": "torch_cuda", "case": "overlap", "variant": name,
                          "step_s": round(step_alone, 5), "copy_s": round(copy_per_batch, 5),
                          "loop_per_batch_s": round(per_batch, 5),
                          "ratio_vs_max_step_copy": round(per_batch / bound, 3),
                          "target_max": 1.1, **machine}))
    registered.close()
    loader.close()


LMDB_ITEM = 150_000  # bytes of the array in each lmdb_dataset datapoint


class RawLMDBDataset(tud.Dataset):
    """The twelve-line Dataset a user writes over an LMDB file written by LMDBSerializer: each worker opens
    the environment once (after fork) and reads a value per item; the array lies just before the CRC."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n, self.txn = path, n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.txn is None:
            import lmdb

            self.txn = lmdb.open(self.path, subdir=False, readonly=True, lock=False, readahead=False).begin()
        value = self.txn.get(i.to_bytes(8, "big"))
        return np.frombuffer(value, np.uint8, LMDB_ITEM, len(value) - 4 - LMDB_ITEM), i


class IndexedView(tud.Dataset):
    """A random-access flow seen as a map-style Dataset (``len()`` and ``flow[i]``): how a loader that reads
    such a flow in its workers reads it."""

    def __init__(self, flow) -> None:
        self.flow = flow

    def __len__(self) -> int:
        return len(self.flow)

    def __getitem__(self, i: int):
        return self.flow[i]


def bench_lmdb_dataset(reps: int, batches: int, machine: dict) -> None:
    """``LMDBDataset`` in bridgeflow's DataLoader against a raw-lmdb Dataset in the same loader (150 KB
    arrays + an int label, 2 workers, batch 64, file in the page cache). Rows: the LMDBDataset passed as
    it is (a DataFlow: the loader decides how to read it), the same reader seen as a map-style Dataset
    (its per-item reads in the workers), and the anchor; ratios of anchor time to case time and CPU
    seconds (all processes) per datapoint."""
    import shutil

    from bridgeflow.serialize import LMDBDataset, LMDBSerializer

    n = batches * BATCH
    work = tempfile.mkdtemp(prefix="bench_torch_lmdb_")
    try:
        path, raw_path = os.path.join(work, "d.lmdb"), os.path.join(work, "raw.lmdb")
        rng = np.random.default_rng(0)
        pool = [rng.integers(0, 256, LMDB_ITEM, dtype=np.uint8) for _ in range(32)]
        LMDBSerializer.save([[pool[i % 32], i] for i in range(n)], path, progress=False)
        shutil.copyfile(path, raw_path)  # py-lmdb refuses a second environment on one path in a process
        flow = LMDBDataset(path, shuffle=False)
        datasets = {"raw_lmdb": RawLMDBDataset(raw_path, n), "lmdb_dataset": flow,
                    "lmdb_dataset_indexed": IndexedView(flow)}

        def epoch(dataset) -> tuple[float, float]:
            loader = BFDataLoader(dataset, batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu0, start = time.process_time(), time.perf_counter()
            count = sum(int(labels.shape[0]) for _, labels in loader)
            elapsed = time.perf_counter() - start
            del loader  # its workers exit: their CPU time is counted
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = time.process_time() - cpu0 + (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            assert count == n, (count, n)
            return elapsed, cpu / n

        for dataset in datasets.values():  # warm-up: page cache, imports
            epoch(dataset)
        times: dict[str, list[float]] = {k: [] for k in datasets}
        cpus: dict[str, list[float]] = {k: [] for k in datasets}
        for _ in range(reps):
            for name, dataset in datasets.items():
                elapsed, cpu = epoch(dataset)
                times[name].append(elapsed)
                cpus[name].append(cpu)
        flow.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    for name in datasets:
        print(json.dumps({"bench": "torch_dataloader", "case": "lmdb_dataset", "loader": "bridgeflow", "dataset": name,
                          "reps": reps, "batch": BATCH, "batches": batches, "num_workers": 2, "item_bytes": LMDB_ITEM,
                          "median_s": round(medians[name], 4), "samples_per_s": round(n / medians[name], 1),
                          "cpu_us_per_item": round(statistics.median(cpus[name]) * 1e6, 1),
                          "all_s": [round(t, 4) for t in times[name]], **machine}), flush=True)
    for name in ("lmdb_dataset", "lmdb_dataset_indexed"):
        ratio = medians["raw_lmdb"] / medians[name]
        print(json.dumps({"bench": "torch_dataloader", "case": "lmdb_dataset", "ratio": f"{name}/raw_lmdb",
                          "value": round(ratio, 3), "cpu_ratio": round(statistics.median(cpus["raw_lmdb"])
                                                                      / statistics.median(cpus[name]), 3),
                          "target": 0.95, "meets_target": ratio >= 0.95}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every case's samples per epoch")
    parser.add_argument("--batches", type=int, default=100, help="lmdb_dataset and cuda: batches per epoch")
    parser.add_argument("--cases", default=",".join([*CASES, "pil_folder", "flow_decode", "cuda", "lmdb_dataset",
                                                     "seed_per_sample"]))
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "bf-bench-torch"),
                        help="where the generated JPEGs and LMDB file are kept between runs")
    parser.add_argument("--busy", type=int, default=0, help="processes kept spinning on the CPU meanwhile")
    args = parser.parse_args()
    with busy_cpus(args.busy):
        run_cases(parser, args)


def busy_cpus(n: int) -> Any:
    """A context in which ``n`` processes spin on the CPU (other work on the machine); they are killed and
    reaped when it ends."""
    import contextlib
    import subprocess
    import sys

    @contextlib.contextmanager
    def spinning():
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        try:
            yield
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return spinning()


def run_cases(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # no accelerator: both loaders say once per iterator that they pin nothing (the *_pin cases say so too)
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")
    machine = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "numpy": np.__version__}
    for case in args.cases.split(","):
        if case == "cuda":
            bench_cuda(args.reps, args.batches, machine)
        elif case == "lmdb_dataset":
            bench_lmdb_dataset(args.reps, args.batches, machine)
        elif case == "pil_folder":
            bench_pil_folder(args.reps, machine, args.data)
        elif case == "flow_decode":
            bench_flow_decode(args.reps, machine, args.data)
        elif case == "seed_per_sample":
            bench_seed_per_sample(args.reps, args.scale, machine)
        elif case in CASES:
            bench_case(case, CASES[case], args.reps, args.scale, machine)
        else:
            parser.error(f"--cases: unknown case {case!r}")


if __name__ == "__main__":
    main()
