"""Benchmark: a training loop fed by each loader, against the GPU's own speed (batches already on it).

The end-to-end table of issue 14, one JSON line per result. Two datasets generated on the fly with
Pillow: ``raw`` (3x224x224 uint8 arrays, nothing to decode) and ``jpeg`` (256x256 JPEGs decoded and
center-cropped to 224 in the workers). Two modes: ``data_only`` (batches reach the GPU, nothing runs on
them) and ``with_model`` (a small ResNet defined below, one SGD step per batch in bf16 autocast). Loaders:

- ``torch``: ``torch.utils.data.DataLoader(pin_memory=True)`` + ``.cuda(non_blocking=True)``;
- ``torchdata``: torchdata's ``StatefulDataLoader``, same arguments (skipped when torchdata is missing);
- ``bf_loader``: bridgeflow's ``DataLoader(pin_memory=True)`` + ``CUDAPrefetcher``;
- ``bf_loader_nopin``: the same with ``pin_memory=False`` (the prefetcher stages the batches itself);
- ``bf_flow``: ``MultiProcessMapData`` + ``BatchData`` (stacked in the workers) + ``CUDAPrefetcher``;
- ``model_only`` (with_model rows): the same steps on one batch already on the GPU: the bound.

Each measurement builds its loader, skips ``--warmup`` batches (worker start-up, cuDNN autotuning) and
times the next ``--batches``; configurations are interleaved over ``--reps`` repetitions and the median
is reported with ratios against ``torch`` (same data and mode) and, with the model, against
``model_only``. Lines with ``"check"`` compare with the issue's targets.

``--staging`` measures instead, on any machine, the host copy that stages a pageable 38.5 MB batch into
pinned memory (ordinary memory where there is no CUDA): torch's ``copy_``, one thread, a split over 2..N
threads, and the way a default ``ParallelCopier`` picks.

Needs torch, numpy and Pillow; bridgeflow is found in this checkout when it is not installed. On a
machine without CUDA it prints one line saying it skipped.

Run: python benchmarks/bench_gpu.py [--quick] [--data raw,jpeg] [--loaders ...] [--staging]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

SHAPE = (3, 224, 224)
LOADERS = ("torch", "torchdata", "bf_loader", "bf_loader_nopin", "bf_flow")
TARGETS = {"raw_with_model_vs_model_only": 0.97, "raw_data_only_vs_torch": 3.0}


def _import_bridgeflow():
    """bridgeflow and its torch adapter: installed, or from this checkout (``adapters/`` is installed as
    ``bridgeflow.adapters``; without an install the mapping is made here)."""
    try:
        import bridgeflow
        import bridgeflow.adapters.torch as bft
        return bridgeflow, bft
    except ImportError:
        pass
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    import bridgeflow

    if "bridgeflow.adapters" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "bridgeflow.adapters", root / "adapters" / "__init__.py",
            submodule_search_locations=[str(root / "adapters")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["bridgeflow.adapters"] = module
        spec.loader.exec_module(module)
        bridgeflow.adapters = module
    import bridgeflow.adapters.torch as bft
    return bridgeflow, bft


# --- data ------------------------------------------------------------------------------------------------

def _pictures(n: int, size: int = 256, seed: int = 0) -> list:
    """``n`` RGB pictures with structure (so JPEG compresses them as it does photos), made with Pillow."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cx, cy, w = rng.uniform(-1.5, 0.5), rng.uniform(-1, 1), rng.uniform(0.2, 2.5)
        extent = (cx - w / 2, cy - w / 2, cx + w / 2, cy + w / 2)
        bands = [Image.effect_mandelbrot((size, size), extent, int(rng.integers(20, 120))),
                 Image.effect_noise((size, size), float(rng.uniform(10, 60))),
                 Image.linear_gradient("L").resize((size, size)).rotate(float(rng.uniform(0, 360)))]
        out.append(Image.merge("RGB", [bands[i] for i in rng.permutation(3)]))
    return out


