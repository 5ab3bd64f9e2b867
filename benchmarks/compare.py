"""The hot paths of two trees side by side in one run: a regression check to run before a merge.

Runs the headline cases on a *base* tree (a commit, checked out in a temporary worktree and run with this
interpreter, or a directory, run with its own ``.venv`` when it has one) and on the *head* tree (the one
holding this script, or ``--head DIR``). Every (case, configuration, tree) runs in a fresh interpreter, so
no configuration inherits another's imports, allocator state or workers; the two trees alternate which goes
first, ``--reps`` times, so drift in the machine's load hits both alike. Each run times ``--epochs`` epochs
after an untimed one and measures, for itself and its worker processes, CPU time (user + system), system
time and minor page faults (``/proc`` for workers still alive, ``getrusage`` for those reaped).

Cases (``--cases``, comma-separated; the default runs all but the ``torch:`` ones, which ``--cases
torch`` selects: each takes a minute):

- ``w1``, ``w1_torch``: bench_parallel's W1, 3x224x224 uint8 samples (a view of a 77 MB bank) + a label,
  ``BatchData(64)`` fused after a 2-worker ``MultiProcessMapData``, against the same map in-process (and,
  with torch imported first as a training script does, torch's DataLoader);
- ``w1_alloc``, ``w1_alloc_torch``: the same with a map that makes a new 150 KB array per sample, as a
  decoder does (the case where page faults show);
- ``lmdb_150k_seq``, ``lmdb_150k_shuffled``, ``lmdb_300b_seq``, ``lmdb_300b_shuffled``: ``LMDBSerializer``
  reads (checksums on) against py-lmdb loops with the environment kept open, as a long-lived reader keeps
  it: ``raw`` copies each value into an array (``txn.get`` / the cursor), ``raw_buffers`` views it in
  place (``buffers=True``, the physical reference: nothing is copied); ``lmdb_300b-nocrc_seq`` and
  ``_shuffled`` read a file saved with ``checksum=False``; ``lmdb_300b_getitem`` and ``lmdb_150k_getitem``
  read one ``ds[i]`` at a time in a shuffled order (random access) against ``txn.get`` in the same order,
  and (``bridgeflow_batch64``) 64 indices a call, as torch's DataLoader fetches a batch (``__getitems__``
  where the reader has it, else one ``ds[i]`` each);
- ``hdf5_seq``, ``hdf5_shuffled``: ``HDF5Serializer`` reads against raw h5py item reads of the same file;
- ``roundtrip``: one small task at a time to a pool of one idle worker (thread, or process), ``put`` then
  ``get``: what a task's way to a waiting worker and its result's way back cost;
- ``jpeg``: JPEG bytes in LMDB, decoded (simplejpeg when installed, else cv2), RandomResizedCrop(224)
  (``GoogleNetRandomCropAndResize``) and a flip, CHW (a view, copied once: into the batch), in a 2-worker
  ``MultiProcessMapData`` with
  ``BatchData(64)`` fused, against the decoder floor: decode + crop + resize of the same images in one
  process; CPU per image is the figure;
- ``torch:NAME``: bench_torch.py's case NAME (head's script, run on each tree), one repetition per run;
  ``torch`` alone means every case in bench_torch's ``CASES`` (the sample shapes; its JPEG, CUDA and LMDB
  cases are named one by one).

Output: one JSON line per (case, configuration, tree) with medians, then one per ratio: head/base of each
configuration's throughput (the median of the per-repetition ratios), and within each tree the ratio of
bridgeflow's configuration to the anchor (``vs``). A table for people goes to stderr.

``--busy N`` keeps N processes spinning on the CPU for the whole run: the same cases with N cores taken by
other work (the issue-42 targets are judged quiet and with ``--busy 1``).

Run: python benchmarks/compare.py --base e068cb2 [--cases w1,w1_torch,lmdb_150k_seq] [--reps 3] [--busy 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = 64
# case -> its configurations; the first is the anchor the others are compared with
CASES: dict[str, list[str]] = {
    "w1": ["in-process", "processes"],
    "w1_torch": ["in-process", "processes", "torch-DataLoader"],
    "w1_alloc": ["in-process", "processes"],
    "w1_alloc_torch": ["in-process", "processes", "torch-DataLoader"],
    "lmdb_150k_seq": ["raw", "bridgeflow", "raw_buffers"],
    "lmdb_150k_shuffled": ["raw", "bridgeflow", "raw_buffers"],
    "lmdb_300b_seq": ["raw", "bridgeflow", "raw_buffers"],
    "lmdb_300b_shuffled": ["raw", "bridgeflow", "raw_buffers"],
    "lmdb_300b-nocrc_seq": ["raw", "bridgeflow", "raw_buffers"],
    "lmdb_300b-nocrc_shuffled": ["raw", "bridgeflow", "raw_buffers"],
    "lmdb_300b_getitem": ["raw", "bridgeflow", "bridgeflow_batch64", "raw_buffers"],
    "lmdb_150k_getitem": ["raw", "bridgeflow", "bridgeflow_batch64", "raw_buffers"],
    "hdf5_seq": ["raw", "bridgeflow"],
    "hdf5_shuffled": ["raw", "bridgeflow"],
    "jpeg": ["floor", "bridgeflow"],
    "roundtrip": ["threads", "processes"],
}
ROUNDTRIPS = 2_000
SIZES = {"150k": (150_000, 3_000), "300b": (300, 100_000), "300b-nocrc": (300, 100_000)}  # value bytes, datapoints
JPEGS = 1_000


# --- the child: one configuration of one case on one tree -----------------------------------------

def use_tree(tree: str) -> None:
    """Import bridgeflow from ``tree``, and ``bridgeflow.adapters`` from its ``adapters/`` (an editable
    install of another tree would otherwise map it there)."""
    import importlib.abc
    import importlib.util

    sys.path.insert(0, tree)
    adapters = os.path.join(tree, "adapters")

    class Adapters(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "bridgeflow.adapters":
                return None
            return importlib.util.spec_from_file_location(name, os.path.join(adapters, "__init__.py"),
                                                          submodule_search_locations=[adapters])

    sys.meta_path.insert(0, Adapters())
    import bridgeflow

    if not os.path.realpath(bridgeflow.__file__).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"bridgeflow came from {bridgeflow.__file__}, not from {tree}")


def _proc_usage(pid: int) -> tuple[float, float, int]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7])  # utime, stime, minflt


def usage() -> tuple[float, float, int]:
    """(CPU s, system s, minor faults) of this process, its live children and its reaped ones."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    sys_s, faults = own.ru_stime + reaped.ru_stime, own.ru_minflt + reaped.ru_minflt
    try:
        kids = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                kids.update(int(p) for p in f.read().split())
    except OSError:  # not Linux: workers count once they are reaped
        kids = set()
    for pid in kids:
        try:
            u, s, m = _proc_usage(pid)
        except (OSError, IndexError):
            continue
        cpu, sys_s, faults = cpu + u + s, sys_s + s, faults + m
    return cpu, sys_s, faults


