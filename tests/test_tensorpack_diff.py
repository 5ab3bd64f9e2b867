"""Differential tests against tensorpack 0.11 itself: its LMDB files and its DataFlow wrappers.

tensorpack's answers come from tests/data/make_tensorpack_fixtures.py, run now with the tensorpack
Python named by BRIDGEFLOW_TENSORPACK_PYTHON (CI) or, without one, from the files it committed
(see tests/tensorpack_reference.py). The flows are the same expressions evaluated over
``bridgeflow.dataflow``'s names: only the import differs. Where bridgeflow differs on purpose or not yet
(``KNOWN_DIFFERENCES``) the test asserts exactly those differences, so a change on either side shows.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess

import numpy as np
import pytest
from tensorpack_reference import DATA, SCRIPT, load_script, run_tensorpack, tensorpack_python

import bridgeflow.dataflow as bfd
from bridgeflow import LMDBData, LMDBDataDecoder, LMDBDataPoint, LMDBSerializer, MultiProcessMapData
from bridgeflow.serialize import decode_tensorpack
from conftest import source_tree

script = load_script()
FILES = list(script.LMDB_FILES)


class Reference:
    def __init__(self, folder: str, live: bool) -> None:
        self.dir, self.live = folder, live
        with open(os.path.join(folder, script.EXPECTED)) as f:
            self.expected = json.load(f)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def lmdb(self, name: str, what: str):
        return script.from_json(self.expected["lmdb"][name][what])


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    if tensorpack_python() is None:  # a developer's machine: the committed fixtures
        return Reference(DATA, live=False)
    out = tmp_path_factory.mktemp("tensorpack")
    run_tensorpack([SCRIPT, "--out", str(out)])
    return Reference(str(out), live=True)


def differences(tp, bf, path="dp") -> set[str]:
    """Every way ``bf`` differs from ``tp``: types (list vs tuple too), dtypes, shapes, values."""
    if type(tp) is not type(bf):
        return {f"{path}: {type(tp).__name__} vs {type(bf).__name__}"}
    if isinstance(tp, np.ndarray):
        if tp.dtype != bf.dtype:
            return {f"{path}: dtype {tp.dtype} vs {bf.dtype}"}
        if tp.shape != bf.shape:
            return {f"{path}: shape {tp.shape} vs {bf.shape}"}
        return set() if tp.tobytes() == bf.tobytes() else {f"{path}: values"}
    if isinstance(tp, np.generic):
        return set() if tp.dtype == bf.dtype and tp.tobytes() == bf.tobytes() else {f"{path}: {tp!r} vs {bf!r}"}
    if isinstance(tp, (list, tuple)):
        if len(tp) != len(bf):
            return {f"{path}: {len(tp)} items vs {len(bf)}"}
        return set().union(*(differences(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(tp, bf))))
    if isinstance(tp, dict):
        if list(tp) != list(bf):
            return {f"{path}: keys {list(tp)} vs {list(bf)}"}
        return set().union(*(differences(tp[k], bf[k], f"{path}[{k!r}]") for k in tp))
    return set() if tp == bf else {f"{path}: {tp!r} vs {bf!r}"}


def flow_differences(tp: dict, bf: dict) -> set[str]:
    out = set() if tp["len"] == bf["len"] else {f"len(): {tp['len']} vs {bf['len']}"}
    if len(tp["epochs"]) != len(bf["epochs"]):
        return out | {"epochs"}
    for a, b in zip(tp["epochs"], bf["epochs"]):
        if len(a) != len(b):
            out.add(f"{len(a)} datapoints vs {len(b)}")
            continue
        for dp_a, dp_b in zip(a, b):
            out |= differences(dp_a, dp_b)
    return out


# tensorpack vs bridgeflow, as "tensorpack vs bridgeflow" (the porting table, docs/tensorpack.md, lists them).
# BatchData (bridgeflow/_batch.py): Python ints become int64 (tensorpack: int32), floats float64 (float32),
# bools bool (tensorpack: int32, as its int check comes first) and strings stay a list (tensorpack: a
# numpy unicode array). BatchDataByShape: len() unknown (tensorpack: len(ds) // batch_size, which
# ignores how the shapes group).
_BATCH = {"dp[1]: dtype int32 vs int64", "dp[2]: dtype float32 vs float64", "dp[3]: dtype int32 vs bool",
          "dp[4]: ndarray vs list"}
KNOWN_DIFFERENCES = {
    "batch_remainder": _BATCH,
    "batch_drop_remainder": _BATCH,
    "batch_dicts": {"dp['y']: dtype float32 vs float64"},
    "batch_by_shape": {"dp[1]: dtype int32 vs int64", "len(): 7 vs None"},
}


@pytest.mark.parametrize("name", list(script.FLOWS))
def test_flow_matches_tensorpack(ref, name):
    expr, epochs = script.FLOWS[name]
    tp = script.from_json(ref.expected["flows"][name])
    bf = script.run_flow(expr, epochs, script.flow_namespace(bfd))  # the same expression, bridgeflow's names
    assert flow_differences(tp, bf) == KNOWN_DIFFERENCES.get(name, set())
    assert sum(map(len, tp["epochs"])) > 0


def test_reference_is_tensorpack_011(ref):
    assert ref.expected["tensorpack"] == "0.11"
    assert set(ref.expected["flows"]) == set(script.FLOWS) and set(ref.expected["lmdb"]) == set(FILES)
    if ref.live:  # the committed fixtures are what the script makes now
        with open(os.path.join(DATA, script.EXPECTED)) as f:
            assert json.load(f) == ref.expected


# --- tensorpack's LMDB files ------------------------------------------------------------------------

@pytest.mark.parametrize("name", FILES)
def test_load_reads_tensorpack_files_like_tensorpack(ref, name):
    expected = ref.lmdb(name, "load")
    with LMDBSerializer.load(ref.path(name), shuffle=False, allow_pickle=True) as ds:
        assert ds.format == "tensorpack" and len(ds) == len(expected) == ref.expected["lmdb"][name]["len"]
        assert ds.meta["codec"] == script.LMDB_FILES[name][0]
        ds.reset_state()
        assert differences(expected, list(ds)) == set()
        assert differences(expected[::-1], [ds[i] for i in range(-1, -len(ds) - 1, -1)]) == set()
    assert expected  # not an empty comparison


def test_msgpack_file_loads_without_pickle_and_arrays_are_writable(ref):
    name = "tensorpack_msgpack.lmdb"
    with LMDBSerializer.load(ref.path(name), shuffle=True, seed=3) as ds:
        ds.reset_state()
        first, second = list(ds), list(ds)
    expected = ref.lmdb(name, "load")
    for epoch in (first, second):
        assert differences(expected, sorted(epoch, key=lambda dp: dp[2])) == set()  # dp[2] is the index
    assert [dp[2] for dp in first] != [dp[2] for dp in second] != list(range(len(expected)))
    assert first[0][0].flags.writeable and first[0][1].dtype == np.uint8  # cv2.imdecode takes it as it is


@pytest.mark.parametrize("name", FILES)
def test_raw_pairs_match_tensorpack_lmdbdata(ref, name):
    raw = ref.lmdb(name, "raw")
    with LMDBData(ref.path(name), shuffle=False) as ds:
        ds.reset_state()
        assert len(ds) == len(raw) and differences(raw, list(ds)) == set()
        assert differences(raw[3 % len(raw)], ds[3 % len(raw)]) == set()
    with LMDBData(ref.path(name), shuffle=True, seed=1) as ds:  # the keys of tensorpack's layout
        ds.reset_state()
        shuffled = list(ds)
        assert differences(raw, sorted(shuffled)) == set() and len(ds) == len(raw)
    assert [k for k, _ in raw] == [b"%08d" % i for i in range(len(raw))]


@pytest.mark.parametrize("name", FILES)
def test_decoded_raw_values_match_tensorpack(ref, name):
    expected = ref.lmdb(name, "load")
    values = [v for _, v in ref.lmdb(name, "raw")]
    assert differences(expected, [decode_tensorpack(v, allow_pickle=True) for v in values]) == set()
    decoder = LMDBDataDecoder(LMDBData(ref.path(name), shuffle=False),
                              lambda k, v: decode_tensorpack(v, allow_pickle=True))
    with decoder:
        decoder.reset_state()
        assert differences(expected, list(decoder)) == set()
    with pytest.warns(DeprecationWarning, match="LMDBSerializer.load"):
        point = LMDBDataPoint(LMDBData(ref.path(name), shuffle=False), allow_pickle=True)
    with point:
        point.reset_state()
        assert differences(expected, list(point)) == set()


def test_decoding_in_worker_processes_matches_tensorpack(ref):
    """tensorpack's advice for slow decoding: LMDBData as the reader, the decoding as a parallel map."""
    name = "tensorpack_msgpack.lmdb"
    with MultiProcessMapData(LMDBData(ref.path(name), shuffle=False), 2, _decode_pair, strict=True) as df:
        df.reset_state()
        got = list(df)
    assert differences(ref.lmdb(name, "load"), got) == set()


