"""Sharding: each of 2 or 3 ranks reads a disjoint part (padding aside), together the whole, all as many datapoints
and batches per epoch, and a new order per epoch that every rank agrees on; with real ranks (torch.distributed, gloo)
too."""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter

import numpy as np
import pytest

import bridgeflow as bf
from bridgeflow._shard import rank_and_world, resolve_shard, warn_if_unsharded
from conftest import need

N = 23


def ids(batches):
    return [int(v) for b in batches for v in b[0]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard")
    dps = [[i, np.full(4, i, np.int32)] for i in range(N)]
    out = {"lmdb": str(d / "s.lmdb"), "hdf5": str(d / "s.h5"), "npz": str(d / "s.npz")}
    bf.LMDBSerializer.save(bf.DataFromList(dps, shuffle=False), out["lmdb"], progress=False)
    bf.HDF5Serializer.save(bf.DataFromList(dps, shuffle=False), out["hdf5"], progress=False)
    bf.NumpySerializer.save(bf.DataFromList(dps, shuffle=False), out["npz"], progress=False)
    return out


def sources(files):
    dps = [[i, np.full(4, i, np.int32)] for i in range(N)]
    return {
        "ShardData": lambda shuffle, r, w, drop: bf.ShardData(bf.DataFromList(dps, shuffle=shuffle, seed=5), r, w,
                                                            drop_last=drop),
        "DataFromList": lambda shuffle, r, w, drop: bf.DataFromList(dps, shuffle=shuffle, seed=5, shard=(r, w),
                                                                    drop_last=drop),
        "LMDB": lambda shuffle, r, w, drop: bf.LMDBSerializer.load(files["lmdb"], shuffle=shuffle, seed=5,
                                                                   shard=(r, w), drop_last=drop),
        "HDF5": lambda shuffle, r, w, drop: bf.HDF5Serializer.load(files["hdf5"], shuffle=shuffle, seed=5,
                                                                   shard=(r, w), drop_last=drop),
        "npz": lambda shuffle, r, w, drop: bf.NumpySerializer.load(files["npz"], shuffle=shuffle, seed=5,
                                                                   shard=(r, w), drop_last=drop),
    }


@pytest.mark.parametrize("drop_last", [False, True], ids=["padded", "drop_last"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["ShardData", "DataFromList", "LMDB", "HDF5", "npz"])
def test_ranks_read_disjoint_complete_equal_parts(files, kind, world, shuffle, drop_last):
    make = sources(files)[kind]
    flows = [make(shuffle, r, world, drop_last) for r in range(world)]
    per_rank = N // world if drop_last else -(-N // world)
    full = world * per_rank
    seen_orders = []
    for epoch in range(3):
        for f in flows:
            f.set_epoch(epoch)
        parts = [[int(dp[0]) for dp in f] for f in flows]
        assert [len(p) for p in parts] == [per_rank] * world == [len(f) for f in flows]
        counts = Counter(i for p in parts for i in p)
        if drop_last:  # disjoint; only the remainder of the order is missing
            assert max(counts.values()) == 1 and len(counts) == full
        else:  # complete; the padding repeats as few as needed
            assert set(counts) == set(range(N)) and sum(counts.values()) == full
            assert sum(c - 1 for c in counts.values()) == full - N
        seen_orders.append(parts)
        batches = [list(bf.BatchData(make(shuffle, r, world, drop_last), 2)) for r in range(world)]
        assert len({len(b) for b in batches}) == 1  # every rank makes as many batches
    if shuffle:
        assert seen_orders[0] != seen_orders[1] != seen_orders[2]  # a new order every epoch
    else:
        assert seen_orders[0] == seen_orders[1]


@pytest.mark.parametrize("kind", ["ShardData", "LMDB", "HDF5"])
def test_set_epoch_gives_every_rank_the_same_order(files, kind):
    """Ranks built apart, each told the epoch: together they read epoch n's order, whatever came before."""
    make = sources(files)[kind]
    a = [make(True, r, 2, False) for r in range(2)]
    for f in a:  # these ranks read epochs 0, 1, 2 in turn
        for _ in range(3):
            list(f)
    b = [make(True, r, 2, False) for r in range(2)]
    for f in b:  # these jump to epoch 3
        f.set_epoch(3)
    assert [[int(dp[0]) for dp in f] for f in a] == [[int(dp[0]) for dp in f] for f in b]


def test_sharded_readers_resume(files):
    from bridgeflow.testing import check_resumable

    for w in (2, 3):
        for r in range(w):
            check_resumable(lambda r=r, w=w: bf.BatchData(bf.LMDBSerializer.load(files["lmdb"], seed=1, shard=(r, w)),
                                                          3, remainder=True), epochs=3)


def test_sharded_reader_indexes_its_own_part(files):
    ds = bf.LMDBSerializer.load(files["lmdb"], shuffle=False, shard=(1, 3))
    assert len(ds) == 8
    assert [int(ds[i][0]) for i in range(len(ds))] == list(range(8, 16))
    last = bf.DataFromList(list(range(N)), shuffle=False, shard=(2, 3))
    assert [last[i] for i in range(len(last))] == [16, 17, 18, 19, 20, 21, 22, 0]
    with pytest.raises(IndexError, match="out of range for this rank's 8 datapoints"):
        last[8]


def _ident(dp):
    return dp


def _epochs_and_resumed(make, k, epochs=3):
    """Three epochs read without interruption, and read again from a state taken after ``k`` datapoints
    (json round trip, a fresh flow)."""
    with make() as flow:
        flow.reset_state()
        whole = [[dp[0].tolist() for dp in flow] for _ in range(epochs)]
    with make() as flow:
        flow.reset_state()
        it = iter(flow)
        head = [next(it)[0].tolist() for _ in range(k)]
        state = json.loads(json.dumps(flow.state_dict()))
        it.close()
    with make() as flow:
        flow.load_state_dict(state)
        rest = [[dp[0].tolist() for dp in flow] for _ in range(epochs)]
    rest[0] = head + rest[0]
    return whole, rest


@pytest.mark.parametrize("stage", ["threads", "processes"])
@pytest.mark.parametrize("strict", [False, True])
def test_shard_over_batches_made_in_a_map_stage_resumes_exactly(stage, strict, leak_check):
    """ShardData reads its child's epoch to the end: left unfinished, a fused BatchData over a non-strict
    stage carried its read-ahead into the next epoch (a resumed flow lost batch [0, 1, 2] and read [3, 4, 5]
    every epoch after), and a strict one resumed at the rank's last batch raised DataFlowReentrantError."""
    cls = bf.MultiThreadMapData if stage == "threads" else bf.MultiProcessMapData

    def make(n=12, world=2, rank=1):
        mapped = cls(bf.DataFromList([[i] for i in range(n)], shuffle=False), 2, _ident, buffer_size=6,
                     strict=strict)
        return bf.ShardData(bf.BatchData(mapped, 3, remainder=True), rank, world)

    for args in ((12, 2, 1), (6, 3, 0)):
        for k in range(len(make(*args)) + 1):
            whole, resumed = _epochs_and_resumed(lambda args=args: make(*args), k)
            assert resumed == whole, (args, k)
    assert _epochs_and_resumed(lambda: make(6, 3, 0), 1)[0] == [[[0, 1, 2]]] * 3


def test_random_flows_without_a_seed_are_refused():
    with pytest.raises(ValueError, match=r"DataFromList draws random numbers without a seed.*same seed= on every"):
        bf.ShardData(bf.MapData(bf.DataFromList(list(range(9))), lambda x: [x]), 0, 2)
    with pytest.raises(ValueError, match="without a seed"):
        bf.DataFromList(list(range(9)), shard=(0, 2))
    bf.ShardData(bf.DataFromList(list(range(9)), shuffle=False), 0, 2)  # no randomness: fine
    bf.ShardData(bf.DataFromList(list(range(9))), 0, 1)  # one rank: fine


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs 0 <= rank < world, got rank=2, world=2"):
        bf.ShardData(bf.DataFromList([1], shuffle=False), 2, 2)
    with pytest.raises(ValueError, match="give both rank and world"):
        bf.ShardData(bf.DataFromList([1], shuffle=False), 1)
    with pytest.raises(ValueError, match="shard must be"):
        bf.DataFromList([1], shuffle=False, shard="everything")
    with pytest.raises(bf.LengthUnknownError, match="shard before the flow that loses the length"):
        list(bf.ShardData(bf.FilterData(bf.DataFromList([[1]], shuffle=False), bool), 0, 2))


def test_auto_reads_rank_and_world_from_the_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_shard("auto", False, "x") == (0, 1, False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert rank_and_world() == (2, 3)
    assert bf.DataFromList(list(range(N)), shuffle=False, shard="auto").__len__() == 8
    assert bf.ShardData(bf.DataFromList(list(range(N)), shuffle=False)).rank == 2
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' and WORLD_SIZE='3' must be integers"):
        rank_and_world()


def _unsharded_warnings(make, times=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            list(make())
    return [str(w.message) for w in caught if issubclass(w.category, bf.UnshardedWarning)]


def test_an_unsharded_flow_read_by_one_of_several_ranks_is_warned_about(files, monkeypatch):
    """Silently feeding every rank the whole dataset is the worst bug a loader can have: a DataFlow read by
    a DataLoader or CUDAPrefetcher on one of several ranks with nothing in it that shards is warned about,
    once per loader, naming the pipeline and the fix."""
    need("torch")
    from bridgeflow.adapters.torch import CUDAPrefetcher, DataLoader

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    flow = bf.MapData(bf.DataFromList([[i] for i in range(N)], shuffle=True, seed=3), lambda dp: dp)
    loader = DataLoader(flow, batch_size=4)
    (message,) = _unsharded_warnings(lambda: loader)  # two epochs, one warning
    assert "rank 1 of 2" in message and "MapData/DataFromList" in message and "shard='auto'" in message
    prefetcher = CUDAPrefetcher(bf.BatchData(bf.LMDBSerializer.load(files["lmdb"], shuffle=False), 4), "cpu")
    (message,) = _unsharded_warnings(lambda: prefetcher)
    assert "CUDAPrefetcher" in message and "BatchData/LMDBDataset" in message

    sharded = [
        lambda: bf.DataFromList([[i] for i in range(N)], shuffle=True, seed=3, shard="auto"),
        lambda: bf.MapData(bf.ShardData(bf.DataFromList([[i] for i in range(N)], shuffle=False)), lambda dp: dp),
        lambda: bf.LMDBSerializer.load(files["lmdb"], shuffle=False, shard=(1, 2)),
    ]
    for make in sharded:
        assert _unsharded_warnings(lambda make=make: DataLoader(make(), batch_size=4)) == []
    # fed from outside: producers decide what each rank gets
    queue = __import__("queue").Queue()
    for i in range(3):
        queue.put([i])
    queue.put(None)
    assert not warn_if_unsharded(bf.DataFromQueue(queue, end=None), "x")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert _unsharded_warnings(lambda: DataLoader(flow, batch_size=4)) == []  # one rank: nothing to shard


def _rank_main(rank, world, init_file, path, out_dir):
    import torch.distributed as dist

    from bridgeflow.adapters.torch import DataLoader

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        os.environ.pop("RANK", None)  # "auto" must come from torch.distributed here
        flow = bf.BatchData(bf.LMDBSerializer.load(path, shuffle=True, seed=11, shard="auto"), 3, remainder=True)
        import torch

        epochs = []
        for epoch in range(2):
            flow.set_epoch(epoch)
            got = ids(flow)
            n = torch.tensor([len(got)])
            dist.all_reduce(n, op=dist.ReduceOp.MAX)  # a rank with fewer batches would make DDP hang
            epochs.append(got)
        warned = []
        for shard in ("auto", None):  # a DataLoader over each: only the unsharded one is warned about
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                list(DataLoader(bf.LMDBSerializer.load(path, shuffle=False, shard=shard), batch_size=4))
            warned.append([str(w.message) for w in caught if issubclass(w.category, bf.UnshardedWarning)])
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"epochs": epochs, "warned": warned}, f)
        dist.barrier()  # no rank tears the group down while another still talks to it (gloo aborts)
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo sometimes aborts (SIGABRT) in the interpreter's teardown after a clean destroy, with or
    # without bridgeflow (examples/ddp_lmdb.py says more): the results are written, so end the rank here
    os._exit(0)


def test_real_ranks_with_torch_distributed(files, tmp_path):
    tmp = need("torch.multiprocessing")

    world = 3
    tmp.spawn(_rank_main, args=(world, str(tmp_path / "init"), files["lmdb"], str(tmp_path)), nprocs=world,
              join=True)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    per_rank = [r["epochs"] for r in results]
    for rank, result in enumerate(results):
        sharded, unsharded = result["warned"]
        assert sharded == [] and len(unsharded) == 1, result["warned"]
        assert f"rank {rank} of {world}" in unsharded[0] and "LMDBDataset" in unsharded[0]
    for epoch in range(2):
        parts = [per_rank[r][epoch] for r in range(world)]
        assert [len(p) for p in parts] == [8] * world
        assert set().union(*parts) == set(range(N))
    assert per_rank[0][0] != per_rank[0][1]