def measure(loader, epoch, epochs: int) -> dict:
    """Time ``epochs`` calls of ``epoch(loader)`` (each returns the items it read) after an untimed one."""
    epoch(loader)
    c0, t0 = usage(), time.perf_counter()
    items = sum(epoch(loader) for _ in range(epochs))
    wall, c1 = time.perf_counter() - t0, usage()
    return {"items": items, "wall_s": wall, "cpu_s": c1[0] - c0[0], "sys_s": c1[1] - c0[1],
            "minflt": c1[2] - c0[2]}


def _batches(loader) -> int:
    return sum(len(b[1]) for b in loader)


def _datapoints(loader) -> int:
    return sum(1 for _ in loader)


def run_w1(case: str, config: str, epochs: int) -> dict:
    import numpy as np

    import bridgeflow as bf
    from bridgeflow.parallel import MultiProcessMapData

    bank = np.random.default_rng(0).integers(0, 256, (512, 3, 224, 224), dtype=np.uint8)
    fresh = case.startswith("w1_alloc")

    def load(i):
        return [bank[i % 512].copy() if fresh else bank[i % 512], i]

    n = BATCH * 80
    if config == "torch-DataLoader":
        import torch.utils.data as tud

        class Dataset(tud.Dataset):
            def __len__(self):
                return n

            def __getitem__(self, i):
                return load(i)

        loader = tud.DataLoader(Dataset(), batch_size=BATCH, num_workers=2, persistent_workers=True,
                                multiprocessing_context="fork")
        return measure(loader, _batches, max(1, epochs // 3))
    src = bf.DataFromList(list(range(n)), shuffle=False)
    stage = bf.MapData(src, load) if config == "in-process" else MultiProcessMapData(src, 2, load,
                                                                                        start_method="fork")
    with bf.BatchData(stage, BATCH) as df:
        df.reset_state()
        return measure(df, _batches, epochs)


def _double_init(ctx):
    return lambda x: 2 * x


def run_roundtrip(config: str, epochs: int) -> dict:
    from bridgeflow.parallel import WorkerPool

    with WorkerPool(_double_init, 1, processes=config == "processes", start_method="fork").start() as pool:
        def epoch(_):
            for i in range(ROUNDTRIPS):
                pool.put(i)
                pool.get()
            return ROUNDTRIPS

        return measure(None, epoch, epochs)


def setup_files(data: str) -> None:
    """The files the serialize and jpeg cases read, written by this tree's bridgeflow."""
    import numpy as np

    from bridgeflow import DataFromList, HDF5Serializer, LMDBSerializer

    os.makedirs(data, exist_ok=True)
    rng = np.random.default_rng(0)
    for tag, (nbytes, n) in SIZES.items():
        pool = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(32)]
        rows = DataFromList([[pool[i % 32], i] for i in range(n)], shuffle=False)
        LMDBSerializer.save(rows, os.path.join(data, f"{tag}.lmdb"), progress=False, overwrite=True,
                            checksum=not tag.endswith("-nocrc"))
        if tag == "150k":
            HDF5Serializer.save(rows, os.path.join(data, "150k.h5"), progress=False, overwrite=True)
    import cv2

    jpegs = []
    for _ in range(JPEGS):  # smooth colour fields with noise, 300-500 px a side, quality 90
        w, h = (int(v) for v in rng.integers(300, 501, 2))
        img = cv2.resize(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8), (w, h), interpolation=cv2.INTER_LINEAR)
        img = np.clip(img.astype(np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16), 0, 255)
        jpegs.append([cv2.imencode(".jpg", img.astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 90])[1], len(jpegs) % 1000])
    LMDBSerializer.save(DataFromList(jpegs, shuffle=False), os.path.join(data, "jpeg.lmdb"), progress=False,
                        overwrite=True)


