"""Write what tensorpack 0.11 itself makes of fixed inputs: LMDB files and the outputs of DataFlow wrappers.

Run with a Python that has tensorpack 0.11 (numpy < 2, msgpack, msgpack-numpy, lmdb; TensorFlow is not
needed)::

    python -m venv /tmp/tpvenv && /tmp/tpvenv/bin/pip install tensorpack==0.11 "numpy<2" msgpack \\
        msgpack-numpy lmdb
    /tmp/tpvenv/bin/python tests/data/make_tensorpack_fixtures.py            # rewrites tests/data/
    /tmp/tpvenv/bin/python tests/data/make_tensorpack_fixtures.py --out DIR  # anywhere else

It writes, into ``tests/data`` (or ``--out``):

- ``tensorpack_msgpack.lmdb`` (one file) and ``tensorpack_pickle.lmdb`` (a directory, ``data.mdb``
  inside): ``DATAPOINTS`` saved by tensorpack's ``LMDBSerializer.save`` with ``TENSORPACK_SERIALIZE``
  set to ``msgpack`` and ``pickle``;
- ``tensorpack_msgpack_extra.lmdb``: datapoints msgpack-numpy can only store as a pickle (an object
  array) or as a structured dtype;
- ``tensorpack_expected.json``: for each file, what tensorpack's ``LMDBSerializer.load`` and
  ``LMDBData`` (shuffle=False) yield; for each case of ``FLOWS``, what the flow yields in each of
  ``epochs`` iterations, and its ``len()``; the public names of ``tensorpack.dataflow``, its ``imgaug``
  and its ``dataset`` (the porting table, docs/tensorpack.md, must cover them).

tests/test_tensorpack_diff.py evaluates the same ``FLOWS`` expressions with
``from bridgeflow.dataflow import *`` (the import is all that changes), reads the same LMDB files, and
compares value for value; with ``BRIDGEFLOW_TENSORPACK_PYTHON`` set it runs this script there first
and compares against a fresh run instead of the committed files. This module imports only numpy at
top level, so the test can import ``DATAPOINTS``, ``FLOWS`` and the JSON codec.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import queue
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LMDB_FILES = {  # name -> (TENSORPACK_SERIALIZE, as a directory, which datapoints)
    "tensorpack_msgpack.lmdb": ("msgpack", False, "DATAPOINTS"),
    "tensorpack_pickle.lmdb": ("pickle", True, "DATAPOINTS"),
    "tensorpack_msgpack_extra.lmdb": ("msgpack", False, "EXTRA"),
}
EXPECTED = "tensorpack_expected.json"


def _jpeg_like(i: int) -> np.ndarray:
    """Encoded-image bytes as tensorpack's ILSVRC12 LMDB example stores them: a 1-D uint8 array."""
    return np.frombuffer(b"\xff\xd8\xff\xe0" + bytes(range(i, i + 40)) + b"\xff\xd9", np.uint8)


def datapoints() -> list:
    """What the LMDB files hold: every kind of component tensorpack pipelines store."""
    out = []
    for i in range(12):
        out.append([
            np.arange(12, dtype=np.uint8).reshape(2, 2, 3) + i,      # an image
            _jpeg_like(i),                                           # encoded image bytes
            i,                                                       # a label
            i / 4,                                                   # a float
            f"name{i}",                                              # a str
            b"raw\x00" + bytes([i]),                                 # bytes
            i % 2 == 0,                                              # a bool
            None if i % 3 else {"box": np.arange(4, dtype=np.float32) * i, "id": i},  # None or a dict
            (i, [i + 1, "x"]),                                       # a tuple holding a list
            np.float32(i) / 3, np.int64(-i),                         # numpy scalars
            np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3) * i),  # Fortran order
            np.zeros((0, 3), np.float64), np.array(i, np.int32),     # empty and 0-d arrays
            np.array([True, False]), np.array(["ab", "c"]),          # bool and unicode arrays
            np.array([1 + 2j, i], np.complex64),                     # a complex array
        ])
    return out


def extra_datapoints() -> list:
    """Datapoints msgpack-numpy stores as a pickle (an object array), as a structured dtype or as its map for
    a Python complex: bridgeflow's codec stores none of these, so they cannot be converted."""
    rec = np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i4"), ("b", "<f8")])
    return [[rec, 0], [np.array([1, "a", None], dtype=object), 1], [complex(2, -1), 2]]


DATAPOINTS = datapoints()
EXTRA = extra_datapoints()


# --- DataFlow wrappers -----------------------------------------------------------------------------

def dps(n: int) -> list:
    """Plain datapoints: an array, an int, a float, a bool and a str."""
    return [[np.arange(3, dtype=np.float32) + i, i, i / 2, i % 2 == 1, f"s{i}"] for i in range(n)]


def shaped(n: int) -> list:
    """Datapoints whose first component has one of three shapes."""
    return [[np.full((1 + i % 3, 2), i, np.uint8), i] for i in range(n)]


def labels(n: int) -> list:
    return [[f"label{i}", i * 10] for i in range(n)]


