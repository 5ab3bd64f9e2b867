"""Damage dataset files at random and read them back: every read must end, in bounded time, with the
data exactly as saved or a bridgeflow error naming the file; never a hang, a crash or different data.

Each format's file is written by the current code from one seeded set of datapoints (arrays of a fixed
and of a varying shape, numbers, text and bytes), then mutated ``--mutations`` times: a zeroed 4 KiB
page, random bytes over a 4 KiB page, 1-8 flipped bytes, a cut at a random length, a huge number written
over 2, 4 or 8 bytes (counts and sizes), and for LMDB every node pointer of a page aimed at one node (a
small file claiming keys without end). Each mutated file is read whole (length, one sequential pass,
random access by index, compared with what was saved one datapoint at a time) in a separate worker
process that the runner kills after ``--timeout`` seconds, under a memory limit (``RLIMIT_AS``) of the
worker's address space before the read plus ``--memory-factor`` times the file's size plus
``--memory-slack`` MiB; the growth of its resident memory (peak less before, ``VmHWM`` reset per read) is
recorded. Outcomes:

- ``same``: read back exactly as saved (the mutation hit bytes no reader uses);
- ``error:<Type>``: a bridgeflow error naming the file (what damage must give);
- ``foreign:<Type>``: any other exception, or a bridgeflow error without the file's name;
- ``wrong``: read without an error but different from what was saved (silent);
- ``hang``: killed at the timeout; ``crash:<signal>``: the worker died;
- ``memory:<Type>``: the read ran out of the memory limit (``MemoryError`` or a libhdf5 allocation error).

One JSON line per format on stdout. Not collected by pytest; ``tests/test_serialize_fuzz.py`` runs a
few hundred mutations per format through the same code.

``--crafted N`` reads N files per format crafted as an attacker would (``crafted.py``): compression bombs
(npz members in deflate, bzip2 and LZMA that inflate past their declared sizes; HDF5 gzip, lzf and szip
chunks that decode past theirs, and chunks over the limit), duplicated member names, lying sizes, user
blocks (holding a zip, too), filters nobody can bound, and paths that are not files (a FIFO, devices, a
socket, a folder). Each is read whole under a memory limit of twice what the file *declares* (the sizes
of its arrays) plus ``--memory-slack`` MiB, whatever its streams would inflate to; an honest file must read
back (``read``), every other must end in the bridgeflow error its kind calls for, naming the file.

Example:
    python tests/fuzz/fuzz_serialize.py --mutations 2000            # the full run
    python tests/fuzz/fuzz_serialize.py --mutations 100 --formats hdf5
    python tests/fuzz/fuzz_serialize.py --crafted 200               # crafted files only
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

FORMATS = ("lmdb", "lmdb-nochecksum", "hdf5", "npz")
KINDS = ("zero-page", "random-page", "flip", "cut", "big-int", "alias")
MEMORY_FACTOR = 2.0
MEMORY_SLACK_MIB = 64
SUFFIX = {"lmdb": ".lmdb", "lmdb-nochecksum": ".lmdb", "hdf5": ".h5", "npz": ".npz"}


def datapoints(n: int = 120) -> list[dict]:
    """The datapoints every file holds: values over LMDB's page size, ragged arrays, text and bytes."""
    rng = np.random.default_rng(1234)
    out = []
    for i in range(n):
        out.append({"img": rng.integers(0, 256, (24, 24, 3), dtype=np.uint8),
                    "vec": rng.standard_normal(int(rng.integers(1, 40))).astype(np.float32),
                    "label": i % 10,
                    "name": f"item-{i}-" + "é" * int(rng.integers(0, 30)),
                    "raw": rng.bytes(int(rng.integers(0, 3000)))})
    return out


def write(fmt: str, path: str) -> None:
    from bridgeflow import DataFromList
    from bridgeflow.serialize import HDF5Serializer, LMDBSerializer, NumpySerializer

    df = DataFromList(datapoints(), shuffle=False)
    if fmt == "lmdb":
        LMDBSerializer.save(df, path, progress=False)
    elif fmt == "lmdb-nochecksum":
        LMDBSerializer.save(df, path, progress=False, checksum=False)
    elif fmt == "hdf5":
        HDF5Serializer.save(df, path, progress=False)
    else:
        NumpySerializer.save(df, path, progress=False)


