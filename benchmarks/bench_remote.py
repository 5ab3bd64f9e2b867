"""Benchmark: remote streaming and the Ray map stage against their local baselines, in one run.

Cases (the source is 3x224x224 uint8 images cycling over 64 random ones + an int label, so reading
costs next to nothing):

- ``zmq``: one producer process runs ``send_dataflow_zmq`` on loopback (``tcp`` and ``ipc``);
  ``RemoteDataZMQ`` consumes. Anchor: ``MultiProcessRunner`` with one worker on the same source. Each
  repetition starts fresh, warms up ``--warmup`` datapoints, then times ``--samples`` datapoints (MB/s of
  array bytes received). Target: zmq_tcp / runner >= 0.7. ``raw_pyzmq_tcp`` sends the same frames through
  plain pyzmq sockets (no heartbeats, no decoding): the transport's own ceiling, for reference.
  ``zmq_tcp_curve`` is ``zmq_tcp`` with CurveZMQ keys (encrypted, authenticated): its ratio to
  ``zmq_tcp`` is the price of the encryption.
- ``map_2ms``: a ~2 ms CPU-bound per-sample map on 2 workers. ``RayMapData`` (local Ray, 2 CPUs, started
  once, actor start-up not timed) against ``MultiProcessMapData`` (worker start-up not timed); one
  epoch of ``--map-samples`` is timed.

Repetitions are interleaved (anchor, candidate, anchor, ...). Each line is one JSON object: per case the
median and every repetition, then a ratio line (candidate median throughput / anchor median throughput).

Run: python benchmarks/bench_remote.py [--reps 5] [--samples 2000] [--map-samples 400] [--no-ray]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import tempfile
import time

import numpy as np

from bridgeflow import DataFlow, MultiProcessMapData, MultiProcessRunner
from bridgeflow.remote import RayMapData, RemoteDataZMQ, generate_keys, send_dataflow_zmq

SHAPE = (3, 224, 224)
DP_BYTES = int(np.prod(SHAPE)) + 8


class Images(DataFlow):
    """``n`` datapoints (``None``: endless) cycling over 64 random images, with an int label."""

    def __init__(self, n: int | None) -> None:
        rng = np.random.default_rng(0)
        self.images = [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(64)]
        self.n = n

    def __iter__(self):
        i = 0
        while self.n is None or i < self.n:
            yield [self.images[i % 64], i]
            i += 1


def spin_2ms(dp):
    end = time.perf_counter() + 0.002  # stands for a CPU-bound augmentation
    while time.perf_counter() < end:
        pass
    return [dp[0][:, :, ::-1].copy(), dp[1]]


def _produce(addr: str, keys: str | None = None) -> None:
    send_dataflow_zmq(Images(None), addr, hwm=50, epochs=1, heartbeat_s=0.5, keys=keys)


def _produce_raw(addr: str) -> None:
    import zmq

    from bridgeflow._codec import encode_frames

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 50)
    sock.bind(addr)
    for dp in Images(None):
        sock.send_multipart(encode_frames(dp), copy=False)


def run_raw_pyzmq(addr: str, warmup: int, samples: int) -> float:
    """The transport's ceiling: the same frames through plain pyzmq sockets, received, not decoded."""
    import zmq

    proc = mp.get_context("fork").Process(target=_produce_raw, args=(addr,), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 50)
    sock.connect(addr)
    try:
        for _ in range(warmup):
            sock.recv_multipart(copy=False)
        t0 = time.perf_counter()
        for _ in range(samples):
            sock.recv_multipart(copy=False)
        return time.perf_counter() - t0
    finally:
        sock.close(0)
        ctx.term()
        proc.kill()
        proc.join()


def _consume(df: DataFlow, warmup: int, samples: int) -> float:
    it = iter(df)
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(samples):
        next(it)
    dt = time.perf_counter() - t0
    it.close()
    return dt


def run_runner(warmup: int, samples: int) -> float:
    with MultiProcessRunner(Images(None), num_prefetch=16, num_proc=1) as df:
        df.reset_state()
        return _consume(df, warmup, samples)


def run_zmq(addr: str, warmup: int, samples: int, keys: str | None = None) -> float:
    proc = mp.get_context("fork").Process(target=_produce, args=(addr, keys), daemon=True)
    proc.start()
    try:
        with RemoteDataZMQ(addr, hwm=50, timeout=30, keys=keys) as df:
            df.reset_state()
            return _consume(df, warmup, samples)
    finally:
        proc.kill()
        proc.join()