def run_serialize(case: str, config: str, data: str, epochs: int) -> dict:
    import numpy as np

    from bridgeflow.serialize import HDF5Serializer, LMDBSerializer

    kind, *_, order_kind = case.split("_")  # lmdb_<size>_<order>, hdf5_<order>
    shuffled = order_kind in ("shuffled", "getitem")
    if kind == "hdf5":
        path, n = os.path.join(data, "150k.h5"), SIZES["150k"][1]
    else:
        tag = case.split("_")[1]
        path, n = os.path.join(data, f"{tag}.lmdb"), SIZES[tag][1]
    rng = np.random.default_rng(1)
    if config.startswith("bridgeflow") and order_kind == "getitem":  # random access: ds[i], or 64 at a time
        with LMDBSerializer.load(path, shuffle=False) as ds:
            ds.reset_state()
            batch = getattr(ds, "__getitems__", None) or (lambda idx: [ds[i] for i in idx])  # torch's fetcher

            def getitem_epoch(_):
                order = rng.permutation(n).tolist()
                if config == "bridgeflow":
                    for i in order:
                        ds[i]
                else:
                    for j in range(0, n, 64):
                        batch(order[j:j + 64])
                return n

            return measure(None, getitem_epoch, epochs)
    if config == "bridgeflow":
        load = HDF5Serializer.load if kind == "hdf5" else LMDBSerializer.load
        with load(path, shuffle=shuffled, seed=0) as ds:
            ds.reset_state()
            return measure(ds, _datapoints, epochs)
    if kind == "hdf5":
        import h5py

        with h5py.File(path, "r") as f:
            a, b = f["0"], f["1"]

            def h5_epoch(_):
                for i in (rng.permutation(n).tolist() if shuffled else range(n)):
                    a[i]
                    b[i]
                return n

            return measure(None, h5_epoch, epochs)
    import lmdb

    env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=not shuffled)
    buffers = config == "raw_buffers"
    try:
        with env.begin(buffers=buffers) as txn:
            def lmdb_epoch(_):
                if shuffled:
                    for i in rng.permutation(n).tolist():
                        np.frombuffer(txn.get(i.to_bytes(8, "big")), np.uint8)
                else:
                    cur = txn.cursor()
                    cur.first()
                    for _, v in zip(range(n), cur.iternext(keys=False)):
                        np.frombuffer(v, np.uint8)
                return n

            return measure(None, lmdb_epoch, epochs)
    finally:
        env.close()