def _decode_pair(kv):
    return decode_tensorpack(kv[1])


def test_serialize_converts_tensorpack_files(ref, tmp_path):
    from bridgeflow.cli import main

    for name in ("tensorpack_msgpack.lmdb", "tensorpack_pickle.lmdb"):
        out = tmp_path / (name + ".bf.lmdb")
        argv = ["serialize", ref.path(name), str(out), "--quiet"]
        assert main(argv + (["--allow-pickle"] if "pickle" in name else [])) == 0
        with LMDBSerializer.load(out, shuffle=False) as ds:  # bridgeflow's own file now: no pickle needed
            assert ds.format == "bridgeflow" and ds.meta["checksum"] == "crc32"
            ds.reset_state()
            assert differences(ref.lmdb(name, "load"), list(ds)) == set()


# --- ZeroMQ: tensorpack's producer against bridgeflow's consumer -------------------------------------

def test_tensorpack_producer_is_refused_clearly(tmp_path):
    """tensorpack's send_dataflow_zmq pushes pickles, untagged: a bridgeflow consumer bound in its place
    drops them (one stray message must not end its stream), unpickles nothing, and its error says why
    nothing arrived."""
    import zmq

    from bridgeflow import RemoteDataZMQ
    from bridgeflow.remote import ProducerLostError

    addr = f"ipc://{tmp_path}/tp.sock"
    sender = ("import sys\nfrom tensorpack.dataflow import DataFromList, send_dataflow_zmq\n"
              "print('ready', flush=True)\n"
              "send_dataflow_zmq(DataFromList([[1, 'a']] * 3, shuffle=False), sys.argv[1])\n")
    exe = tensorpack_python()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    proc = None
    try:
        if exe is not None:  # started and imported before the consumer's timeout runs: it connects, then sends
            proc = subprocess.Popen([exe, "-c", sender, addr], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True)
            for line in proc.stdout:  # tensorpack prints its own notes first; at EOF the sender failed
                if line == "ready\n":
                    break
            else:
                pytest.fail(f"the tensorpack sender exited ({proc.wait()}) before it was ready")
        with RemoteDataZMQ(addr, bind=True, timeout=5) as df:
            df.reset_state()
            if exe is None:  # no tensorpack here: the bytes tensorpack's default serializer sends
                push.connect(addr)
                push.send(pickle.dumps([1, "a"], protocol=-1))
            with pytest.raises(ProducerLostError, match=r"message\(s\) not from bridgeflow's "
                                                        r"send_dataflow_zmq.*dropped \(tensorpack's producer"):
                next(iter(df))
            assert df.stats()["RemoteDataZMQ"]["messages_dropped"] >= 1
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        push.close()
        ctx.term()