def run_map(kind: str, samples: int) -> float:
    src = Images(samples)
    if kind == "ray":
        df: DataFlow = RayMapData(src, spin_2ms, num_workers=2, batch_size=16)
    else:
        df = MultiProcessMapData(src, 2, spin_2ms, strict=True)
    with df:
        df.reset_state()
        t0 = time.perf_counter()
        n = sum(1 for _ in df)
        dt = time.perf_counter() - t0
    assert n == samples, (kind, n)
    return dt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(name: str, case: str, times: list[float], amount: float, unit: str) -> dict:
    rates = [amount / t for t in times]
    return {"bench": "remote", "case": case, "loader": name, "median_s": statistics.median(times),
            f"median_{unit}": statistics.median(rates), f"reps_{unit}": [round(r, 1) for r in rates]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--map-samples", type=int, default=400)
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray map case")
    args = ap.parse_args()
    machine = {"bench": "remote", "machine": platform.node(), "cpus": os.cpu_count(),
               "python": platform.python_version()}
    print(json.dumps(machine), flush=True)

    mb = args.samples * DP_BYTES / 1e6
    times: dict[str, list[float]] = {"runner": [], "zmq_tcp": [], "zmq_tcp_curve": [], "zmq_ipc": [],
                                     "raw_pyzmq_tcp": []}
    with tempfile.TemporaryDirectory(prefix="bf_bench_remote_") as tmp:  # the ipc socket files and the keys
        keys = str(generate_keys(os.path.join(tmp, "keys")).source)
        for rep in range(args.reps):
            times["runner"].append(run_runner(args.warmup, args.samples))
            times["zmq_tcp"].append(run_zmq(f"tcp://127.0.0.1:{free_port()}", args.warmup, args.samples))
            times["zmq_tcp_curve"].append(run_zmq(f"tcp://127.0.0.1:{free_port()}", args.warmup, args.samples,
                                                  keys))
            times["zmq_ipc"].append(run_zmq(f"ipc://{tmp}/bench{rep}.sock", args.warmup, args.samples))
            times["raw_pyzmq_tcp"].append(
                run_raw_pyzmq(f"tcp://127.0.0.1:{free_port()}", args.warmup, args.samples))
    lines = {k: summary(k, "zmq_stream", v, mb, "MB_s") for k, v in times.items()}
    for line in lines.values():
        print(json.dumps(line), flush=True)
    for k in ("zmq_tcp", "zmq_tcp_curve", "zmq_ipc", "raw_pyzmq_tcp"):
        ratio = lines[k]["median_MB_s"] / lines["runner"]["median_MB_s"]
        print(json.dumps({"bench": "remote", "case": "zmq_stream", "ratio": f"{k}/runner", "value": round(ratio, 3),
                          "target": ">= 0.7", "met": ratio >= 0.7}), flush=True)
    curve = [t / c for t, c in zip(times["zmq_tcp"], times["zmq_tcp_curve"])]  # per repetition: same minute
    print(json.dumps({"bench": "remote", "case": "zmq_stream", "ratio": "zmq_tcp_curve/zmq_tcp",
                      "value": round(statistics.median(curve), 3), "reps": [round(r, 3) for r in curve],
                      "note": "CurveZMQ encryption and authentication against plain TCP"}), flush=True)

    if args.no_ray:
        return
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        mtimes: dict[str, list[float]] = {"multiprocess": [], "ray": []}
        for _ in range(args.reps):
            mtimes["multiprocess"].append(run_map("multiprocess", args.map_samples))
            mtimes["ray"].append(run_map("ray", args.map_samples))
    finally:
        ray.shutdown()
    mlines = {k: summary(k, "map_2ms", v, args.map_samples, "samples_s") for k, v in mtimes.items()}
    for line in mlines.values():
        print(json.dumps(line), flush=True)
    ratio = mlines["ray"]["median_samples_s"] / mlines["multiprocess"]["median_samples_s"]
    print(json.dumps({"bench": "remote", "case": "map_2ms", "ratio": "ray/multiprocess", "value": round(ratio, 3),
                      "note": "one host: local processes are expected to win"}), flush=True)


if __name__ == "__main__":
    main()