def run_jpeg(config: str, data: str, epochs: int) -> dict:
    import cv2
    import numpy as np

    import bridgeflow as bf
    from bridgeflow import imgaug
    from bridgeflow.parallel import MultiProcessMapData

    cv2.setNumThreads(1)  # one core per worker, as torch's workers run
    try:
        import simplejpeg

        def decode(buf):
            return simplejpeg.decode_jpeg(buf, colorspace="BGR")
    except ImportError:
        def decode(buf):
            return cv2.imdecode(buf, cv2.IMREAD_COLOR)

    crop = imgaug.GoogleNetRandomCropAndResize(interp=cv2.INTER_LINEAR)
    augment = imgaug.AugmentorList([crop, imgaug.Flip(horiz=True)])
    path = os.path.join(data, "jpeg.lmdb")
    if config == "floor":  # decode + crop + resize, nothing else: what the pipeline cannot go below
        with bf.LMDBSerializer.load(path, shuffle=False) as ds:
            ds.reset_state()
            images = [np.asarray(dp[0]) for dp in ds]
        crop.reset_state()

        def floor_epoch(_):
            for buf in images:
                img = decode(buf)
                crop.get_transform(img).apply_image(img)
            return len(images)

        return measure(None, floor_epoch, epochs)

    def mapf(dp):  # CHW as a view: the worker's copy into the batch is the one copy it needs
        return [augment.augment(decode(dp[0])).transpose(2, 0, 1), dp[1]]

    stage = MultiProcessMapData(bf.LMDBSerializer.load(path, shuffle=True, seed=0), 2, mapf, start_method="fork")
    with bf.BatchData(stage, BATCH) as df:
        df.reset_state()
        return measure(df, _batches, epochs)


