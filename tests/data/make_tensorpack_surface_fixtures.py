"""Write tests/data/tensorpack_surface.json: what tensorpack 0.11 does with the DataFlow surface bridgeflow
copies: positional orders (their parameters, and how many workers each call starts), tensorpack's older
keywords, old-style ``get_data()``/``size()`` subclasses, and ``LocallyShuffleData``'s stream.

The cases and the code that observes them are defined here and take the library's ``dataflow`` module as
an argument: tests/test_tensorpack_surface.py runs the very same functions over ``bridgeflow.dataflow``
(only the import differs) and compares. This module imports only numpy and the standard library at top
level; only ``main()`` imports tensorpack. Regenerate with a Python that has tensorpack 0.11 and numpy < 2
(no TensorFlow needed)::

    python -m venv /tmp/tpvenv && /tmp/tpvenv/bin/pip install tensorpack==0.11 "numpy<2"
    /tmp/tpvenv/bin/python tests/data/make_tensorpack_surface_fixtures.py              # rewrites tests/data/
    /tmp/tpvenv/bin/python tests/data/make_tensorpack_surface_fixtures.py --out DIR    # anywhere else

Randomness: ``LocallyShuffleData`` and the old-style random flow get ``numpy.random.RandomState(SEED)`` as
``df.rng`` after ``reset_state()`` in both libraries, so both draw the same numbers.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import threading
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = "tensorpack_surface.json"
SEED = 1234
# In a forked child of in_child(), the flows it built, kept until it leaves with os._exit: collected earlier,
# tensorpack's runners join their threads in __del__, several seconds each, for nothing the child reports.
KEPT: list | None = None

# Every name whose parameters are compared: tensorpack's positional parameters must be the first ones of
# bridgeflow's, in the same order (bridgeflow may take more after them).
SIGNATURES = [
    "MultiProcessRunner", "MultiProcessRunnerZMQ", "PrefetchData", "PrefetchDataZMQ", "MultiProcessPrefetchData",
    "MultiThreadRunner", "MultiProcessMapData", "MultiProcessMapDataZMQ", "MultiThreadMapData",
    "MultiProcessMapAndBatchData", "MultiProcessMapAndBatchDataZMQ", "LocallyShuffleData", "BatchData",
    "FixedSizeData", "RepeatedData", "MapData", "MapDataComponent", "CacheData", "PrintData",
]

# (case, expression) -> how many worker processes or threads reset_state() starts. Names available to the
# expressions: the dataflow module's names, ``ds`` (10 datapoints), ``get_df`` and ``plus_one``.
WORKERS = {
    "MultiProcessRunner(ds, 3, 2)": "MultiProcessRunner(ds, 3, 2)",
    "MultiProcessRunner(ds, 2, 3)": "MultiProcessRunner(ds, 2, 3)",
    "MultiProcessRunner by keyword": "MultiProcessRunner(ds, num_proc=2, num_prefetch=5)",
    "PrefetchData(ds, 4, 3)": "PrefetchData(ds, 4, 3)",
    "MultiProcessPrefetchData(ds, 3, 2)": "MultiProcessPrefetchData(ds, 3, 2)",
    "MultiProcessRunnerZMQ(ds)": "MultiProcessRunnerZMQ(ds)",
    "MultiProcessRunnerZMQ(ds, 3)": "MultiProcessRunnerZMQ(ds, 3)",
    "PrefetchDataZMQ(ds, 2, 8)": "PrefetchDataZMQ(ds, 2, 8)",
    "MultiThreadRunner(get_df, 3, 2)": "MultiThreadRunner(get_df, 3, 2)",
    "MultiThreadRunner(get_df, 2, 3)": "MultiThreadRunner(get_df, 2, 3)",
    "MultiProcessMapData(ds, 2, f)": "MultiProcessMapData(ds, 2, plus_one)",
    "MultiProcessMapDataZMQ(ds, 3, f)": "MultiProcessMapDataZMQ(ds, 3, plus_one)",
    "MultiThreadMapData(ds, 3, f)": "MultiThreadMapData(ds, 3, plus_one)",
    "MultiProcessMapAndBatchData(ds, 2, f, 2, 8)": "MultiProcessMapAndBatchData(ds, 2, plus_one, 2, 8)",
}

# tensorpack's older keywords, with the arguments that go with them.
NR_KEYWORDS = {
    "MultiProcessRunner(nr_prefetch, nr_proc)": "MultiProcessRunner(ds, nr_prefetch=3, nr_proc=2)",
    "MultiProcessRunnerZMQ(nr_proc)": "MultiProcessRunnerZMQ(ds, nr_proc=2)",
    "PrefetchData(nr_prefetch, nr_proc)": "PrefetchData(ds, nr_prefetch=3, nr_proc=2)",
    "MultiThreadRunner(nr_prefetch, nr_thread)": "MultiThreadRunner(get_df, nr_prefetch=3, nr_thread=2)",
    "MultiProcessMapData(nr_proc)": "MultiProcessMapData(ds, nr_proc=2, map_func=plus_one)",
    "MultiThreadMapData(nr_thread)": "MultiThreadMapData(ds, nr_thread=2, map_func=plus_one)",
    "LocallyShuffleData(nr_reuse)": "LocallyShuffleData(ds, 4, nr_reuse=2)",
}

# old-style flows (classes from old_style_classes) -> what two epochs of them yield, len() and size()
OLD_STYLE = {
    "OldRange(5)": "OldRange(5)",
    "OldDouble(OldRange(4))": "OldDouble(OldRange(4))",
    "OldOffset(3)": "OldOffset(3)",
    "OldNoise(6)": "OldNoise(6)",
    "BatchData(OldDouble(OldRange(7)), 3)": "BatchData(OldDouble(OldRange(7)), 3)",
    "MapData(OldOffset(4), ...)": "MapData(OldOffset(4), lambda dp: [dp[0] * 10])",
    "OldDouble(DataFromList)": "OldDouble(DataFromList([[i] for i in range(4)], shuffle=False))",
}

# LocallyShuffleData(DataFromList(range(n)), buffer_size, num_reuse, shuffle_interval): `epochs` times
# len() datapoints of its stream (tensorpack: one iterator; bridgeflow: that many iterations)
LOCAL_SHUFFLE = {
    "n10 b4": (10, 4, 1, None, 3),
    "n10 b4 reuse2": (10, 4, 2, None, 3),
    "n7 b20 interval5": (7, 20, 1, 5, 4),
    "n50 b9 reuse3 interval2": (50, 9, 3, 2, 2),
    "n30 b6 no shuffle": (30, 6, 1, 10**9, 2),
    "n100 b30": (100, 30, 1, None, 5),
    "n8 b3 interval1": (8, 3, 1, 1, 6),
    "n12 b2 default interval": (12, 2, 1, None, 2),
}


def plus_one(dp):
    return [dp[0] + 1]


def names(df_module) -> dict:
    env = {k: getattr(df_module, k) for k in dir(df_module) if not k.startswith("_")}
    env.update(np=np, plus_one=plus_one,
               get_df=lambda: df_module.DataFromList([[i] for i in range(10)], shuffle=False))
    env["ds"] = df_module.DataFromList([[i] for i in range(10)], shuffle=False)
    return env


# --- observations -----------------------------------------------------------------------------------


def signature(df_module, name: str) -> dict:
    params = [p for p in inspect.signature(getattr(df_module, name)).parameters.values()]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    return {"positional": positional, "keyword_only": keywords}


def child_pids() -> set[int]:
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me:
                out.add(int(entry))
    return out


def workers_started(df_module, expr: str) -> dict:
    """Build the flow, reset it, and count the processes and threads that appeared; then release them
    (``close()`` where the flow has one; the caller of a flow without one kills what it started)."""
    env = names(df_module)
    df = eval(expr, env)
    procs0, threads0 = child_pids(), threading.active_count()
    df.reset_state()
    out = {"processes": len(child_pids() - procs0), "threads": threading.active_count() - threads0}
    close = getattr(df, "close", None)
    if close is not None:
        close()
    if KEPT is not None:
        KEPT.append(df)
    return out


def constructed(df_module, expr: str) -> dict:
    """Whether the call is accepted, the warnings it gives, and the counts the flow ends up with."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            df = eval(expr, names(df_module))
        except TypeError as exc:
            return {"error": "TypeError", "message": str(exc)}
    # UnshardedWarning: tensorpack says the same in its log (its runners assume i.i.d. datapoints), not as a
    # Python warning; what is compared here is whether the call is accepted, with which counts
    out = {"warnings": sorted({w.category.__name__ for w in caught} - {"UnshardedWarning"})}
    for attr in ("num_prefetch", "num_reuse", "num_workers", "num_proc", "num_thread"):
        value = getattr(df, attr, None)
        if isinstance(value, int):
            out[attr] = value
    close = getattr(df, "close", None)
    if close is not None:
        close()
    if KEPT is not None:
        KEPT.append(df)
    return out