def dicts(n: int) -> list:
    return [{"x": np.arange(2, dtype=np.int64) * i, "y": float(i)} for i in range(n)]


def filled_queue(n: int) -> queue.Queue:
    """A queue holding ``dps(n)``."""
    q: queue.Queue = queue.Queue()
    for dp in dps(n):
        q.put(dp)
    return q


# name -> (expression over the names of the dataflow package and the helpers above, epochs)
FLOWS = {
    "data_from_list": ("DataFromList(dps(7), shuffle=False)", 2),
    "data_from_generator": ("DataFromGenerator(lambda: iter(dps(3)))", 2),
    "batch_remainder": ("BatchData(DataFromList(dps(10), shuffle=False), 4, remainder=True)", 1),
    "batch_drop_remainder": ("BatchData(DataFromList(dps(10), shuffle=False), 4)", 1),
    "batch_use_list": ("BatchData(DataFromList(dps(5), shuffle=False), 2, remainder=True, use_list=True)", 1),
    "batch_dicts": ("BatchData(DataFromList(dicts(5), shuffle=False), 2, remainder=True)", 1),
    "batch_by_shape": ("BatchDataByShape(DataFromList(shaped(14), shuffle=False), 2, idx=0)", 1),
    "map_drops_none": ("MapData(DataFromList(dps(9), shuffle=False), "
                       "lambda dp: None if dp[1] % 3 == 0 else [dp[1] * 2, dp[0]])", 1),
    "map_component": ("MapDataComponent(DataFromList(dps(5), shuffle=False), lambda x: x * 10, index=1)", 1),
    "map_component_drops_none": ("MapDataComponent(DataFromList(dps(5), shuffle=False), "
                                 "lambda x: None if x == 2 else x, index=1)", 1),
    "map_component_dict": ("MapDataComponent(DataFromList(dicts(3), shuffle=False), lambda y: y + 1, "
                           "index='y')", 1),
    "repeated": ("RepeatedData(DataFromList(dps(3), shuffle=False), 3)", 1),
    "repeated_forever": ("FixedSizeData(RepeatedData(DataFromList(dps(3), shuffle=False), -1), 8)", 1),
    "repeated_datapoint": ("RepeatedDataPoint(DataFromList(dps(3), shuffle=False), 2)", 1),
    "concat": ("ConcatData([DataFromList(dps(3), shuffle=False), DataFromList(dps(2), shuffle=False)])", 1),
    "join": ("JoinData([DataFromList(dps(4), shuffle=False), DataFromList(labels(4), shuffle=False)])", 1),
    "join_dicts": ("JoinData([DataFromList(dicts(3), shuffle=False), "
                   "DataFromList([{'z': i} for i in range(3)], shuffle=False)])", 1),
    "select_component": ("SelectComponent(DataFromList(dps(4), shuffle=False), [4, 0])", 1),
    "fixed_size_keeps_state": ("FixedSizeData(DataFromList(dps(5), shuffle=False), 3)", 3),
    "fixed_size_restarts": ("FixedSizeData(DataFromList(dps(5), shuffle=False), 3, keep_state=False)", 2),
    "fixed_size_longer": ("FixedSizeData(DataFromList(dps(4), shuffle=False), 6, keep_state=False)", 1),
    "cache": ("CacheData(DataFromList(dps(3), shuffle=False))", 2),
    "data_from_queue": ("FixedSizeData(DataFromQueue(filled_queue(6)), 4)", 1),
    "multi_thread_prefetch_one_thread": ("MultiThreadPrefetchData(lambda: DataFromList(dps(5), shuffle=False), 4, 1)",
                                         2),
}


def flow_namespace(package: object) -> dict:
    """The names an expression of ``FLOWS`` may use: the package's public names and the helpers here."""
    ns = {name: getattr(package, name) for name in package.__all__ if hasattr(package, name)}
    ns.update(np=np, dps=dps, shaped=shaped, labels=labels, dicts=dicts, filled_queue=filled_queue)
    return ns


def run_flow(expr: str, epochs: int, ns: dict) -> dict:
    """``{"epochs": [datapoints of each iteration], "len": len() or None}`` of the flow ``expr``."""
    df = eval(expr, dict(ns))
    try:
        length = len(df)
    except (TypeError, NotImplementedError):  # no length (bridgeflow: LengthUnknownError, a TypeError)
        length = None
    df.reset_state()
    out = {"epochs": [list(df) for _ in range(epochs)], "len": length}
    close = getattr(df, "close", None)
    if close is not None:
        close()
    return out


# --- a JSON form that keeps types: list vs tuple, bytes, arrays with dtype, numpy scalars ----------