def bench_torch_module() -> types.ModuleType:
    """bench_torch.py, imported from beside this script (it imports torch)."""
    import importlib.util

    if HERE not in sys.path:  # a spawned worker unpickles the datasets by this module's name
        sys.path.append(HERE)
    spec = importlib.util.spec_from_file_location("bench_torch", os.path.join(HERE, "bench_torch.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_torch"] = module  # its dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def run_torch_case(name: str, tree: str) -> list[dict]:
    """bench_torch.py's case ``name`` with one repetition; its JSON lines, and this process's usage."""
    import contextlib
    import io

    module = bench_torch_module()
    out = io.StringIO()
    argv, sys.argv = sys.argv, ["bench_torch.py", "--cases", name, "--reps", "1"]
    c0, t0 = usage(), time.perf_counter()
    try:
        with contextlib.redirect_stdout(out):
            module.main()
    finally:
        sys.argv = argv
    wall, c1 = time.perf_counter() - t0, usage()
    lines = [json.loads(s) for s in out.getvalue().splitlines() if s.startswith("{")]
    return [*lines, {"whole_run": True, "wall_s": wall, "cpu_s": c1[0] - c0[0], "sys_s": c1[1] - c0[1],
                     "minflt": c1[2] - c0[2]}]


def child(args: argparse.Namespace) -> None:
    case, config = args.child
    if case.endswith("_torch") or case.startswith("torch:"):
        import torch  # noqa: F401  (first, as a training script imports it)
    use_tree(args.tree)
    if case == "setup":
        setup_files(args.data)
        return
    if case.startswith("torch:"):
        for line in run_torch_case(case.split(":", 1)[1], args.tree):
            print(json.dumps(line))
        return
    if case.startswith("w1"):
        result = run_w1(case, config, args.epochs)
    elif case == "roundtrip":
        result = run_roundtrip(config, args.epochs)
    elif case == "jpeg":
        result = run_jpeg(config, args.data, args.epochs)
    else:
        result = run_serialize(case, config, args.data, args.epochs)
    print(json.dumps(result))


# --- the parent: trees, interleaving, medians, ratios ----------------------------------------------

class Tree:
    def __init__(self, label: str, spec: str) -> None:
        self.label, self.cleanup = label, None
        if os.path.isdir(spec):
            self.path = os.path.abspath(spec)
        else:  # a commit: a temporary worktree of this repository
            self.path = tempfile.mkdtemp(prefix=f"bf-compare-{label}-")
            subprocess.run(["git", "-C", HERE, "worktree", "add", "--detach", self.path, spec], check=True,
                           capture_output=True)
            self.cleanup = self.path
        venv = os.path.join(self.path, ".venv", "bin", "python")
        self.python = venv if os.path.exists(venv) else sys.executable
        self.commit = subprocess.run(["git", "-C", self.path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", self.path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        self.name = f"{self.commit}{'+changes' if dirty else ''}"

    def run(self, case: str, config: str, data: str, epochs: int) -> list[dict]:
        cmd = [self.python, os.path.abspath(__file__), "--child", case, config, "--tree", self.path,
               "--data", os.path.join(data, self.label), "--epochs", str(epochs)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            err = done.stderr.strip()
            return [{"error": err.splitlines()[-1] if err else f"exit {done.returncode}"}]
        return [json.loads(s) for s in done.stdout.splitlines() if s.startswith("{")]

    def close(self) -> None:
        if self.cleanup:
            subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", self.cleanup], capture_output=True)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def summarize(case: str, runs: dict, trees: list[Tree], table: list[str]) -> None:
    """Medians per (configuration, tree), head/base ratios per configuration, bridgeflow/anchor per tree."""
    configs = CASES[case]
    rate: dict = {}
    for config in configs:
        for tree in trees:
            rs = [r for r in runs[(config, tree.label)] if "items" in r]
            if not rs:
                errors = [r.get("error") for r in runs[(config, tree.label)]]
                emit(case=case, config=config, tree=tree.label, error=errors[:1])
                continue
            per = {k: statistics.median(r[k] / r["items"] for r in rs) for k in ("wall_s", "cpu_s", "sys_s", "minflt")}
            rate[(config, tree.label)] = [r["items"] / r["wall_s"] for r in rs]
            line = {"case": case, "config": config, "tree": tree.label, "commit": tree.name,
                    "items_per_s": round(statistics.median(rate[(config, tree.label)]), 1),
                    "cpu_us_per_item": round(per["cpu_s"] * 1e6, 2), "sys_us_per_item": round(per["sys_s"] * 1e6, 2),
                    "minflt_per_item": round(per["minflt"], 2), "reps": len(rs)}
            emit(**line)
            table.append(f"{case:20} {config:17} {tree.label:4} {line['items_per_s']:>11,.0f} "
                         f"{line['cpu_us_per_item']:>10.1f} {line['sys_us_per_item']:>8.1f} "
                         f"{line['minflt_per_item']:>8.2f}")
    for config in configs:
        if (config, "base") in rate and (config, "head") in rate:
            paired = [h / b for h, b in zip(rate[(config, "head")], rate[(config, "base")])]
            emit(case=case, config=config, ratio="head/base", value=round(statistics.median(paired), 3))
            table.append(f"{case:20} {config:17} head/base {statistics.median(paired):6.3f}")
    anchor = configs[0]
    for tree in trees:
        for config in configs[1:]:
            if (config, tree.label) in rate and (anchor, tree.label) in rate:
                paired = [c / a for c, a in zip(rate[(config, tree.label)], rate[(anchor, tree.label)])]
                emit(case=case, config=config, vs=anchor, tree=tree.label, value=round(statistics.median(paired), 3))
                table.append(f"{case:20} {config:17} {tree.label:4} vs {anchor:12} {statistics.median(paired):6.3f}")


def torch_cases() -> list[str]:
    """bench_torch.py's case names: the keys of its ``CASES`` (read from the file's syntax tree, so torch is not
    imported here). The few cases its ``--cases`` default adds beside them need their own setup (JPEG folders,
    a GPU) and are named one by one as ``torch:NAME``."""
    import ast

    with open(os.path.join(HERE, "bench_torch.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CASES" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                return [f"torch:{k.value}" for k in node.value.keys if isinstance(k, ast.Constant)]
    raise SystemExit("benchmarks/bench_torch.py: no CASES dict found, so 'torch' names no case")


def summarize_torch(case: str, runs: dict, trees: list[Tree], table: list[str]) -> None:
    """bench_torch lines: each loader's items/s per tree (median), head/base, and the whole run's usage."""
    for tree in trees:
        lines = [line for run in runs[("", tree.label)] for line in run]
        whole = [x for x in lines if x.get("whole_run")]
        if whole:
            emit(case=case, tree=tree.label, commit=tree.name, whole_run_wall_s=round(statistics.median(
                x["wall_s"] for x in whole), 2), cpu_s=round(statistics.median(x["cpu_s"] for x in whole), 2),
                sys_s=round(statistics.median(x["sys_s"] for x in whole), 2),
                minflt=int(statistics.median(x["minflt"] for x in whole)))
        for err in [x["error"] for x in lines if "error" in x][:1]:
            emit(case=case, tree=tree.label, error=err)
    keys: dict = {}
    for tree in trees:
        for run in runs[("", tree.label)]:
            for x in run:
                rate = x.get("samples_per_s") or x.get("items_per_s")
                name = x.get("loader", "") + (f"/{x['dataset']}" if "dataset" in x else "") + \
                    (f"/{x['variant']}" if "variant" in x else "")
                if rate and name:
                    keys.setdefault((name, tree.label), []).append(rate)
    for (name, label), rates in sorted(keys.items()):
        emit(case=case, loader=name, tree=label, items_per_s=round(statistics.median(rates), 1), reps=len(rates))
        table.append(f"{case:20} {name:28} {label:4} {statistics.median(rates):>11,.0f}")
    for name in sorted({n for n, _ in keys}):
        if (name, "base") in keys and (name, "head") in keys:
            paired = [h / b for h, b in zip(keys[(name, "head")], keys[(name, "base")])]
            emit(case=case, loader=name, ratio="head/base", value=round(statistics.median(paired), 3))
            table.append(f"{case:20} {name:28} head/base {statistics.median(paired):6.3f}")
    for tree in trees:  # within each tree: bridgeflow against torch's loader, wall and CPU per sample
        lines = [x for run in runs[("", tree.label)] for x in run]
        vs = [x for x in lines if x.get("anchor") == "torch" and "ratio" in x]
        cpu: dict = {}
        for x in lines:
            if "worker_cpu_us_per_sample" in x:
                cpu.setdefault(x["loader"], []).append(x["worker_cpu_us_per_sample"] + x["main_cpu_us_per_sample"])
        if vs and "torch" in cpu and "bridgeflow" in cpu:
            wall = statistics.median(x["ratio"] for x in vs)
            mine, theirs = statistics.median(cpu["bridgeflow"]), statistics.median(cpu["torch"])
            emit(case=case, tree=tree.label, vs="torch-DataLoader", wall_ratio=round(wall, 3),
                 cpu_us_per_sample=round(mine, 2), torch_cpu_us_per_sample=round(theirs, 2),
                 cpu_ratio=round(mine / max(theirs, 1e-9), 3))
            table.append(f"{case:20} {'bridgeflow vs torch':28} {tree.label:4} wall {wall:6.3f}  CPU us/sample "
                         f"{mine:8.2f} vs {theirs:8.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="a commit, or a directory holding a tree (default: main)")
    p.add_argument("--head", default=os.path.dirname(HERE), help="the tree to check (default: this script's)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated; 'torch' adds bench_torch's cases")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per run (torch's DataLoader: a third)")
    p.add_argument("--data", default=None, help="where each tree's files are written (default: a temporary folder)")
    p.add_argument("--busy", type=int, default=0,
                   help="processes kept spinning on the CPU for the whole run (a machine with other work on it)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    cases = []
    for c in args.cases.split(","):
        cases += torch_cases() if c == "torch" else [c]
    unknown = [c for c in cases if c not in CASES and not c.startswith("torch:")]
    if unknown:
        p.error(f"unknown cases {unknown}; known: {list(CASES)}, torch, torch:NAME")
    data = args.data or tempfile.mkdtemp(prefix="bf-compare-data-")
    trees = [Tree("base", args.base), Tree("head", args.head)]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        emit(machine=f"{os.uname().nodename} {os.cpu_count()} cpus", python=sys.version.split()[0],
             **{t.label: f"{t.name} {t.path}" for t in trees}, reps=args.reps, epochs=args.epochs,
             date=time.strftime("%Y-%m-%d %H:%M"), load=round(os.getloadavg()[0], 2), busy=args.busy)
        if any(not c.startswith(("w1", "torch:", "roundtrip")) for c in cases):
            for tree in trees:  # each tree writes its own files (the formats may differ)
                errs = [r["error"] for r in tree.run("setup", "-", data, 0) if "error" in r]
                if errs:
                    raise SystemExit(f"{tree.label}: writing the files failed: {errs[0]}")
        table = [f"{'case':20} {'config':17} tree {'items/s':>11} {'CPU us/it':>10} {'sys us':>8} {'faults':>8}"]
        for case in cases:
            configs = [""] if case.startswith("torch:") else CASES[case]
            runs: dict = {(c, t.label): [] for c in configs for t in trees}
            for rep in range(args.reps):
                for config in configs:
                    for tree in (trees if rep % 2 == 0 else trees[::-1]):
                        out = tree.run(case, config, data, args.epochs)
                        runs[(config, tree.label)].append(out) if case.startswith("torch:") else \
                            runs[(config, tree.label)].extend(out)
            (summarize_torch if case.startswith("torch:") else summarize)(case, runs, trees, table)
        print("\n".join(table), file=sys.stderr)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
        for tree in trees:
            tree.close()
        if not args.data:
            shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