class RawImages(tud.Dataset):
    """``n`` samples (CHW uint8 image, label) cycling over 64 decoded pictures: nothing to compute."""

    def __init__(self, n: int) -> None:
        self.n = n
        off = (256 - SHAPE[1]) // 2
        self.images = [np.ascontiguousarray(np.asarray(p)[off:off + SHAPE[1], off:off + SHAPE[2]].transpose(2, 0, 1))
                       for p in _pictures(64)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.images[i % 64], i % 1000


class JpegImages(tud.Dataset):
    """``n`` samples decoded from 64 JPEGs (256x256, quality 90) and center-cropped to 224: CPU-bound."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.files = []
        for p in _pictures(64, seed=1):
            buf = io.BytesIO()
            p.save(buf, format="JPEG", quality=90)
            self.files.append(buf.getvalue())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        from PIL import Image

        im = Image.open(io.BytesIO(self.files[i % 64])).convert("RGB")
        off = (256 - SHAPE[1]) // 2
        im = im.crop((off, off, off + SHAPE[2], off + SHAPE[1]))
        return np.ascontiguousarray(np.asarray(im).transpose(2, 0, 1)), i % 1000


DATASETS = {"raw": RawImages, "jpeg": JpegImages}


# --- model -----------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    """A ResNet-10-like network: stem, four stages of one basic block, pooling, 1000 classes."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        chans = [width, 2 * width, 4 * width, 8 * width]
        self.stages = nn.Sequential(*[Block(chans[max(i - 1, 0)], c, 1 if i == 0 else 2)
                                      for i, c in enumerate(chans)])
        self.fc = nn.Linear(chans[-1], 1000)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1), 1))


def make_step(device: torch.device):
    model = SmallResNet().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    def step(x, y):
        x = ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


# --- loaders ---------------------------------------------------------------------------------------------

def device_batches(kind: str, ds, batch: int, workers: int, device, bf, bft):
    """An iterable of (images, labels) on ``device`` and a function that releases the loader."""
    common = dict(batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)
    if kind in ("torch", "torchdata"):
        if kind == "torch":
            loader = tud.DataLoader(ds, pin_memory=True, **common)
        else:
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = StatefulDataLoader(ds, pin_memory=True, **common)

        def gen():
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

        return gen(), lambda: None, None
    if kind in ("bf_loader", "bf_loader_nopin"):
        loader = bft.DataLoader(ds, pin_memory=kind == "bf_loader", **common)
        prefetcher = bft.CUDAPrefetcher(loader, device)
        return prefetcher, lambda: None, prefetcher
    if kind == "bf_flow":
        flow = bf.MultiProcessMapData(bf.DataFromList(list(range(len(ds))), shuffle=True, seed=0), num_proc=workers,
                                      map_func=ds.__getitem__)
        flow = bf.BatchData(flow, batch, remainder=False)
        prefetcher = bft.CUDAPrefetcher(flow, device)
        return prefetcher, flow.close, prefetcher
    raise ValueError(f"unknown loader {kind!r}")


def measure(kind: str, data: str, with_model: bool, args, device, step, bf, bft) -> tuple[float, dict]:
    """Samples/s over ``args.batches`` batches after ``args.warmup``, and the prefetcher's stats."""
    total = args.warmup + args.batches
    if kind == "model_only":
        x = torch.randint(0, 256, (args.batch, *SHAPE), dtype=torch.uint8, device=device)
        y = torch.randint(0, 1000, (args.batch,), device=device)
        for _ in range(args.warmup):
            step(x, y)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.batches):
            step(x, y)
        torch.cuda.synchronize()
        return args.batch * args.batches / (time.perf_counter() - start), {}
    ds = DATASETS[data](total * args.batch)
    batches, close, prefetcher = device_batches(kind, ds, args.batch, args.workers, device, bf, bft)
    try:
        it = iter(batches)
        for _ in range(args.warmup):
            x, y = next(it)
            if with_model:
                step(x, y)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.batches):
            x, y = next(it)
            if with_model:
                step(x, y)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        assert x.device.type == device.type and x.shape == (args.batch, *SHAPE) and x.dtype == torch.uint8
        for _ in it:  # the end of the epoch: the loader shuts down as it does after a full epoch
            pass
    finally:
        close()
    stats = prefetcher.stats() if prefetcher is not None else {}
    return args.batch * args.batches / elapsed, stats


