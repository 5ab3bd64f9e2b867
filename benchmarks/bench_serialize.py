"""Read and write speed of LMDBSerializer / HDF5Serializer against raw lmdb and h5py loops.

Data: N datapoints of a 150 KB uint8 array + an int label (default N=10,000, ~1.5 GB per file), in a
temporary folder that is removed at the end. The OS cache is warmed by one untimed pass of every case;
then, ``--reps`` times, each case and its anchor run as anchor, case, case, anchor (ABBA, so drift in
the machine's load cancels). Rates are medians over all runs; ratios are medians of the per-repetition
ratios (mean case rate / mean anchor rate):

- ``lmdb_seq``: ``LMDBSerializer.load(shuffle=False)`` vs a raw lmdb cursor loop calling np.frombuffer,
  its environment opened once and kept open (target >= 1.0); and vs the same loop with ``buffers=True``
  (``*_buffers``: values viewed in the map, nothing copied: the physical reference, no target);
- ``lmdb_shuffled``: shuffled reads vs raw ``txn.get`` in the same random order + np.frombuffer (target
  >= 1.0), and vs its ``buffers=True`` loop;
- ``lmdb_seq`` / ``lmdb_shuffled`` vs ``*_nocrc``: the cost of the CRC-32 every value carries by default,
  against the same data saved with ``checksum=False`` (target >= 0.95); ``--crc zlib`` measures the
  standard library's CRC instead of zlib-ng's;
- ``hdf5_seq``: ``HDF5Serializer.load(shuffle=False)`` vs raw h5py reads of the same items, one by one
  (target >= 1.0); a chunk-blocked raw h5py loop is reported too;
- ``hdf5_shuffled``: shuffled reads vs raw h5py item reads in the same order;
- ``lmdb_write`` / ``hdf5_write``: save rates (N datapoints from an in-memory pool), no anchor.

One JSON line per result on stdout. ``--quick`` uses N=1,000 for a smoke run. ``--evict`` drops the files
from the page cache once written (``posix_fadvise(DONTNEED)``), so that the warm-up pass fills it by
reading, as a job reading a dataset does (the kernel then caches the file in large folios, which copy
out faster than the single pages a fresh write leaves); the default reads the cache the writes left.

Example:
    python benchmarks/bench_serialize.py            # the full run
    python benchmarks/bench_serialize.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import h5py
import lmdb
import numpy as np

from bridgeflow import DataFlow
from bridgeflow.serialize import HDF5Serializer, LMDBSerializer

ITEM = 150_000


class PoolData(DataFlow):
    """N datapoints cycling over a pool of 32 random arrays: the source costs nothing."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.pool = [rng.integers(0, 256, ITEM, dtype=np.uint8) for _ in range(32)]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield [self.pool[i % 32], i]


def timed(fn) -> float:
    t0 = time.perf_counter()
    count = fn()
    return count / (time.perf_counter() - t0)


def make_cases(lmdb_path: str, h5_path: str, n: int, order: list[int], nocrc_path: str, env) -> dict:
    """The cases; ``env`` is the raw anchor's py-lmdb environment on ``lmdb_path``, opened once and kept open
    for the whole run as a long-lived reader (a training job, a DataLoader worker) keeps it: reopening it
    every pass would add the page faults of mapping the file again, which such a reader never pays."""
    def raw_lmdb_seq(buffers: bool = False) -> int:
        with env.begin(buffers=buffers) as txn:
            cur = txn.cursor()
            cur.first()
            for _, v in zip(range(n), cur.iternext(keys=False)):
                np.frombuffer(v, np.uint8, ITEM, len(v) - 4 - ITEM)
        return n

    def raw_lmdb_shuffled(buffers: bool = False) -> int:
        with env.begin(buffers=buffers) as txn:
            for i in order:
                v = txn.get(i.to_bytes(8, "big"))
                np.frombuffer(v, np.uint8, ITEM, len(v) - 4 - ITEM)
        return n

    def flow(ds) -> int:
        with ds:
            ds.reset_state()
            count = 0
            for _ in ds:
                count += 1
        return count

    def raw_h5_items(idx) -> int:
        with h5py.File(h5_path, "r") as f:
            a, b = f["0"], f["1"]
            for i in idx:
                a[i]
                b[i]
        return n

    def raw_h5_blocks() -> int:
        with h5py.File(h5_path, "r") as f:
            a, b = f["0"], f["1"]
            step = a.chunks[0]
            for s in range(0, n, step):
                x, y = a[s:s + step], b[s:s + step]
                for j in range(len(x)):
                    x[j]
                    y[j]
        return n

    return {
        "raw_lmdb_seq": raw_lmdb_seq,
        "raw_lmdb_seq_buffers": lambda: raw_lmdb_seq(buffers=True),
        "lmdb_seq": lambda: flow(LMDBSerializer.load(lmdb_path, shuffle=False)),
        "raw_lmdb_shuffled": raw_lmdb_shuffled,
        "raw_lmdb_shuffled_buffers": lambda: raw_lmdb_shuffled(buffers=True),
        "lmdb_shuffled": lambda: flow(LMDBSerializer.load(lmdb_path, shuffle=True, seed=0)),
        "lmdb_seq_nocrc": lambda: flow(LMDBSerializer.load(nocrc_path, shuffle=False)),
        "lmdb_shuffled_nocrc": lambda: flow(LMDBSerializer.load(nocrc_path, shuffle=True, seed=0)),
        "raw_h5_seq": lambda: raw_h5_items(range(n)),
        "raw_h5_blocks": raw_h5_blocks,
        "hdf5_seq": lambda: flow(HDF5Serializer.load(h5_path, shuffle=False)),
        "raw_h5_shuffled": lambda: raw_h5_items(order),
        "hdf5_shuffled": lambda: flow(HDF5Serializer.load(h5_path, shuffle=True, seed=0)),
    }


