"""Benchmark: bridgeflow's torch DataLoader against torch.utils.data.DataLoader (the anchor), same run.

Cases (map-style datasets, batch 64, num_workers=2, fork, one epoch timed from iter() to exhaustion,
worker start-up included as it is in every non-persistent epoch):

- ``numpy``: samples are 3x224x224 uint8 numpy arrays + an int label;
- ``tensor``: the same samples as torch tensors;
- ``transform_2ms``: numpy samples through a ~2 ms CPU-bound per-sample transform;
- ``pil_folder``: a folder of JPEGs (3,000 of 300-500 px, generated once into ``--data``) decoded with
  PIL (``Image.open().convert("RGB")``), RandomResizedCrop(224) and a random flip written as torchvision
  writes them (torchvision itself is not needed), and a CHW uint8 tensor made as torchvision's
  ``pil_to_tensor`` makes it (a permuted view of the HWC array); CPU-seconds per image are printed too
  (this process and its reaped workers, from ``getrusage``);
- ``flow_decode``: the same JPEGs as bytes in an LMDB file, read as the README shows,
  ``DataLoader(MapData(LMDBSerializer.load(path), decode), batch_size=64)``, with ``num_workers=2`` against
  ``num_workers=0`` of the same loader (the anchor here), and torch's DataLoader over a ``Dataset`` that
  reads the same file's datapoints by index (``num_workers=2``) for reference;
- ``pin_memory`` (GPU machines only): the numpy case with ``pin_memory=True``, pinned by each loader's
  background thread;
- ``lmdb_dataset``: bridgeflow's ``LMDBDataset`` (150 KB arrays) against a raw-lmdb ``Dataset`` in the same
  loader (:func:`bench_lmdb_dataset`), with CPU seconds per item;
- ``cuda`` (GPU machines only; one "skipped" line elsewhere): CUDAPrefetcher's host-to-device throughput
  from pageable input (staged by torch's ``copy_``, or as the prefetcher chooses), pinned and registered
  shared-memory input and bridgeflow's DataLoader output, against a raw pinned ``copy_`` of the same
  bytes; and a loop with a GPU step of known length (the copy should hide behind it).

Repetitions are interleaved (torch, bridgeflow, torch, ...); each line is one JSON object: per loader
the median seconds per epoch and samples/s, then the ratio torch_median / bridgeflow_median.

Run: python benchmarks/bench_torch.py [--reps 5] [--batches 100] [--cases pil_folder,flow_decode]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader as BFDataLoader

BATCH = 64
SHAPE = (3, 224, 224)
TARGETS = {"numpy": 2.5, "tensor": 2.5, "transform_2ms": 1.0, "pil_folder": 1.1, "flow_decode": 1.6}
JPEGS = 3000


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


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have been waited for (the workers of an epoch
    that ended)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed_epoch(make_loader) -> tuple[float, float, float, int]:
    """Seconds for one epoch from ``iter()`` to exhaustion (worker start-up included), seconds to the first
    batch, CPU-seconds (workers included, once the loader is gone) and items."""
    import gc

    cpu0 = cpu_seconds()
    start = time.perf_counter()
    loader = make_loader()
    first, n = None, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        n += int(batch[0].shape[0])
    elapsed = time.perf_counter() - start
    del loader, batch
    gc.collect()
    return elapsed, first, cpu_seconds() - cpu0, n


def compare(case: str, loaders: dict, reps: int, machine: dict, anchor: str, target: float | None,
            extra: dict | None = None) -> None:
    """Time ``loaders`` (name -> a function making a fresh loader) interleaved ``reps`` times after a
    warm-up epoch each; print one line per loader and the ratio of every other loader to ``anchor``."""
    for make in loaders.values():
        timed_epoch(make)
    runs: dict[str, list] = {name: [] for name in loaders}
    for _ in range(reps):
        for name, make in loaders.items():
            runs[name].append(timed_epoch(make))
    med = {}
    for name, rs in runs.items():
        n = rs[0][3]
        med[name] = statistics.median(r[0] for r in rs)
        cpu = statistics.median(r[2] / r[3] for r in rs)
        print(json.dumps({"bench": "torch_dataloader", "case": case, "loader": name, "reps": reps, "items": n,
                          "median_s": round(med[name], 4), "items_per_s": round(n / med[name], 1),
                          "cpu_s_per_item": round(cpu, 6), "items_per_cpu_s": round(1 / cpu, 1),
                          "first_batch_median_s": round(statistics.median(r[1] for r in rs), 4),
                          "all_s": [round(r[0], 3) for r in rs], **(extra or {}), **machine}), flush=True)
    for name in loaders:
        if name != anchor:
            ratio = med[anchor] / med[name]
            # each repetition's pair ran back to back: its ratio sees the same load on the machine
            paired = statistics.median(a[0] / b[0] for a, b in zip(runs[anchor], runs[name]))
            print(json.dumps({"bench": "torch_dataloader", "case": case, "loader": name, "anchor": anchor,
                              "ratio": round(ratio, 3), "paired_ratio": round(paired, 3), "target": target,
                              "meets_target": None if target is None else ratio >= target}), flush=True)


def bench_pil_folder(reps: int, machine: dict, data: str) -> None:
    dataset = ImageFolder(make_jpegs(os.path.join(data, "jpegs")))

    def make(cls):
        return lambda: cls(dataset, batch_size=BATCH, shuffle=True, num_workers=2, multiprocessing_context="fork")

    compare("pil_folder", {"torch": make(tud.DataLoader), "bridgeflow": make(BFDataLoader)}, reps, machine,
            "torch", TARGETS["pil_folder"], {"batch": BATCH, "num_workers": 2})


def bench_flow_decode(reps: int, machine: dict, data: str) -> None:
    from bridgeflow import LMDBSerializer, MapData

    path = make_lmdb(make_jpegs(os.path.join(data, "jpegs")), os.path.join(data, "jpegs.lmdb"))

    def flow(workers: int):
        context = "fork" if workers else None
        return lambda: BFDataLoader(MapData(LMDBSerializer.load(path), decode), batch_size=BATCH,
                                    num_workers=workers, multiprocessing_context=context)

    def torch_loader():
        return tud.DataLoader(IndexedLMDB(path), batch_size=BATCH, shuffle=True, num_workers=2,
                              multiprocessing_context="fork")

    compare("flow_decode", {"bridgeflow_workers_0": flow(0), "bridgeflow_workers_2": flow(2),
                            "torch_indexed_workers_2": torch_loader}, reps, machine, "bridgeflow_workers_0",
            None, {"batch": BATCH})
    print(json.dumps({"bench": "torch_dataloader", "case": "flow_decode", "target": TARGETS["flow_decode"],
                      "note": "the target is bridgeflow_workers_2's ratio to bridgeflow_workers_0"}), flush=True)


def run_epoch(loader_cls, dataset, **kwargs) -> tuple[float, float]:
    """Seconds for one epoch (worker start-up included) and seconds until the first batch."""
    loader = loader_cls(dataset, batch_size=BATCH, num_workers=2, multiprocessing_context="fork", **kwargs)
    start = time.perf_counter()
    first = None
    n = 0
    for images, labels in loader:
        if first is None:
            first = time.perf_counter() - start
        n += int(labels.shape[0])
        assert images.shape == (labels.shape[0], *SHAPE)
    elapsed = time.perf_counter() - start
    assert n == len(dataset), (n, len(dataset))
    return elapsed, first


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
    import resource
    import shutil
    import tempfile

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
    parser.add_argument("--batches", type=int, default=100, help="batches per epoch (transform case: 1/4)")
    parser.add_argument("--cases", default="numpy,tensor,transform_2ms,pil_folder,flow_decode,pin_memory,cuda,"
                        "lmdb_dataset")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "bf-bench-torch"),
                        help="where the generated JPEGs and LMDB file are kept between runs")
    args = parser.parse_args()
    machine = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "numpy": np.__version__}
    for case in args.cases.split(","):
        if case == "cuda":
            bench_cuda(args.reps, args.batches, machine)
            continue
        if case == "lmdb_dataset":
            bench_lmdb_dataset(args.reps, args.batches, machine)
            continue
        if case == "pil_folder":
            bench_pil_folder(args.reps, machine, args.data)
            continue
        if case == "flow_decode":
            bench_flow_decode(args.reps, machine, args.data)
            continue
        options = {}
        if case == "pin_memory":  # numpy samples, batches pinned by each loader's pin thread
            if not torch.cuda.is_available():
                print(json.dumps({"bench": "torch_dataloader", "case": case,
                                  "skipped": "no CUDA device: nothing to pin for", **machine}))
                continue
            options = {"pin_memory": True}
        batches = args.batches if case != "transform_2ms" else max(2, args.batches // 4)
        dataset = ImageDataset(batches * BATCH, as_tensor=case == "tensor",
                               transform_ms=2.0 if case == "transform_2ms" else 0.0)
        loaders = {"torch": tud.DataLoader, "bridgeflow": BFDataLoader}
        times: dict[str, list[float]] = {name: [] for name in loaders}
        firsts: dict[str, list[float]] = {name: [] for name in loaders}
        run_epoch(tud.DataLoader, dataset, **options)  # warm-up (imports, page cache)
        run_epoch(BFDataLoader, dataset, **options)
        for _ in range(args.reps):
            for name, cls in loaders.items():
                elapsed, first = run_epoch(cls, dataset, **options)
                times[name].append(elapsed)
                firsts[name].append(first)
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, med in medians.items():
            print(json.dumps({"bench": "torch_dataloader", "case": case, "loader": name, "reps": args.reps,
                              "batch": BATCH, "batches": batches, "num_workers": 2,
                              "median_s": round(med, 4), "samples_per_s": round(len(dataset) / med, 1),
                              "first_batch_median_s": round(statistics.median(firsts[name]), 4),
                              "all_s": [round(t, 4) for t in times[name]], **machine}), flush=True)
        ratio = medians["torch"] / medians["bridgeflow"]
        print(json.dumps({"bench": "torch_dataloader", "case": case, "ratio_vs_torch": round(ratio, 3),
                          "target": TARGETS.get(case), "meets_target": ratio >= TARGETS.get(case, 0)}),
              flush=True)


if __name__ == "__main__":
    main()