def run_table(args, machine: dict) -> None:
    bf, bft = _import_bridgeflow()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    step = make_step(device)
    loaders = [k for k in args.loaders.split(",") if k]
    if "torchdata" in loaders and importlib.util.find_spec("torchdata") is None:
        print(json.dumps({"bench": "gpu_e2e", "loader": "torchdata", "skipped": "torchdata is not installed",
                          **machine}), flush=True)
        loaders.remove("torchdata")
    configs = []
    for data in args.data.split(","):
        for mode in args.modes.split(","):
            with_model = mode == "with_model"
            configs += [(data, mode, k) for k in loaders + (["model_only"] if with_model else [])]
    results: dict[tuple, list[float]] = {c: [] for c in configs}
    stats: dict[tuple, dict] = {}
    for rep in range(args.reps):
        for data, mode, kind in configs:
            if kind == "model_only" and data != args.data.split(",")[0]:
                results[(data, mode, kind)].append(results[(args.data.split(",")[0], mode, kind)][rep])
                continue
            sps, st = measure(kind, data, mode == "with_model", args, device, step, bf, bft)
            results[(data, mode, kind)].append(sps)
            stats[(data, mode, kind)] = st
    med = {c: statistics.median(v) for c, v in results.items()}
    for (data, mode, kind), m in med.items():
        line = {"bench": "gpu_e2e", "data": data, "mode": mode, "loader": kind, "batch": args.batch,
                "workers": args.workers, "batches": args.batches, "reps": args.reps,
                "samples_per_s": round(m, 1), "all": [round(v, 1) for v in results[(data, mode, kind)]]}
        anchor = med.get((data, mode, "torch"))
        if anchor and kind != "torch":
            line["ratio_vs_torch"] = round(m / anchor, 3)
        bound = med.get((data, mode, "model_only"))
        if bound and kind != "model_only":
            line["ratio_vs_model_only"] = round(m / bound, 3)
        if stats.get((data, mode, kind)):
            line["prefetcher"] = stats[(data, mode, kind)]
        print(json.dumps({**line, **machine}), flush=True)
    for kind in ("bf_loader", "bf_flow"):
        checks = [("raw_with_model_vs_model_only", ("raw", "with_model", kind), ("raw", "with_model", "model_only")),
                  ("raw_data_only_vs_torch", ("raw", "data_only", kind), ("raw", "data_only", "torch"))]
        for name, num, den in checks:
            if num in med and den in med:
                ratio = med[num] / med[den]
                print(json.dumps({"bench": "gpu_e2e", "check": name, "loader": kind, "ratio": round(ratio, 3),
                                  "target_min": TARGETS[name], "meets_target": ratio >= TARGETS[name]}), flush=True)


# --- the staging copy ------------------------------------------------------------------------------------

def run_staging(args, machine: dict) -> None:
    """GB/s of the pageable -> pinned staging copy of one raw batch into a reused buffer (page-locked when
    CUDA is here): torch's ``copy_`` (the anchor), one thread's memcpy, ParallelCopier's split over 2..N
    threads, and what a default ParallelCopier chooses after timing both ways."""
    _, bft = _import_bridgeflow()
    from bridgeflow.adapters.torch._staging import ParallelCopier

    pinned = torch.cuda.is_available()
    nbytes = args.batch * int(np.prod(SHAPE))
    src = torch.from_numpy(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst.fill_(0)
    cpus = os.cpu_count() or 1
    splits = {f"split_{n}_threads": ParallelCopier(threads=n) for n in sorted({2, 4, 8, cpus // 2}) if 2 <= n <= cpus}
    auto = ParallelCopier()
    fns = {"torch_copy_": lambda: dst.copy_(src), "one_thread_memcpy": lambda: np.copyto(dst.numpy(), src.numpy()),
           **{name: (lambda c=c: c.copy(dst, src)) for name, c in splits.items()}, "auto": lambda: auto.copy(dst, src)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(args.reps * 5):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    assert torch.equal(dst, src)
    for c in [*splits.values(), auto]:
        c.close()
    base = statistics.median(times["torch_copy_"])
    for name, t in times.items():
        m = statistics.median(t)
        line = {"bench": "gpu_staging_copy", "variant": name, "bytes": nbytes,
                "into": "pinned" if pinned else "pageable (no CUDA here)", "GB_per_s": round(nbytes / m / 1e9, 2),
                "median_s": round(m, 5), "speedup_vs_torch_copy_": round(base / m, 2), "samples": len(t)}
        if name == "auto":
            line.update(auto_choice=auto.choice, auto_threads=auto.threads)
        print(json.dumps({**line, **machine}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run: few batches, one repetition")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=max(2, min(12, (os.cpu_count() or 4) - 4)))
    parser.add_argument("--batches", type=int, default=None, help="timed batches per measurement (default 100)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed batches first (default 10)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3)")
    parser.add_argument("--data", default="raw,jpeg")
    parser.add_argument("--modes", default="data_only,with_model")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--staging", action="store_true", help="measure the host staging copy only")
    args = parser.parse_args()
    args.batches = args.batches or (15 if args.quick else 100)
    args.warmup = args.warmup or (5 if args.quick else 10)
    args.reps = args.reps or (1 if args.quick else 3)
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    machine = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version(), "dev_shm_GB": round(shm / 1e9, 1)}
    if args.staging:
        run_staging(args, machine)
        return
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_e2e", "skipped": "no CUDA device on this machine", **machine}))
        return
    machine["gpu"] = torch.cuda.get_device_name()
    run_table(args, machine)


if __name__ == "__main__":
    main()