def emit(**fields) -> None:
    fields.setdefault("machine", f"{platform.node()} {platform.processor() or platform.machine()} "
                                 f"{os.cpu_count()} cpus")
    print(json.dumps(fields), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000, help="datapoints per file (default 10000)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (>= 5 for the report)")
    p.add_argument("--quick", action="store_true", help="N=1000 smoke run")
    p.add_argument("--dir", default=None, help="where to put the temporary folder")
    p.add_argument("--evict", action="store_true", help="drop the written files from the page cache before the "
                   "warm-up pass (see the module doc)")
    p.add_argument("--crc", choices=("auto", "zlib"), default="auto",
                   help="zlib: checksums by the standard library's zlib.crc32 instead of zlib-ng's")
    args = p.parse_args(argv)
    if args.crc == "zlib":
        import zlib

        from bridgeflow.serialize import _checksum

        _checksum._pick.cache_clear()
        _checksum._pick = lambda: ("zlib", zlib.crc32)  # type: ignore[assignment]
    from bridgeflow.serialize._checksum import crc32_implementation

    crc_impl = crc32_implementation()
    n = 1000 if args.quick else args.n
    work = tempfile.mkdtemp(prefix="bench_serialize_", dir=args.dir)
    try:
        lmdb_path, h5_path = os.path.join(work, "d.lmdb"), os.path.join(work, "d.h5")
        writes: dict[str, list[float]] = {"lmdb_write": [], "hdf5_write": []}
        for rep in range(args.reps):  # writes: fresh files each repetition, interleaved
            for name, path, save in (("lmdb_write", lmdb_path, LMDBSerializer.save),
                                     ("hdf5_write", h5_path, HDF5Serializer.save)):
                if rep:
                    os.unlink(path)
                writes[name].append(timed(lambda s=save, q=path: s(PoolData(n), q, progress=False)))
        for name, rates in writes.items():
            emit(bench="serialize", case=name, n=n, item_bytes=ITEM, unit="datapoints/s",
                 median=round(statistics.median(rates), 1), reps=[round(r, 1) for r in rates])

        nocrc_path = os.path.join(work, "nocrc.lmdb")
        LMDBSerializer.save(PoolData(n), nocrc_path, progress=False, checksum=False)
        order = np.random.default_rng(1).permutation(n).tolist()
        env = lmdb.open(lmdb_path, subdir=False, readonly=True, lock=False)
        cases = make_cases(lmdb_path, h5_path, n, order, nocrc_path, env)
        if args.evict:
            for path in (lmdb_path, h5_path, nocrc_path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages are not dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        for fn in cases.values():  # warm the OS cache and every code path
            fn()
        pairs = [("lmdb_seq", "raw_lmdb_seq", 1.0), ("lmdb_shuffled", "raw_lmdb_shuffled", 1.0),
                 ("lmdb_seq", "raw_lmdb_seq_buffers", None), ("lmdb_shuffled", "raw_lmdb_shuffled_buffers", None),
                 ("lmdb_seq", "lmdb_seq_nocrc", 0.95), ("lmdb_shuffled", "lmdb_shuffled_nocrc", 0.95),
                 ("hdf5_seq", "raw_h5_seq", 1.0), ("hdf5_seq", "raw_h5_blocks", None),
                 ("hdf5_shuffled", "raw_h5_shuffled", 1.0)]
        rates: dict[str, list[float]] = {k: [] for k in cases}
        ratios: dict[tuple[str, str], list[float]] = {(c, a): [] for c, a, _ in pairs}
        for _ in range(args.reps):
            # ABBA within each pair, so both sides see the same (shared, noisy) machine
            for case, anchor, _target in pairs:
                a1, c1, c2, a2 = (timed(cases[anchor]), timed(cases[case]), timed(cases[case]),
                                  timed(cases[anchor]))
                rates[case] += [c1, c2]
                rates[anchor] += [a1, a2]
                ratios[(case, anchor)].append((c1 + c2) / (a1 + a2))

        for case, anchor, target in pairs:
            med = statistics.median(ratios[(case, anchor)])
            emit(bench="serialize", case=case, anchor=anchor, n=n, item_bytes=ITEM, unit="datapoints/s", crc=crc_impl,
                 cache="read" if args.evict else "written",
                 median=round(statistics.median(rates[case]), 1),
                 anchor_median=round(statistics.median(rates[anchor]), 1),
                 ratio=round(med, 3), ratio_reps=[round(r, 3) for r in ratios[(case, anchor)]], target=target,
                 meets_target=None if target is None else med >= target,
                 reps=[round(r, 1) for r in rates[case]], anchor_reps=[round(r, 1) for r in rates[anchor]])
        env.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
