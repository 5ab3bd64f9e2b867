"""The seeds' input-pipeline experiment with bridgeflow's TensorFlow inputs (JSON lines on stdout).

A 1024-1024-1 MLP trained with SGD on batches of 256, the batches made in Python by a DataFlow whose cost
is calibrated to about one training step. Inputs compared, in tf.compat.v1 graph mode and with
tf.function steps: feed (FeedInput: data made in the training thread), queue (QueueInput), staging
(QueueInput + StagingInput), dataset (to_tf_dataset) and dummy (DummyConstantInput: the model alone).
The tf.function calibration line also gives the step and batch times while both run at once: on a
small or shared machine they slow each other down, which bounds what any overlap can gain.

Each configuration (mode x TF intra-op threads) runs in its own subprocess, because the thread count must
be set before TensorFlow initializes. Inside one, the inputs are measured interleaved, ``--reps`` times;
every result line gives the median steps/s and the median of per-repetition ratios to dummy and feed
measured in the same repetition. Summary lines check the issue's target: with one intra-op thread the
pipelined inputs reach >= 1.4x feed. The GPU target (staging >= 0.9x dummy) needs a GPU machine.

Run:  python benchmarks/bench_tf.py [--reps 5] [--steps 60] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

BATCH, DIM, HIDDEN = 256, 1024, 1024
INPUTS = ["dummy", "feed", "queue", "staging", "dataset"]
PIPELINED = ["queue", "staging", "dataset"]
QUEUE_SIZE = 8


# --- the worker (one subprocess per configuration) ----------------------------------------------

def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    if args.intra:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra)
    from bridgeflow import RNGDataFlow
    from bridgeflow.adapters.tensorflow import DummyConstantInput, FeedInput, QueueInput, StagingInput, to_tf_dataset

    class SyntheticBatches(RNGDataFlow):
        """Endless batches whose Python/numpy cost is ``rounds`` draws of a 256x1024 normal matrix."""

        def __init__(self, rounds: int, seed: int = 0) -> None:
            self.rounds, self.seed = rounds, seed

        def __iter__(self):
            while True:
                x = self.rng.standard_normal((BATCH, DIM)).astype(np.float32)
                for _ in range(self.rounds - 1):
                    x += self.rng.standard_normal((BATCH, DIM)).astype(np.float32)
                yield [x, (x.sum(axis=1, keepdims=True) > 0).astype(np.float32)]

    graph = args.mode == "graph"
    session_config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=args.intra or 0)

    def mlp_vars():
        init = tf.random_normal_initializer(stddev=0.02, seed=1)
        return [tf.Variable(init([DIM, HIDDEN])), tf.Variable(tf.zeros([HIDDEN])),
                tf.Variable(init([HIDDEN, 1])), tf.Variable(tf.zeros([1]))]

    def loss_fn(v, x, y):
        h = tf.nn.relu(tf.matmul(x, v[0]) + v[1])
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=tf.matmul(h, v[2]) + v[3]))

    def sgd(v, x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(v, x, y)
        grads = tape.gradient(loss, v)
        return [var.assign_sub(0.1 * g) for var, g in zip(v, grads)], loss

    def make_input(kind: str, rounds: int):
        if kind == "dummy":
            return DummyConstantInput([[BATCH, DIM], [BATCH, 1]])
        df = SyntheticBatches(rounds)
        if kind == "feed":
            return FeedInput(df)
        if kind == "queue":
            return QueueInput(df, queue_size=QUEUE_SIZE, epochs=None, log_every_s=None)
        if kind == "staging":
            return StagingInput(QueueInput(df, queue_size=QUEUE_SIZE, epochs=None, log_every_s=None),
                                nr_stage=1)  # /gpu:0 when TF sees a GPU, else /cpu:0
        return to_tf_dataset(df)

    def measure_graph(kind: str, rounds: int, warm: int, steps: int) -> float:
        g = tf.Graph()
        with g.as_default():
            inp = make_input(kind, rounds)
            v = mlp_vars()
            if kind == "dataset":
                x, y = tf.compat.v1.data.make_one_shot_iterator(inp).get_next()
            else:
                x, y = inp.dequeue()
            train_op = tf.group(sgd(v, x, y)[0])
            with tf.compat.v1.Session(graph=g, config=session_config) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                if kind == "dataset":
                    for _ in range(warm):
                        sess.run(train_op)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        sess.run(train_op)
                    return steps / (time.perf_counter() - t0)
                with inp:
                    inp.start(sess)
                    inp.run_until_end(train_op, sess=sess, max_steps=warm)
                    t0 = time.perf_counter()
                    inp.run_until_end(train_op, sess=sess, max_steps=steps)
                    return steps / (time.perf_counter() - t0)

    v_eager = None

    def measure_function(kind: str, rounds: int, warm: int, steps: int) -> float:
        nonlocal v_eager
        if v_eager is None:
            v_eager = mlp_vars()
        v = v_eager
        inp = make_input(kind, rounds)
        if kind == "dataset":
            it = iter(inp)

            @tf.function
            def step_it(it):
                x, y = next(it)
                return sgd(v, x, y)[1]

            for _ in range(warm):
                step_it(it)
            t0 = time.perf_counter()
            for _ in range(steps):
                step_it(it)
            rate = steps / (time.perf_counter() - t0)
            del it
            return rate
        if kind == "feed":
            step = tf.function(lambda batch: sgd(v, batch[0], batch[1])[1])
        else:
            step = tf.function(lambda: sgd(v, *inp.dequeue())[1])
        with inp:
            inp.start()
            inp.run_until_end(step, max_steps=warm)
            t0 = time.perf_counter()
            inp.run_until_end(step, max_steps=steps)
            return steps / (time.perf_counter() - t0)

    measure = measure_graph if graph else measure_function

    def contention(rounds: int, steps: int) -> tuple[float, float]:
        """Steps/s of the model alone while a thread makes (and discards) batches, and that thread's
        batches/s meanwhile: how much the two sides slow each other down when run at once on this
        machine (shared cores, memory bandwidth, neighbours), which bounds what any overlap can gain."""
        import threading

        stop, made = threading.Event(), [0]

        def produce() -> None:
            src = SyntheticBatches(rounds)
            src.reset_state()
            for _ in src:
                made[0] += 1
                if stop.is_set():
                    return

        inp = DummyConstantInput([[BATCH, DIM], [BATCH, 1]])
        v = mlp_vars()
        step = tf.function(lambda: sgd(v, *inp.dequeue())[1])
        inp.run_until_end(step, max_steps=3)
        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        time.sleep(0.2)
        m0, t0 = made[0], time.perf_counter()
        inp.run_until_end(step, max_steps=steps)
        dt = time.perf_counter() - t0
        stop.set()
        thread.join()
        return steps / dt, (made[0] - m0) / dt

    # calibration: one step of the model alone, and one round of batch creation
    step_rate = measure("dummy", 1, 5, 20)
    src = SyntheticBatches(1)
    src.reset_state()
    it = iter(src)
    next(it)
    t0 = time.perf_counter()
    for _ in range(10):
        next(it)
    round_s = (time.perf_counter() - t0) / 10
    rounds = max(1, round(1.0 / step_rate / round_s))
    warm = QUEUE_SIZE + 5  # drain what was prefetched before the clock starts
    busy_step_rate, busy_data_rate = contention(rounds, args.steps) if not graph else (None, None)

    for kind in INPUTS:  # one untimed round: first-use costs (allocator, thread pools) hit nobody's result
        measure(kind, rounds, warm, 5)
    results: dict[str, list[float]] = {k: [] for k in INPUTS}
    for rep in range(args.reps):
        order = INPUTS[rep % len(INPUTS):] + INPUTS[:rep % len(INPUTS)]  # rotate: no input always first
        for kind in order:
            results[kind].append(measure(kind, rounds, warm, args.steps))

    base = {"bench": "tf_inputs", "mode": args.mode, "intra_op_threads": args.intra or "default",
            "device": "gpu" if tf.config.list_logical_devices("GPU") else "cpu", "cpu_count": os.cpu_count(),
            "machine": platform.node(), "tf": tf.__version__,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}
    print(json.dumps({**base, "kind": "calibration", "step_ms_dummy": round(1000 / step_rate, 2),
                      "data_round_ms": round(round_s * 1000, 2), "data_rounds_per_batch": rounds,
                      "data_ms_per_batch": round(rounds * round_s * 1000, 2),
                      "concurrent_step_ms": busy_step_rate and round(1000 / busy_step_rate, 2),
                      "concurrent_data_ms_per_batch": busy_data_rate and round(1000 / busy_data_rate, 2)}),
          flush=True)
    for kind in INPUTS:
        reps = results[kind]
        line = {**base, "kind": "result", "input": kind, "steps_per_s_median": round(statistics.median(reps), 2),
                "steps_per_s_reps": [round(r, 2) for r in reps],
                "vs_dummy_median": round(statistics.median(r / d for r, d in zip(reps, results["dummy"])), 3),
                "vs_feed_median": round(statistics.median(r / f for r, f in zip(reps, results["feed"])), 3)}
        print(json.dumps(line), flush=True)


# --- the driver ---------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per measurement")
    ap.add_argument("--quick", action="store_true", help="2 reps of 20 steps (a smoke run)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["graph", "function"], default="graph")
    ap.add_argument("--intra", type=int, default=0, help="TF intra-op threads (0: TF's default)")
    ap.add_argument("--threads", choices=["1", "default", "both"], default="both",
                    help="which intra-op thread settings to run (default: both)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.steps = 2, 20
    if args.worker:
        worker(args)
        return
    lines = []
    settings = {"1": (1,), "default": (0,), "both": (1, 0)}[args.threads]
    for intra in settings:
        for mode in ("graph", "function"):
            cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--intra", str(intra),
                   "--reps", str(args.reps), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"worker {mode} intra={intra} failed with exit code {proc.returncode}")
            for text in proc.stdout.splitlines():
                if text.startswith("{"):
                    print(text, flush=True)
                    lines.append(json.loads(text))
    for intra in [i or "default" for i in settings]:
        for mode in ("graph", "function"):
            res = {r["input"]: r for r in lines if r["kind"] == "result" and r["mode"] == mode
                   and r["intra_op_threads"] == intra}
            summary = {"bench": "tf_inputs", "kind": "summary", "mode": mode, "intra_op_threads": intra,
                       "pipelined_vs_feed": {k: res[k]["vs_feed_median"] for k in PIPELINED},
                       "pipelined_vs_dummy": {k: res[k]["vs_dummy_median"] for k in PIPELINED}}
            if intra == 1:
                summary["target"] = "pipelined >= 1.4x feed with one intra-op thread"
                summary["target_met"] = {k: res[k]["vs_feed_median"] >= 1.4 for k in PIPELINED}
            print(json.dumps(summary), flush=True)
    devices = {r["device"] for r in lines}
    gpu = {"bench": "tf_inputs", "kind": "gpu_target", "target": "staging >= 0.9x dummy on a GPU"}
    if "gpu" in devices:
        ratios = {f'{r["mode"]}/{r["intra_op_threads"]}': r["vs_dummy_median"] for r in lines
                  if r["kind"] == "result" and r["input"] == "staging"}
        gpu.update(status="measured", staging_vs_dummy=ratios, met={k: v >= 0.9 for k, v in ratios.items()})
    else:
        gpu.update(status="unmeasured", reason="no GPU on this machine")
    print(json.dumps(gpu), flush=True)


if __name__ == "__main__":
    main()