def to_json(x: object) -> object:
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            return {"__t": "nd_object", "shape": list(x.shape), "v": [to_json(v) for v in x.ravel().tolist()]}
        return {"__t": "nd", "dtype": x.dtype.descr if x.dtype.fields else x.dtype.str, "shape": list(x.shape),
                "v": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode("ascii")}
    if isinstance(x, np.generic):
        return {"__t": "np", "dtype": x.dtype.str, "v": base64.b64encode(x.tobytes()).decode("ascii")}
    if x is None or isinstance(x, (bool, int, str)) or (isinstance(x, float) and np.isfinite(x)):
        return x
    if isinstance(x, complex):
        return {"__t": "complex", "v": [x.real, x.imag]}
    if isinstance(x, bytes):
        return {"__t": "bytes", "v": base64.b64encode(x).decode("ascii")}
    if isinstance(x, list):
        return [to_json(v) for v in x]
    if isinstance(x, tuple):
        return {"__t": "tuple", "v": [to_json(v) for v in x]}
    if isinstance(x, dict):
        return {"__t": "dict", "v": [[to_json(k), to_json(v)] for k, v in x.items()]}
    raise TypeError(f"cannot record a {type(x).__name__}: {x!r}")


def _descr(d: object) -> object:
    return [tuple(_descr(f) if isinstance(f, list) else f for f in field) for field in d] if isinstance(d, list) else d


def from_json(x: object) -> object:
    if isinstance(x, list):
        return [from_json(v) for v in x]
    if not isinstance(x, dict):
        return x
    t, v = x["__t"], x.get("v")
    if t == "nd":
        dt = np.dtype(_descr(x["dtype"]))
        return np.frombuffer(base64.b64decode(v), dt).reshape(x["shape"]).copy()
    if t == "nd_object":
        arr = np.empty(len(v), dtype=object)
        arr[:] = [from_json(e) for e in v]
        return arr.reshape(x["shape"])
    if t == "np":
        return np.frombuffer(base64.b64decode(v), np.dtype(x["dtype"]))[0]
    if t == "complex":
        return complex(*v)
    if t == "bytes":
        return base64.b64decode(v)
    if t == "tuple":
        return tuple(from_json(e) for e in v)
    if t == "dict":
        return {_hashable(from_json(k)): from_json(e) for k, e in v}
    raise ValueError(f"unknown tag {t!r}")


def _hashable(k: object) -> object:
    return tuple(k) if isinstance(k, list) else k


# --- writing (needs tensorpack) ---------------------------------------------------------------------

def _write_lmdb(name: str, out: str) -> None:
    """In a process whose TENSORPACK_SERIALIZE is already set: save, then record what tensorpack reads."""
    from tensorpack.dataflow import DataFromList, LMDBData, LMDBSerializer

    serializer, as_dir, which = LMDB_FILES[name]
    assert os.environ.get("TENSORPACK_SERIALIZE") == serializer
    path = os.path.join(out, name)
    if as_dir:
        os.makedirs(path)
    LMDBSerializer.save(DataFromList(globals()[which], shuffle=False), path)
    for lock in (path + "-lock", os.path.join(path, "lock.mdb")):  # readers never need LMDB's lock file
        if os.path.exists(lock):
            os.remove(lock)
    loaded = LMDBSerializer.load(path, shuffle=False)
    loaded.reset_state()
    record = {"load": to_json(list(loaded)), "len": len(loaded)}
    del loaded  # LMDB allows one environment per file per process: this closes tensorpack's
    gc.collect()
    raw = LMDBData(path, shuffle=False)
    raw.reset_state()
    record["raw"] = to_json(list(raw))
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(record, f)


def _flows() -> dict:
    import tensorpack.dataflow as tp

    ns = flow_namespace(tp)
    return {name: to_json(run_flow(expr, epochs, ns)) for name, (expr, epochs) in FLOWS.items()}


def _names() -> dict:
    """The public names of tensorpack.dataflow, its imgaug and its dataset (classes; it has no __all__)."""
    import tensorpack.dataflow as tp
    from tensorpack.dataflow import dataset, imgaug

    datasets = [n for n in dir(dataset) if not n.startswith("_") and isinstance(getattr(dataset, n), type)]
    return {"dataflow": sorted(tp.__all__), "imgaug": sorted(imgaug.__all__),
            "dataset": sorted(n for n in datasets if n != "RNGDataFlow")}


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    expected: dict = {"tensorpack": None, "lmdb": {}, "flows": None}
    for name, (serializer, _as_dir, _which) in LMDB_FILES.items():
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        env = dict(os.environ, TENSORPACK_SERIALIZE=serializer, TF_CPP_MIN_LOG_LEVEL="3")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--lmdb", name, "--out", out], env=env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(out, name + ".json")) as f:
            expected["lmdb"][name] = json.load(f)
        os.remove(os.path.join(out, name + ".json"))
    import tensorpack

    expected["tensorpack"] = tensorpack.__version__
    expected["flows"] = _flows()
    expected["names"] = _names()
    with open(os.path.join(out, EXPECTED), "w") as f:
        json.dump(expected, f, indent=0, sort_keys=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--lmdb", help=argparse.SUPPRESS)  # internal: one file, in a child process
    args = parser.parse_args()
    if args.lmdb:
        _write_lmdb(args.lmdb, args.out)
    else:
        main(args.out)
