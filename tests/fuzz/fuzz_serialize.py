"""Damage dataset files at random and read them back: every read must end, in bounded time, with the
data exactly as saved or a bridgeflow error naming the file; never a hang, a crash or different data.

Each format's file is written by the current code from one seeded set of datapoints (arrays of a fixed
and of a varying shape, numbers, text and bytes), then mutated ``--mutations`` times: a zeroed 4 KiB
page, random bytes over a 4 KiB page, 1-8 flipped bytes, a cut at a random length. Each mutated file is
read whole (length, one sequential pass, random access by index) in a separate worker process that the
runner kills after ``--timeout`` seconds. Outcomes:

- ``same``: read back exactly as saved (the mutation hit bytes no reader uses);
- ``error:<Type>``: a bridgeflow error naming the file (what damage must give);
- ``foreign:<Type>``: any other exception, or a bridgeflow error without the file's name;
- ``wrong``: read without an error but different from what was saved (silent);
- ``hang``: killed at the timeout; ``crash:<signal>``: the worker died.

One JSON line per format on stdout. Not collected by pytest; ``tests/test_serialize_fuzz.py`` runs a
few hundred mutations per format through the same code.

Example:
    python tests/fuzz/fuzz_serialize.py --mutations 2000            # the full run
    python tests/fuzz/fuzz_serialize.py --mutations 100 --formats hdf5
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
KINDS = ("zero-page", "random-page", "flip", "cut")
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


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One random mutation of ``data``: (its kind, the mutated bytes)."""
    kind = rng.choices(KINDS, weights=(5, 2, 2, 1))[0]
    b = bytearray(data)
    if kind in ("zero-page", "random-page"):
        page = rng.randrange(max(1, len(b) // 4096)) * 4096
        n = min(4096, len(b) - page)
        b[page:page + n] = bytes(n) if kind == "zero-page" else rng.randbytes(n)
    elif kind == "flip":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    else:
        del b[rng.randrange(len(b)):]
    return kind, bytes(b)


# --- the worker process: reads the files it is sent, one JSON answer a line ------------------------

def read_back(path: str) -> str:
    """Read ``path`` whole and classify the outcome (see the module doc)."""
    from bridgeflow.errors import BridgeflowError
    from bridgeflow.serialize import load_dataset
    from bridgeflow.testing import assert_same_datapoints

    try:
        ds = load_dataset(path, shuffle=False)
        try:
            ds.reset_state()
            n = len(ds)
            seq = list(ds)
            by_index = [ds[i] for i in range(n - 1, -1, -1)][::-1]
        finally:
            ds.close()
    except BridgeflowError as exc:
        named = os.path.basename(path) in str(exc)
        return f"{'error' if named else 'foreign'}:{type(exc).__name__}"
    except Exception as exc:  # what the fuzz is there to find
        return f"foreign:{type(exc).__name__}"
    try:
        want = datapoints()
        assert len(seq) == n == len(want)
        assert_same_datapoints(want, seq)
        assert_same_datapoints(want, by_index)
    except AssertionError:
        return "wrong"
    return "same"


def worker() -> None:
    import resource

    soft = 8 << 30  # a damaged size must not take the machine's memory
    resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))
    import logging

    logging.disable(logging.CRITICAL)
    for line in sys.stdin:
        outcome = read_back(line.strip())
        sys.stdout.write(outcome + "\n")
        sys.stdout.flush()


class Reader:
    """A worker process, restarted after a hang or a crash."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        return subprocess.Popen([sys.executable, "-c", "import fuzz_serialize; fuzz_serialize.worker()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def read(self, path: str, timeout: float) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        proc.stdin.write(path + "\n")
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
        return line.strip()

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
    t0 = time.perf_counter()
    try:
        assert reader.read(original, timeout * 4) == "same", f"{fmt}: the undamaged file does not read back"
        for t in range(mutations):
            kind, mutated = mutate(data, rng)
            kinds[kind] += 1
            path = os.path.join(folder, f"m{t}{SUFFIX[fmt]}")
            with open(path, "wb") as f:
                f.write(mutated)
            outcome = reader.read(path, timeout)
            outcomes[outcome] += 1
            if outcome == "wrong" or outcome == "hang" or outcome.startswith(("crash", "foreign")):
                bad[outcome].append((t, kind))
            os.unlink(path)
    finally:
        if own:
            reader.stop()
    return {"format": fmt, "file_bytes": len(data), "mutations": mutations, "seed": seed,
            "outcomes": dict(sorted(outcomes.items())), "kinds": dict(sorted(kinds.items())),
            "hangs": outcomes["hang"], "crashes": sum(v for k, v in outcomes.items() if k.startswith("crash")),
            "foreign_errors": sum(v for k, v in outcomes.items() if k.startswith("foreign")),
            "silent_wrong": outcomes["wrong"], "examples": {k: v[:5] for k, v in bad.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mutations", type=int, default=2000, help="per format (default 2000)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds before a read counts as a hang")
    args = p.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bf_fuzz_")
    try:
        for fmt in args.formats.split(","):
            print(json.dumps({"bench": "fuzz_serialize", **run(fmt, args.mutations, args.seed, args.timeout,
                                                                folder)}), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