def mutate(data: bytes, rng: random.Random, lmdb: bool = False) -> tuple[str, bytes]:
    """One random mutation of ``data``: (its kind, the mutated bytes)."""
    kind = rng.choices(KINDS, weights=(5, 2, 2, 1, 2, 2 if lmdb else 0))[0]
    b = bytearray(data)
    if kind in ("zero-page", "random-page"):
        page = rng.randrange(max(1, len(b) // 4096)) * 4096
        n = min(4096, len(b) - page)
        b[page:page + n] = bytes(n) if kind == "zero-page" else rng.randbytes(n)
    elif kind == "flip":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "big-int":
        width = rng.choice((2, 4, 8))
        at = rng.randrange(0, len(b) - width, width)
        b[at:at + width] = rng.choice((2 ** (8 * width) - 1, 2 ** (8 * width - 1), rng.randrange(2 ** (8 * width))
                                       )).to_bytes(width, "little")
    elif kind == "alias":
        alias_pointers(b, rng)
    else:
        del b[rng.randrange(len(b)):]
    return kind, bytes(b)


def alias_pointers(b: bytearray, rng: random.Random, psize: int = 4096) -> None:
    """Aim every node pointer of a random LMDB tree page at its first node, and give the page as many
    pointers as fit before that node: pages that claim hundreds of keys sharing one key's bytes."""
    def bounds(at: int) -> tuple[int, int]:
        return int.from_bytes(b[at + 12:at + 14], "little"), int.from_bytes(b[at + 14:at + 16], "little")

    # branch or leaf pages: not an overflow value's bytes, whose 'upper' may lie below its 'lower'
    pages = [p for p in range(2, len(b) // psize)
             if b[p * psize + 10] & 0x03 and 16 < bounds(p * psize)[0] <= bounds(p * psize)[1] < psize]
    if not pages:
        return
    at = rng.choice(pages) * psize
    lower, upper = bounds(at)
    first = b[at + 16:at + 18]
    count = (upper - 16) // 2
    b[at + 12:at + 14] = (16 + 2 * count).to_bytes(2, "little")
    b[at + 16:at + 16 + 2 * count] = bytes(first) * count
    if b[at + 10] & 0x02:  # a leaf: both meta pages count the entries it now claims
        for meta in (0, psize):
            entries = int.from_bytes(b[meta + 120:meta + 128], "little") + count - (lower - 16) // 2
            b[meta + 120:meta + 128] = entries.to_bytes(8, "little")


# --- the worker process: reads the files it is sent, one JSON answer a line ------------------------

def read_back(path: str, want: list | None = None, compare: bool = True) -> str:
    """Read ``path`` whole and classify the outcome (see the module doc). Nothing read is kept: each
    datapoint is compared with ``want`` as it comes, so memory is the reader's own. ``compare=False``
    (crafted files): ``read`` when the whole file reads without an error."""
    from bridgeflow._errors import BridgeflowError
    from bridgeflow.serialize import load_dataset
    from bridgeflow.testing import assert_same_datapoints

    want = datapoints() if want is None else want
    if not compare:
        want = []
    same = True
    try:
        ds = load_dataset(path, shuffle=False)
        try:
            ds.reset_state()
            n = len(ds)
            same = n == len(want)
            count = 0
            for i, dp in enumerate(ds):
                count += 1
                if compare and same and i < len(want):
                    same = _same(want[i], dp, assert_same_datapoints)
            same = same and count == n
            for i in range(n - 1, -1, -1):
                dp = ds[i]
                if compare and same:
                    same = _same(want[i], dp, assert_same_datapoints)
        finally:
            ds.close()
        if not compare:
            return "read"
    except MemoryError as exc:
        return f"memory:{type(exc).__name__}"
    except BridgeflowError as exc:
        if "MemoryError" in repr(exc.__cause__) or "allocat" in str(exc).lower():  # libhdf5's, wrapped
            return f"memory:{type(exc).__name__}"
        named = os.path.basename(path) in str(exc)
        return f"{'error' if named else 'foreign'}:{type(exc).__name__}"
    except Exception as exc:  # what the fuzz is there to find
        return f"foreign:{type(exc).__name__}"
    return "same" if same else "wrong"


def _same(a: Any, b: Any, check: Any) -> bool:
    try:
        check([a], [b])
    except AssertionError:
        return False
    return True


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(factor: float = MEMORY_FACTOR, slack_mib: int = MEMORY_SLACK_MIB) -> None:
    """Read each path from stdin; answer ``outcome resident-growth-bytes`` a line. A line ``PATH<TAB>N`` is
    a crafted file declaring N bytes: its limit is twice N plus the slack, and it is read without comparing."""
    import logging
    import resource

    logging.disable(logging.CRITICAL)
    want = datapoints()
    read_back(os.devnull, want)  # import the readers before the first limit
    import h5py  # noqa: F401 - what the first HDF5 file would import under the limit
    import lmdb  # noqa: F401

    from bridgeflow.serialize import _hdf5_format, _lmdb_format, _npz_format  # noqa: F401

    try:  # (not in trees before it: the fuzz also runs on those, to compare)
        from bridgeflow.serialize._hdf5_chunks import _lzf_decompress
    except ImportError:
        pass
    else:
        _lzf_decompress()
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    for line in sys.stdin:
        path, _, declared = line.rstrip("\n").partition("\t")
        crafted = bool(declared)
        budget = 2 * int(declared) if crafted else int(factor * os.path.getsize(path))
        limit = _status("VmSize") + budget + (slack_mib << 20)
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM starts again from VmRSS
            f.write("5")
        rss = _status("VmRSS")
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        try:
            outcome = read_back(path, want, compare=not crafted)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        sys.stdout.write(f"{outcome} {_status('VmHWM') - rss}\n")
        sys.stdout.flush()


class Reader:
    """A worker process, restarted after a hang or a crash."""

    def __init__(self, factor: float = MEMORY_FACTOR, slack_mib: int = MEMORY_SLACK_MIB) -> None:
        self.proc: subprocess.Popen | None = None
        self.factor, self.slack_mib = factor, slack_mib
        self.grew = 0  # resident memory the last read added (bytes)

    def _start(self) -> subprocess.Popen:
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        code = f"import fuzz_serialize; fuzz_serialize.worker({self.factor}, {self.slack_mib})"
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env)

    def read(self, path: str, timeout: float, declared: int | None = None) -> str:
        """The outcome of reading ``path``; ``declared``: a crafted file declaring that many bytes."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        proc.stdin.write(path + ("" if declared is None else f"\t{declared}") + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            self.stop()
            return "hang"
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self.proc = None
            return f"crash:{signal.Signals(-code).name if code < 0 else code}"
        outcome, grew = line.split()
        self.grew = int(grew)
        return outcome

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def run(fmt: str, mutations: int, seed: int, timeout: float, folder: str,
        reader: Reader | None = None) -> dict[str, Any]:
    """Mutate one format's file ``mutations`` times; the counts of outcomes (and of mutation kinds)."""
    own = reader is None
    reader = reader or Reader()
    original = os.path.join(folder, f"original-{fmt}{SUFFIX[fmt]}")
    write(fmt, original)
    with open(original, "rb") as f:
        data = f.read()
    rng = random.Random(f"{seed}-{fmt}")
    outcomes: collections.Counter = collections.Counter()
    bad: dict[str, list] = collections.defaultdict(list)
    kinds: collections.Counter = collections.Counter()
    most_grew = 0.0  # resident growth / file size, the largest seen
    t0 = time.perf_counter()
    try:
        assert reader.read(original, timeout * 4) == "same", f"{fmt}: the undamaged file does not read back"
        for t in range(mutations):
            kind, mutated = mutate(data, rng, lmdb=fmt.startswith("lmdb"))
            kinds[kind] += 1
            path = os.path.join(folder, f"m{t}{SUFFIX[fmt]}")
            with open(path, "wb") as f:
                f.write(mutated)
            outcome = reader.read(path, timeout)
            outcomes[outcome] += 1
            most_grew = max(most_grew, reader.grew / len(mutated))
            if outcome == "wrong" or outcome == "hang" or outcome.startswith(("crash", "foreign", "memory")):
                bad[outcome].append((t, kind))
            os.unlink(path)
    finally:
        if own:
            reader.stop()
    return {"format": fmt, "file_bytes": len(data), "mutations": mutations, "seed": seed,
            "outcomes": dict(sorted(outcomes.items())), "kinds": dict(sorted(kinds.items())),
            "hangs": outcomes["hang"], "crashes": sum(v for k, v in outcomes.items() if k.startswith("crash")),
            "foreign_errors": sum(v for k, v in outcomes.items() if k.startswith("foreign")),
            "silent_wrong": outcomes["wrong"],
            "out_of_memory": sum(v for k, v in outcomes.items() if k.startswith("memory")),
            "most_resident_growth_per_file_byte": round(most_grew, 2),
            "examples": {k: v[:5] for k, v in bad.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


def run_crafted(fmt: str, count: int, seed: int, timeout: float, folder: str,
                reader: Reader | None = None) -> dict[str, Any]:
    """Read ``count`` crafted files of ``fmt`` (``npz``, ``hdf5``; ``special``: every path that is not a
    file, once); the counts of outcomes, and those that were not what their kind calls for."""
    import crafted

    own = reader is None
    reader = reader or Reader()
    rng = np.random.default_rng([seed, FORMATS_CRAFTED.index(fmt)])
    outcomes: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    unexpected: list = []
    most_grew = 0.0
    t0 = time.perf_counter()
    try:
        cases = crafted.special_cases(folder) if fmt == "special" else range(count)
        for t, case in enumerate(cases):
            if fmt == "special":
                kind, path, declared, allowed = case
            else:
                path = os.path.join(folder, f"c{t}{'.npz' if fmt == 'npz' else '.h5'}")
                make = crafted.npz_case if fmt == "npz" else crafted.hdf5_case
                kind, declared, allowed = make(rng, path)
            kinds[kind] += 1
            outcome = reader.read(path, timeout, declared)
            outcomes[outcome] += 1
            most_grew = max(most_grew, reader.grew / (2 * declared + (MEMORY_SLACK_MIB << 20)))
            if outcome not in allowed:
                unexpected.append((t, kind, outcome))
            if fmt != "special":
                os.unlink(path)
    finally:
        if own:
            reader.stop()
    return {"format": f"{fmt}-crafted", "files": sum(kinds.values()), "seed": seed,
            "memory_limit": "2 x declared + 64 MiB", "outcomes": dict(sorted(outcomes.items())),
            "kinds": dict(sorted(kinds.items())), "unexpected": len(unexpected), "examples": unexpected[:10],
            "hangs": outcomes["hang"], "out_of_memory": sum(v for k, v in outcomes.items() if k.startswith("memory")),
            "most_resident_growth_per_limit": round(most_grew, 3), "seconds": round(time.perf_counter() - t0, 1)}


FORMATS_CRAFTED = ("npz", "hdf5", "special")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mutations", type=int, default=2000, help="per format (default 2000)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--crafted", type=int, default=0,
                   help="read this many crafted files per format (npz, hdf5; and every special path) instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds before a read counts as a hang")
    p.add_argument("--memory-factor", type=float, default=MEMORY_FACTOR,
                   help=f"memory limit: this many times the file's size (default {MEMORY_FACTOR})")
    p.add_argument("--memory-slack", type=int, default=MEMORY_SLACK_MIB,
                   help=f"... plus this many MiB (default {MEMORY_SLACK_MIB})")
    args = p.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bf_fuzz_")
    reader = Reader(args.memory_factor, args.memory_slack)
    try:
        if args.crafted:
            for fmt in FORMATS_CRAFTED:
                print(json.dumps({"bench": "fuzz_serialize", **run_crafted(fmt, args.crafted, args.seed, args.timeout,
                                                                            folder, reader)}), flush=True)
            return 0
        for fmt in args.formats.split(","):
            print(json.dumps({"bench": "fuzz_serialize", **run(fmt, args.mutations, args.seed, args.timeout,
                                                                folder, reader)}), flush=True)
    finally:
        reader.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