def old_style_classes(df_module) -> dict:
    """tensorpack's old protocol, written as its users wrote it."""

    class OldRange(df_module.DataFlow):
        def __init__(self, n):
            self.n = n

        def get_data(self):
            for i in range(self.n):
                yield [i, i * i]

        def size(self):
            return self.n

    class OldDouble(df_module.ProxyDataFlow):
        def get_data(self):
            for dp in self.ds.get_data():
                yield [dp[0] * 2]

        def size(self):
            return self.ds.size()

    class OldOffset(OldRange):
        def get_data(self):
            for dp in super().get_data():
                yield [dp[0] + 100, dp[1]]

    class OldNoise(df_module.RNGDataFlow):
        def __init__(self, n):
            self.n = n

        def get_data(self):
            for _ in range(self.n):
                yield [int(self.rng.randint(1000)), float(self.rng.uniform())]

        def size(self):
            return self.n

    return {"OldRange": OldRange, "OldDouble": OldDouble, "OldOffset": OldOffset, "OldNoise": OldNoise}


def plain(value):
    """Datapoints as JSON: arrays as nested lists (values only: dtypes are compared elsewhere)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def old_style(df_module, expr: str) -> dict:
    env = names(df_module)
    env.update(old_style_classes(df_module))
    df = eval(expr, env)
    df.reset_state()
    for flow in [df, getattr(df, "ds", None), getattr(getattr(df, "ds", None), "ds", None)]:
        if flow is not None and isinstance(getattr(flow, "rng", None), np.random.RandomState):
            flow.rng = np.random.RandomState(SEED)
    epochs = [[plain(dp) for dp in df] for _ in range(2)]
    return {"len": len(df), "size": df.size(), "epochs": epochs, "get_data": [plain(dp) for dp in df.get_data()]}


def local_shuffle(df_module, case: tuple, endless_iterator: bool) -> dict:
    """``epochs * len()`` datapoints of the stream: from one iterator (tensorpack's is endless) or from
    that many iterations (bridgeflow's iterations are len() long)."""
    n, buffer_size, num_reuse, interval, epochs = case
    df = df_module.LocallyShuffleData(df_module.DataFromList([[i] for i in range(n)], shuffle=False), buffer_size,
                                      num_reuse, interval)
    df.reset_state()
    df.rng = np.random.RandomState(SEED)
    length = len(df)
    try:
        if endless_iterator:
            it = iter(df)
            stream = [int(next(it)[0]) for _ in range(epochs * length)]
            more = next(it, None) is not None
        else:
            stream = [int(dp[0]) for _ in range(epochs) for dp in df]
            more = len(list(df)) == length
    except ZeroDivisionError as exc:
        return {"len": length, "error": f"ZeroDivisionError: {exc}"}
    return {"len": length, "stream": stream, "goes_on": more}


def observe(df_module, endless_iterator: bool, isolate=None) -> dict:
    """Every observation over ``df_module``; ``isolate(fn, *args)`` runs a worker count apart if given."""
    run = isolate or (lambda fn, *args: fn(*args))
    return {
        "signatures": {name: signature(df_module, name) for name in SIGNATURES},
        "workers": {case: run(workers_started, df_module, expr) for case, expr in WORKERS.items()},
        "orders": {case: run(constructed, df_module, expr) for case, expr in WORKERS.items()},
        "nr_keywords": {case: run(constructed, df_module, expr) for case, expr in NR_KEYWORDS.items()},
        "old_style": {case: old_style(df_module, expr) for case, expr in OLD_STYLE.items()},
        "local_shuffle": {case: local_shuffle(df_module, args, endless_iterator)
                          for case, args in LOCAL_SHUFFLE.items()},
    }


# --- tensorpack's side ------------------------------------------------------------------------------


def in_child(fn, *args):
    """Run ``fn(*args)`` in a forked child, so each count starts from a process with no workers; the
    child kills the workers it started (tensorpack's runners have no close()) before it exits."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        global KEPT
        KEPT = []
        code = 0
        try:
            os.close(read)
            result = json.dumps(fn(*args)).encode()
        except BaseException as exc:
            result, code = json.dumps({"crash": repr(exc)}).encode(), 1
        for child in child_pids():
            os.kill(child, signal.SIGKILL)
        for child in child_pids():
            os.waitpid(child, 0)
        os.write(write, result)
        os.close(write)
        os._exit(code)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    out = json.loads(data)
    if "crash" in out:
        raise RuntimeError(f"{fn.__name__}{args[1:]}: {out['crash']}")
    return out


def main() -> None:
    out_dir = HERE
    if "--out" in sys.argv:
        out_dir = sys.argv[sys.argv.index("--out") + 1]
    import tensorpack
    import tensorpack.dataflow as tp

    result = observe(tp, endless_iterator=True, isolate=in_child)
    result["versions"] = {"tensorpack": tensorpack.__version__, "numpy": np.__version__,
                          "python": sys.version.split()[0]}
    path = os.path.join(out_dir, EXPECTED)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    sys.stderr.write(f"wrote {path}\n")


if __name__ == "__main__":
    main()
