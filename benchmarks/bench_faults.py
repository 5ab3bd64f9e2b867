"""What the fault options cost (see docs/faults.md): ``max_restarts`` and ``on_error="skip"`` when nothing fails,
and one restart when a worker dies.

Options: the same pipeline with the options off (the default), ``max_restarts=3`` and ``on_error="skip"``, each
run in a fresh interpreter (an untimed epoch, then ``--epochs`` timed ones), interleaved ``--reps`` times;
CPU time of this process and its workers per item is the figure a busy machine disturbs least. With ``--base
COMMIT`` the options-off pipeline also runs on that tree (compare.py's temporary worktree), interleaved with
the others: the cost of the code that is there when nothing fails, against the tree before it. Cases:

- ``w1``: bench_parallel's W1, 3x224x224 uint8 + a label, ``BatchData(64)`` fused after a 2-worker
  ``MultiProcessMapData``;
- ``loader_images``: the torch ``DataLoader``, 2 workers, the same samples as tensors, batch 64;
- ``loader_ints``: the torch ``DataLoader``, 2 workers, an int per sample, batch 4096, shuffled (the per-sample
  cost shows most).

Restart: a 2-worker ``MultiProcessMapData`` with one datapoint (20 ms of work) in flight at a time; the time from
a SIGKILL of the worker holding it to its result (the death seen, a new worker started, the datapoint mapped
again), less the time of a plain result; ``--start-method`` chooses how workers start.

Run: python benchmarks/bench_faults.py [--reps 5] [--epochs 3] [--cases w1,loader_images,loader_ints,restart]
     [--base COMMIT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OPTIONS = {"off": {}, "max_restarts=3": {"max_restarts": 3}, "on_error=skip": {"on_error": "skip"}}
BATCH = 64


def _usage() -> float:
    sys.path.insert(0, HERE)
    from compare import usage
    return usage()[0]


def _run_w1(options: dict, epochs: int) -> tuple[int, float, float]:
    import numpy as np

    import bridgeflow as bf

    bank = np.random.default_rng(0).integers(0, 256, (512, 3, 224, 224), dtype=np.uint8)
    src = bf.DataFromList(list(range(BATCH * 80)), shuffle=False)
    df = bf.BatchData(bf.MultiProcessMapData(src, 2, lambda i: [bank[i % 512], i], start_method="fork", **options),
                      BATCH)
    with df:
        return _timed(lambda: sum(len(b[1]) for b in df), epochs)


def _run_loader(case: str, options: dict, epochs: int) -> tuple[int, float, float]:
    import numpy as np
    import torch

    from bridgeflow.adapters.torch import DataLoader

    if case == "loader_images":
        bank = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (64, 3, 224, 224), dtype=np.uint8))

        class Images(torch.utils.data.Dataset):
            def __len__(self):
                return BATCH * 60

            def __getitem__(self, i):
                return bank[i % 64], i

        loader = DataLoader(Images(), batch_size=BATCH, num_workers=2, persistent_workers=True, **options)
        count = lambda: sum(len(b[1]) for b in loader)
    else:
        loader = DataLoader(list(range(4096 * 60)), batch_size=4096, shuffle=True, num_workers=2,
                            persistent_workers=True, **options)
        count = lambda: sum(len(b) for b in loader)
    try:
        return _timed(count, epochs)
    finally:
        loader.close()


def _timed(epoch, epochs: int) -> tuple[int, float, float]:
    epoch()
    c0, t0 = _usage(), time.perf_counter()
    items = sum(epoch() for _ in range(epochs))
    return items, time.perf_counter() - t0, _usage() - c0


def child(case: str, option: str, epochs: int, tree: str | None) -> None:
    if case.startswith("loader"):
        import torch  # noqa: F401  (first, as a training script imports it)
    if tree is not None:
        sys.path.insert(0, HERE)
        from compare import use_tree
        use_tree(tree)
    options = OPTIONS[option]
    if case == "w1":
        items, wall, cpu = _run_w1(options, epochs)
    else:
        items, wall, cpu = _run_loader(case, options, epochs)
    print(json.dumps({"items": items, "wall_s": wall, "cpu_s": cpu}))


def _slow(i: int) -> list:
    time.sleep(0.02)  # the datapoint is still in flight when its worker is killed
    return [i]


def restart_latency(reps: int, start_method: str) -> dict:
    """Median seconds from the SIGKILL of the worker holding the one datapoint in flight (20 ms of work) to its
    result, and of a plain result (the same 20 ms)."""
    import bridgeflow as bf

    flow = bf.MultiProcessMapData(bf.DataFromList(list(range(10_000)), shuffle=False), 2, _slow, buffer_size=1,
                                  strict=True, start_method=start_method, max_restarts=reps)
    plain, restarted = [], []
    with flow:
        it = iter(flow)
        next(it)
        for _ in range(reps):
            t0 = time.perf_counter()
            next(it)
            plain.append(time.perf_counter() - t0)
            pool = flow._pool
            owner = pool._owner[pool._next_result]  # the worker holding the datapoint in flight
            os.kill(pool.pids[owner], signal.SIGKILL)
            t0 = time.perf_counter()
            next(it)
            restarted.append(time.perf_counter() - t0)
        assert pool.restarts == reps
    return {"case": "restart", "start_method": start_method, "reps": reps,
            "plain_result_ms": round(1000 * statistics.median(plain), 1),
            "restarted_result_ms": round(1000 * statistics.median(restarted), 1),
            "restart_ms": round(1000 * (statistics.median(restarted) - statistics.median(plain)), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cases", default="w1,loader_images,loader_ints,restart")
    parser.add_argument("--start-method", default="fork")
    parser.add_argument("--base", help="a commit: the options-off pipeline on that tree too")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.epochs, args.tree)
        return 0
    sys.path.insert(0, HERE)
    from compare import Tree
    base = Tree("base", args.base) if args.base else None
    try:
        return run_all(args, base)
    finally:
        if base is not None:
            base.close()


def run_all(args: argparse.Namespace, base: object) -> int:
    configs = [("head", o) for o in OPTIONS] + ([("base", "off")] if base is not None else [])
    for case in args.cases.split(","):
        if case == "restart":
            print(json.dumps(restart_latency(args.reps * 4, args.start_method)), flush=True)
            continue
        runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
        for rep in range(args.reps):
            for tree, option in configs if rep % 2 == 0 else list(reversed(configs)):
                cmd = [sys.executable, __file__, "--epochs", str(args.epochs), "--child", case, option]
                if tree == "base":
                    cmd += ["--tree", base.path]  # type: ignore[attr-defined]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs[(tree, option)].append(json.loads(out.stdout.splitlines()[-1]))
        cpu = {c: [1e6 * r["cpu_s"] / r["items"] for r in rs] for c, rs in runs.items()}
        for (tree, option), rs in runs.items():
            rate = [r["items"] / r["wall_s"] for r in rs]
            print(json.dumps({"case": case, "tree": tree, "options": option,
                              "cpu_us_per_item": round(statistics.median(cpu[(tree, option)]), 3),
                              "items_per_s": round(statistics.median(rate), 1), "reps": len(rs)}), flush=True)
        off = cpu[("head", "off")]
        for tree, option in configs[1:]:
            name = "head off vs base off" if tree == "base" else f"head {option} vs head off"
            paired = [h / o for h, o in zip(off, cpu[(tree, option)])] if tree == "base" else \
                [o / h for o, h in zip(cpu[(tree, option)], off)]
            print(json.dumps({"case": case, "ratio": f"cpu_per_item {name}",
                              "value": round(statistics.median(paired), 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