def test_committed_fixture_files_are_clean():
    """No LMDB lock files or stray files in tests/data (readers never need them)."""
    names = set(os.listdir(DATA))
    assert {"tensorpack_msgpack.lmdb", "tensorpack_pickle.lmdb", "tensorpack_msgpack_extra.lmdb"} <= names
    assert not [n for n in names if n.endswith("-lock")]
    assert os.listdir(os.path.join(DATA, "tensorpack_pickle.lmdb")) == ["data.mdb"]


# --- the porting table ----------------------------------------------------------------------------------

def _porting_section() -> str:
    with open(os.path.join(source_tree(), "docs", "tensorpack.md")) as f:
        return f.read()


@pytest.mark.parametrize("package", ["dataflow", "imgaug", "dataset"])
def test_every_tensorpack_name_is_provided_or_in_the_porting_table(ref, package):
    from bridgeflow import dataflow

    names = ref.expected["names"][package]
    module = dataflow if package == "dataflow" else getattr(dataflow, package)
    table = _porting_section()
    missing = [n for n in names if not hasattr(module, n)]
    undocumented = [n for n in missing if f"`{n}`" not in table]
    assert not undocumented, f"tensorpack.{package} names neither provided nor in the porting table: {undocumented}"
    if package == "dataflow":
        assert sorted(missing) == ["CaffeLMDB", "SVMLightData", "TFRecordSerializer"]  # "all but three"
        unlisted = [n for n in names if f"`{n}`" not in table and n not in ("dataset", "imgaug")]
        assert not unlisted, f"rows missing from the porting table: {unlisted}"
