"""State of the parallel stages: ordered map stages resume exactly (strict and carried, fused batching), unordered
ones give every datapoint not received exactly once, runners restart each worker's copy where it was, and a
process killed with SIGKILL after saving its state is continued by a new one as if nothing happened."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import bridgeflow as bf
from bridgeflow import RNGDataFlow, worker_seed_scope
from bridgeflow._state import NotResumableError, StateMismatchError, checksum
from bridgeflow.parallel import MultiProcessMapData, MultiProcessRunner, MultiThreadMapData, MultiThreadRunner
from bridgeflow.testing import check_resumable

STAGES = {"threads": MultiThreadMapData, "processes": MultiProcessMapData}


def _saved_after(make, k, epochs=0):
    """The first ``k`` datapoints of epoch ``epochs`` (after reading that many whole) of a new ``make()``
    pipeline, and its state then, through JSON as a checkpoint keeps it."""
    with make() as f:
        for _ in range(epochs):
            list(f)
        it = iter(f)
        before = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(f.state_dict()))
        it.close()
    return before, state


def src(n=40, seed=3):
    return bf.DataFromList([[i] for i in range(n)], shuffle=True, seed=seed)


def times_ten(dp):
    return [dp[0] * 10, np.full(3, dp[0], np.int32)]


def drop_some(dp):
    return None if dp[0] % 7 == 3 else [dp[0] * 10, np.full(3, dp[0], np.int32)]


def jittery(dp):
    time.sleep(random.random() * 0.002)  # results come back out of order
    return None if dp[0] % 11 == 5 else [dp[0]]


def jittery_keep(dp):
    time.sleep(random.random() * 0.002)
    return [dp[0]]


@pytest.mark.parametrize("fn", [times_ten, drop_some])
@pytest.mark.parametrize("fused", [False, True], ids=["unbatched", "fused-batches"])
@pytest.mark.parametrize("strict", [False, True], ids=["carried", "strict"])
@pytest.mark.parametrize("kind", sorted(STAGES))
def test_ordered_map_stage_resumes_exactly(kind, strict, fused, fn, leak_check):
    def make():
        stage = STAGES[kind](src(), 2, fn, buffer_size=8, strict=strict)
        return bf.BatchData(stage, 4, remainder=strict) if fused else stage

    check_resumable(make, epochs=3)


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_fused_batches_resume_after_every_batch(kind, leak_check):
    """Groups with dropped datapoints go through the holder, split across batches: every split resumes."""
    make = lambda: bf.BatchData(STAGES[kind](src(45), 2, drop_some, buffer_size=6), 4, remainder=True)
    n = len(check_resumable(make, positions=[0]))
    check_resumable(make, positions=range(n + 1))


def test_process_stage_under_spawn_resumes(leak_check):
    check_resumable(lambda: bf.BatchData(MultiProcessMapData(src(30), 2, times_ten, buffer_size=8,
                                                             start_method="spawn"), 4), positions=[3])


def test_map_stage_over_a_resumable_pipeline(leak_check):
    def make():
        inner = bf.LocallyShuffleData(bf.RepeatedData(src(9), 2), 4, seed=1)
        return bf.BatchData(MultiProcessMapData(inner, 2, drop_some, buffer_size=8), 3, remainder=True)

    check_resumable(make, epochs=3)


def _flat(batches, fused):
    return [int(v) for b in batches for v in b[0]] if fused else [int(dp[0]) for dp in batches]


@pytest.mark.parametrize("num", [1, 2])
@pytest.mark.parametrize("kind", sorted(STAGES))
def test_repeated_datapoints_over_an_unordered_stage_resume_between_datapoints(kind, num, leak_check):
    """RepeatedDataPoint saved its child's state from before the current datapoint even once that datapoint's
    repeats were all done: a resume read the child's next datapoint again to skip it, and an unordered stage's
    next is another one (the resume fuzz: one datapoint repeated, one lost). States taken between datapoints
    now hold the child's state after the current one."""
    def make():
        stage = STAGES[kind](bf.DataFromList([[i] for i in range(12)], shuffle=True, seed=354), 2, jittery_keep,
                             buffer_size=6, ordered=False, strict=True)
        return bf.RepeatedDataPoint(stage, num)

    for k in range(0, 12 * num + 1, num):  # between datapoints: after every num-th
        with make() as f:
            list(f)  # in the second epoch, as the fuzz found it
            it = iter(f)
            before = [int(next(it)[0]) for _ in range(k)]
            state = json.loads(json.dumps(f.state_dict()))
            it.close()
        with make() as g:
            g.load_state_dict(state)
            rest = [int(dp[0]) for dp in g]
        counts = {i: (before + rest).count(i) for i in set(before + rest)}
        assert counts == {i: num for i in range(12)}, f"after {k}: {sorted(before)} then {sorted(rest)}"


@pytest.mark.parametrize("fused", [False, True], ids=["unbatched", "fused-batches"])
@pytest.mark.parametrize("strict", [False, True], ids=["carried", "strict"])
@pytest.mark.parametrize("kind", sorted(STAGES))
def test_unordered_map_stage_gives_every_datapoint_not_received_exactly_once(kind, strict, fused, leak_check):
    """Unique ids across epochs (FixedSizeData over a long list): what came before the state and what comes
    after never overlap, nothing comes twice, and nothing of the first two epochs is lost."""
    drops = (lambda i: False) if fused else (lambda i: i % 11 == 5)
    fn = jittery_keep if fused else jittery

    def make():
        source = bf.FixedSizeData(bf.DataFromList([[i] for i in range(2_000)], shuffle=False), 40)
        stage = STAGES[kind](source, 2, fn, buffer_size=8, ordered=False, strict=strict)
        return bf.BatchData(stage, 2) if fused else stage

    for k in (0, 3, 9, 18):
        before, state = _saved_after(make, k)
        with make() as g:
            g.load_state_dict(state)
            rest, following = list(g), list(g)
            more = []
            if not strict:  # late results (a worker descheduled on a busy machine) come in a later epoch
                for _ in range(8):
                    if {i for i in range(80) if not drops(i)} <= set(_flat(before + rest + following + more, fused)):
                        break
                    more += list(g)
        got, after = _flat(before, fused), _flat(rest, fused) + _flat(following, fused) + _flat(more, fused)
        assert not set(got) & set(after), f"after {k}: datapoints received twice"
        assert len(after) == len(set(after)), f"after {k}: a datapoint came twice after the resume"
        if strict:  # each epoch is one epoch of the source, whatever the order
            assert sorted(got + _flat(rest, fused)) == [i for i in range(40) if not drops(i)]
            assert sorted(_flat(following, fused)) == [i for i in range(40, 80) if not drops(i)]
        else:  # an epoch is a count of results, and which ones depends on timing: none is lost
            assert {i for i in range(80) if not drops(i)} <= set(got) | set(after)
            if fused:
                assert len(before) + len(rest) == len(following) == 20


class Tagged(RNGDataFlow):
    """Each copy draws a tag at reset, then numbers and random values: a worker's stream is recognisable."""

    def __init__(self, n=10, seed=None):
        self.n, self.seed = n, seed

    def reset_state(self):
        super().reset_state()
        self.tag = int(self.rng.randint(1 << 30))

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield [self.tag, i, int(self.rng.randint(1000))]


def _by_tag(dps):
    out: dict = {}
    for tag, i, v in dps:
        out.setdefault(tag, []).append((i, v))
    return out


@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_runner_restarts_each_worker_where_it_was(kind, leak_check):
    make = (lambda: MultiProcessRunner(Tagged(), 4, 2, seed=7)) if kind == "processes" else \
        (lambda: MultiThreadRunner(lambda: Tagged(), 4, 2, seed=7))
    streams = {}
    for w in range(2):  # what each worker's copy yields, epoch after epoch
        copy = Tagged()
        with worker_seed_scope(7 + w):
            copy.reset_state()
        streams.update(_by_tag([dp for _ in range(5) for dp in copy]))
    for k in (0, 3, 10, 17):
        with make() as f:
            it = iter(f)
            before = [next(it) for _ in range(min(k, 10))]
            if k >= 10:
                before += list(it)
                it = iter(f)
                before += [next(it) for _ in range(k - 10)]
            state = json.loads(json.dumps(f.state_dict()))
            it.close()
        with make() as g:
            g.load_state_dict(state)
            after = list(g) + list(g)
        assert len(after) == 20 - k % 10  # the epoch goes on where it was, then a whole one
        for tag, seq in _by_tag(before + after).items():
            assert seq == streams[tag][:len(seq)], f"after {k}: worker {tag} did not continue its own stream"


def test_runner_state_loaded_after_reset_restarts_the_workers(leak_check):
    with MultiProcessRunner(Tagged(), 4, 2, seed=7) as f:
        it = iter(f)
        before = [next(it) for _ in range(4)]
        state = f.state_dict()
        pids = None
        it.close()
    with MultiProcessRunner(Tagged(), 4, 2, seed=7) as g:
        g.reset_state()
        pids = g._pool.pids
        g.load_state_dict(state)
        after = list(g)
        assert g._pool.pids != pids  # started again, from the saved states
    assert len(before) + len(after) == 10


def test_state_of_an_unresumable_source_is_refused_but_iteration_works(leak_check):
    df = MultiProcessMapData(bf.DataFromGenerator([i] for i in range(30)), 2, times_ten, buffer_size=4)
    with df:
        assert sorted(dp[0] for dp in df) == [i * 10 for i in range(30)]
        with pytest.raises(NotResumableError, match=r"^MultiProcessMapData/DataFromGenerator: it was given a "
                                                    r"generator object"):
            df.state_dict()


def test_stage_mismatches_are_named(leak_check):
    with MultiThreadMapData(src(), 2, times_ten) as f:
        it = iter(f)
        next(it)
        state = f.state_dict()
        it.close()
    with pytest.raises(StateMismatchError, match=r"^MultiThreadMapData: the state is for ordered=True"):
        MultiThreadMapData(src(), 2, times_ten, ordered=False).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="for a carried stage, this one is strict"):
        MultiThreadMapData(src(), 2, times_ten, strict=True).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"^MultiThreadMapData/DataFromList: the state is for a dataset of "
                                                 r"length 40"):
        MultiThreadMapData(src(41), 2, times_ten).load_state_dict(state)
    with MultiThreadMapData(src(), 2, times_ten) as g:
        g.load_state_dict(state)
        with pytest.raises(StateMismatchError, match=r"saved without a BatchData, this stage is iterated by "
                                                     r"BatchData\(4\)"):
            list(bf.BatchData(g, 4))
    runner_state = MultiThreadRunner(lambda: Tagged(), 4, 2).state_dict()
    with pytest.raises(StateMismatchError, match=r"^MultiThreadRunner: the state is for 2 workers, this stage has 3"):
        MultiThreadRunner(lambda: Tagged(), 4, 3).load_state_dict(runner_state)


def test_an_ended_source_is_refused_on_a_carried_stage(leak_check):
    """'ended' (the source's epoch over) is saved only by a strict stage: a carried stage's stream never ends.
    Set on a carried stage, with the checksum made again, it was taken: the first iter() raised an error naming
    no flow ("resuming replays 28 datapoints ... it ended after 0") and close() then raised AttributeError (the
    carried stream was a list iterator)."""
    with bf.BatchData(MultiProcessMapData(src(), 2, times_ten, buffer_size=8), 4) as f:
        it = iter(f)
        next(it)
        state = f.state_dict()
        it.close()
    state["child"]["ended"] = True
    state["check"] = checksum(state)
    g = bf.BatchData(MultiProcessMapData(src(), 2, times_ten, buffer_size=8), 4)
    with pytest.raises(StateMismatchError, match=r"^BatchData/MultiProcessMapData: .*ended, which a carried stage"):
        g.load_state_dict(state)
    g.close()


@pytest.mark.parametrize("damage", ["worker_sum", "no_state_field"])
def test_a_runner_refuses_damaged_worker_positions_at_load(damage, leak_check):
    """Each worker's state is a tree with its own checksum, inside the runner's: with the runner's sum made
    again it was checked only in the worker, at iter(), naming the worker's flow and not the runner; a position
    without its 'state' field was taken and iter() raised KeyError (found by fuzz_states with the checksum
    recomputed after each mutation)."""
    with MultiProcessRunner(bf.MapData(src(), times_ten), 4, 2) as f:
        it = iter(f)
        for _ in range(7):
            next(it)
        state = f.state_dict()
        it.close()
    if damage == "worker_sum":
        worker = next(w for w in state["workers"] if w["state"] is not None)
        worker["state"]["check"] = "00000000"
        match = r"^MultiProcessRunner/workers\[\d\]: .*checksum"
    else:
        del state["workers"][0]["state"]
        match = r"^MultiProcessRunner: worker 0's position has the fields \['replay'\]"
    state["check"] = checksum(state)
    g = MultiProcessRunner(bf.MapData(src(), times_ten), 4, 2)
    with pytest.raises(StateMismatchError, match=match):
        g.load_state_dict(state)
    g.close()


def test_state_dict_with_many_in_flight_is_small(leak_check):
    """256 datapoints in flight in 2 processes: the state holds a source state and a few integers."""
    with bf.BatchData(MultiProcessMapData(src(5000), 2, times_ten, buffer_size=256), 8) as df:
        it = iter(df)
        for _ in range(5):
            next(it)
        state = df.state_dict()
        assert len(json.dumps(state)) < 1500
        assert state["child"]["replay"] <= 64 + 256
        it.close()


KILL_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import bridgeflow as bf
    from bridgeflow.parallel import MultiProcessMapData

    def square(dp):
        return None if dp[0] % 9 == 4 else [dp[0], np.full(4, dp[0] * dp[0], np.int64)]

    def make():
        source = bf.LocallyShuffleData(bf.DataFromList([[i] for i in range(300)], shuffle=True, seed=1), 16, seed=2)
        return bf.BatchData(MultiProcessMapData(source, 2, square, buffer_size=32), 8)

    out_path, state_path, stop_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    df = make()
    if os.path.exists(state_path):
        with open(state_path) as f:
            df.load_state_dict(json.load(f))
    n = 0
    with open(out_path, "a") as out:
        for epoch in range(2):
            for ids, values in df:
                out.write(json.dumps([ids.tolist(), values[:, 0].tolist()]) + "\\n")
                out.flush()
                n += 1
                if n == stop_after:  # save, tell the parent, and wait to be killed
                    with open(state_path + ".tmp", "w") as f:
                        json.dump(df.state_dict(), f)
                    os.replace(state_path + ".tmp", state_path)
                    print("saved", flush=True)
                    time.sleep(600)
    print("done", flush=True)
""")


def test_process_killed_after_saving_is_continued_by_a_new_one(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))

    def run(out, state, stop_after, kill):
        proc = subprocess.Popen([sys.executable, str(script), str(out), str(state), str(stop_after)],
                                stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        try:
            line = proc.stdout.readline()
            if kill:
                assert line.strip() == "saved"
                os.killpg(proc.pid, signal.SIGKILL)  # the consumer and its workers, no cleanup
            assert proc.wait(timeout=120) in ((-signal.SIGKILL,) if kill else (0,))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return [json.loads(x) for x in out.read_text().splitlines()]

    whole = run(tmp_path / "whole.jsonl", tmp_path / "none.json", -1, kill=False)
    # each epoch takes 300 datapoints of LocallyShuffleData's endless stream, drops ids 4 mod 9 and keeps the
    # whole batches of 8 of what is left
    shuffled = bf.LocallyShuffleData(bf.DataFromList([[i] for i in range(300)], shuffle=True, seed=1), 16, seed=2)
    shuffled.reset_state()
    kept = [sum(dp[0] % 9 != 4 for dp in shuffled) for _ in range(2)]
    assert len(whole) == sum(k // 8 for k in kept) and [len(b[0]) for b in whole] == [8] * len(whole)
    first = run(tmp_path / "a.jsonl", tmp_path / "state.json", 19, kill=True)
    assert len(first) == 19
    second = run(tmp_path / "b.jsonl", tmp_path / "state.json", -1, kill=False)
    assert first + second == whole


# --- wrappers over an unordered stage: the state keeps what the wrapper holds (issue 29) -------------------


def _ids(dps):
    """The ids in datapoints or batches of them, as a sorted list."""
    return sorted(int(v) for dp in dps for v in np.asarray(dp[0]).ravel())


def _unique(kind, ordered=False):
    """A strict stage over ids unique across epochs (epoch e: 40e .. 40e + 39), unordered by default."""
    source = bf.FixedSizeData(bf.DataFromList([[i] for i in range(2_000)], shuffle=False), 40)
    return STAGES[kind](source, 2, jittery_keep, buffer_size=6, ordered=ordered, strict=True)


WRAPPERS = {
    "UnbatchData": lambda s: bf.UnbatchData(bf.BatchData(s, 3, remainder=True)),
    "RepeatedDataPoint": lambda s: bf.RepeatedDataPoint(s, 3),
    "CacheData": lambda s: bf.CacheData(s, shuffle=True, seed=4),
    "LocallyShuffleData": lambda s: bf.LocallyShuffleData(s, 5, seed=4, one_pass=True),
    "LocallyShuffleData num_reuse": lambda s: bf.LocallyShuffleData(s, 5, num_reuse=2, seed=4, one_pass=True),
    "nested ordered stage": lambda s: MultiThreadMapData(s, 2, jittery_keep, buffer_size=5, strict=True),
    "nested unordered stage": lambda s: MultiThreadMapData(s, 2, jittery_keep, buffer_size=5, strict=True,
                                                           ordered=False),
    "nested fused batches": lambda s: bf.UnbatchData(bf.BatchData(MultiThreadMapData(s, 2, jittery_keep,
                                                                                     buffer_size=5, strict=True), 2)),
}


# every wrapper over threads; over processes the few whose state crosses the process boundary differently
_IN_PROCESSES = ("UnbatchData", "RepeatedDataPoint", "nested fused batches")


@pytest.mark.parametrize("wrapper, kind", [(w, "threads") for w in sorted(WRAPPERS)]
                         + [(w, "processes") for w in _IN_PROCESSES])
def test_a_wrapper_over_an_unordered_stage_resumes_every_datapoint_once(wrapper, kind, leak_check):
    """The resume fuzz found UnbatchData part-way through a batch, RepeatedDataPoint part-way through a
    datapoint's repeats, CacheData, a stage over another and others repeating one datapoint and losing another:
    their state was their child's state before the current item plus an offset, and the unordered stage's
    next item on a resume was another one. Now at every point of two epochs (saved through json, loaded in a
    new pipeline) each epoch holds exactly its datapoints, those before the state and those after."""
    make = lambda: WRAPPERS[wrapper](_unique(kind))
    with make() as f:
        ref = [_ids(list(f)) for _ in range(3)]
    times = {"RepeatedDataPoint": 3, "LocallyShuffleData num_reuse": 2}.get(wrapper, 1)
    assert ref[0] == sorted(list(range(40)) * times)
    assert ref[1] == (ref[0] if wrapper == "CacheData" else sorted(list(range(40, 80)) * times))
    for e in range(2):
        n = len(ref[e])
        for k in sorted({0, 1, 2, n // 2 - 1, n // 2, n - 1, n}):
            before, state = _saved_after(make, k, e)
            with make() as g:
                g.load_state_dict(state)
                got = [list(g) for _ in range(3 - e)]
            assert _ids(before + got[0]) == ref[e], f"epoch {e}, after {k}"
            assert [_ids(ep) for ep in got[1:]] == ref[e + 1:], f"epoch {e}, after {k}: the later epochs"


def _held(state):
    """Every 'held' field of a state that holds datapoints (packed as text), anywhere in it: a fused batch
    plan's 'held' is a count of its groups, not datapoints."""
    out = []
    if isinstance(state, dict):
        out += [state["held"]] if isinstance(state.get("held"), str) else []
        for v in state.values():
            out += _held(v)
    elif isinstance(state, list):
        for v in state:
            out += _held(v)
    return out


def test_only_a_wrapper_over_an_unordered_stage_holds_datapoints_in_its_state(leak_check):
    """Over ordered children a state holds no datapoint (the child's state before the item and an offset);
    over an unordered stage, the rest of the item part-way through."""
    for ordered, held in ((True, 0), (False, 1)):
        with bf.UnbatchData(bf.BatchData(_unique("threads", ordered), 4)) as f:
            it = iter(f)
            next(it)
            assert len(_held(f.state_dict())) == held
            for _ in range(3):
                next(it)
            assert _held(f.state_dict()) == []  # between batches: nothing held
            it.close()


class Opaque:
    """A component the codec cannot store."""


def opaque(dp):
    return [dp[0], Opaque()]


def test_a_held_datapoint_the_codec_cannot_store_refuses_the_state_naming_both(leak_check):
    stage = MultiThreadMapData(src(12), 2, opaque, buffer_size=4, ordered=False, strict=True)
    with bf.RepeatedDataPoint(stage, 2) as f:
        it = iter(f)
        next(it)
        with pytest.raises(NotResumableError, match=r"^RepeatedDataPoint: it holds datapoints of the unordered "
                                                    r"MultiThreadMapData under it.*test_state_parallel\.Opaque"):
            f.state_dict()
        next(it)
        assert "held" in f.state_dict()  # between two datapoints: nothing held, a state again
        it.close()


def test_flows_that_cannot_keep_an_unordered_stages_promise_refuse_by_name(leak_check):
    """A flow that resumes by replaying its epoch (the default state: BatchDataByShape, a flow writing only
    __iter__) and a runner whose copies hold an unordered stage refuse their states; ShardData over an unordered
    stage is refused when built (its ranks would keep overlapping parts)."""
    unordered = lambda: MultiThreadMapData(src(12), 2, jittery_keep, buffer_size=4, ordered=False)
    with bf.BatchDataByShape(unordered(), 2, 0) as f:
        it = iter(f)
        next(it)
        with pytest.raises(NotResumableError, match=r"^BatchDataByShape: it resumes by replaying its epoch .* "
                                                    r"the unordered MultiThreadMapData under it"):
            f.state_dict()
        it.close()
    with MultiThreadRunner(lambda: bf.MapData(unordered(), lambda dp: dp), num_prefetch=2, num_thread=2) as r:
        it = iter(r)
        next(it)
        with pytest.raises(NotResumableError, match=r"^MultiThreadRunner: each worker's copy .* the unordered "
                                                    r"MapData/MultiThreadMapData in it"):
            r.state_dict()
        it.close()
    with pytest.raises(ValueError, match=r"ShardData: MapData/MultiThreadMapData delivers in an order of its "
                                         r"workers' timing"):
        bf.ShardData(bf.MapData(unordered(), lambda dp: dp), 0, 2)
    bf.ShardData(unordered(), 0, 1).close()  # one rank: nothing to overlap


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_an_epoch_of_batches_left_early_reads_the_dropped_work_again(kind, leak_check):
    """FixedSizeData(keep_state=False) over a carried stage batching in its workers leaves the stage's epoch
    early: the work in flight was dropped and the stage's stream went on after it, so the next epoch skipped
    those datapoints, while a stage resumed from a state saved there reads them (the ordered resume fuzz,
    pipeline 387). The stream now goes back to the oldest datapoint not received, as a resumed one does."""
    def make():
        stage = STAGES[kind](bf.DataFromList([[i] for i in range(11)], shuffle=False), 1, times_ten, buffer_size=6)
        return bf.FixedSizeData(bf.BatchData(stage, 1), 4, keep_state=False)

    def firsts(epoch):
        return [int(np.asarray(b[0]).ravel()[0]) for b in epoch]

    with make() as f:
        whole = [firsts(f) for _ in range(3)]
    assert whole == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90, 100, 0]]
    for k in range(5):
        before, state = _saved_after(make, k)
        with make() as g:
            g.load_state_dict(state)
            assert [firsts(before) + firsts(g), firsts(g), firsts(g)] == whole, k


def plus_one(dp):
    return [dp[0] + 1, dp[1]]


def _tagged(n, shard=None):
    """A list joined with random tags: its next epoch's tags depend on how far its last epoch was read."""
    joined = bf.JoinData([bf.DataFromList([[i] for i in range(n)], shuffle=False),
                          bf.FakeData([[1]], size=n, dtype="int64", domain=(0, 10**9), seed=5)])
    return joined if shard is None else bf.ShardData(joined, shard, 3, drop_last=True)


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_a_stage_saved_before_reset_goes_back_in_its_source_as_uninterrupted(kind, leak_check):
    """An epoch of batches left early (RandomMixData takes len() of them, the stage made a fourth of one
    datapoint) makes a carried stage go back in its source, to a state noted as it pulled. After a resume from a
    state saved before reset_state(), that note was the loaded state with its generator unset, and going back
    kept the tags' generator where it was: every later epoch's tags differed from the uninterrupted run's."""
    def make():
        stage = STAGES[kind](_tagged(7), 2, plus_one, buffer_size=6)
        return bf.RandomMixData([bf.DataFromList([[-1, -1]] * 4, shuffle=False), bf.BatchData(stage, 2)], seed=3)

    with make() as f:
        runs = [[json.dumps(np.asarray(dp[-1]).tolist()) for dp in f] for _ in range(3)]
    saved = json.loads(json.dumps(make().state_dict()))
    with make() as g:
        g.load_state_dict(saved)
        assert [[json.dumps(np.asarray(dp[-1]).tolist()) for dp in g] for _ in range(3)] == runs


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_a_strict_stage_whose_source_ended_resumes_its_next_epoch_exactly(kind, leak_check):
    """A strict stage reads its source to the end of the epoch before the consumer has the last datapoint (a
    ShardData reads past its last one). RandomMixData takes exactly len() datapoints and never asks for the end:
    a state saved after the stage's last one resumed with the source's epoch replayed to there and then
    dropped, so the tags of its next epoch were drawn from another place (the fuzz, seed 21 pipeline 75)."""
    def make():
        stage = STAGES[kind](_tagged(11, shard=2), 2, plus_one, buffer_size=6, strict=True)
        return bf.RandomMixData([stage, bf.DataFromList([[-1, -1]] * 5, shuffle=False)], seed=3)

    n = len(check_resumable(make, positions=[0], epochs=3))
    check_resumable(make, positions=range(n + 1), epochs=3)


@pytest.mark.parametrize("wrapper", ["stage", "unbatch"])
def test_a_resumed_state_taken_again_before_its_first_datapoint_holds_what_is_in_flight(wrapper, leak_check):
    """Over an unordered stage a state holds the datapoints in flight. Resumed, they come first; a state taken
    right after iter() (nothing received yet) did not hold them any more: the second resume lost them (a stage
    over the unordered one) or gave the rest of a batch being unbatched never."""
    def make():
        inner = MultiThreadMapData(src(12), 2, jittery_keep, buffer_size=4, strict=True, ordered=False)
        if wrapper == "stage":
            return MultiThreadMapData(inner, 2, jittery_keep, buffer_size=4, strict=True)
        return bf.UnbatchData(bf.BatchData(inner, 5, remainder=True))

    with make() as f:
        everything = sorted(dp[0] for dp in f)
    before, state = _saved_after(make, 3)
    with make() as g:
        g.load_state_dict(state)
        it = iter(g)
        again = json.loads(json.dumps(g.state_dict()))
        it.close()
    with make() as h:
        h.load_state_dict(again)
        rest = [dp[0] for dp in h]
    assert sorted([dp[0] for dp in before] + rest) == everything


@pytest.mark.parametrize("fused", [False, True], ids=["unbatched", "fused-batches"])
@pytest.mark.parametrize("kind", sorted(STAGES))
def test_a_resumed_strict_epoch_closed_at_once_leaves_the_source_where_the_saved_one_did(kind, fused, leak_check):
    """A strict stage reads ahead of its consumer; an epoch left early leaves its source part-read, and the
    source's next epoch follows from there (FakeData's generator drew one tag per datapoint read). A resumed
    epoch closed before its first datapoint (RandomChooseData or JoinData done with the stage) had read only up
    to the saved position, so the next epoch's tags were the saved epoch's own again: the fuzz's duplicates
    under join/choose/mix (issue 29). The state now says how far the source was read ("ahead")."""
    def make():
        stage = STAGES[kind](_tagged(11), 2, plus_one, buffer_size=6, strict=True)
        return bf.BatchData(stage, 2, remainder=True) if fused else stage

    def tags(flow):
        return [int(t) for dp in flow for t in np.asarray(dp[1]).ravel()]

    with make() as f:
        it = iter(f)
        for _ in range(2):
            next(it)
        state = json.loads(json.dumps(f.state_dict()))
        it.close()
        after = tags(f)
    with make() as g:
        g.load_state_dict(state)
        iter(g).close()  # the rest of the saved epoch is left at once
        assert tags(g) == after
    assert (state["child"] if fused else state)["ahead"] > 0


@pytest.mark.parametrize("fused", [False, True], ids=["unbatched", "fused-batches"])
def test_a_resumed_process_stage_reads_ahead_as_far_as_the_saved_one_before_its_epoch_is_closed(fused, leak_check):
    """A process pool sends one task a worker until its first result says what results cost; the saved run's
    pool had learned that, so after the save it topped its read-ahead up to buffer_size, while the resumed
    run's fresh pool held back. A strict epoch closed a datapoint after the resume (a RandomChooseData whose
    other flow ran out) then left the source one datapoint less read, and the next epoch's tags shifted: the
    fuzz's last silent wrong resume (seed 203, pipeline 113). The state carries what the pool learned."""
    def make():
        stage = MultiProcessMapData(_tagged(11), 2, plus_one, buffer_size=6, strict=True, start_method="fork")
        return bf.BatchData(stage, 1) if fused else stage

    def tags(flow):
        return [int(t) for dp in flow for t in np.asarray(dp[1]).ravel()]

    def one_more_then_next_epoch(it, flow):
        next(it)
        it.close()  # the epoch is left a datapoint after the save
        return tags(flow)

    with make() as f:
        it = iter(f)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(f.state_dict()))
        after = one_more_then_next_epoch(it, f)
    with make() as g:
        g.load_state_dict(state)
        assert one_more_then_next_epoch(iter(g), g) == after
    assert (state["child"] if fused else state)["costs"] is not None


def not_one_in_three(dp):
    return int(dp[0]) % 3 != 1


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_a_carried_stage_over_a_cache_learning_its_length_resumes_in_every_epoch(kind, leak_check):
    """A non-strict stage over CacheData(FilterData(...)) runs its first epoch strict (no length yet) and the
    later ones carried (the filled cache has one). A state taken in a carried epoch was refused at load ("the
    state is for a carried stage, this one is strict": the stage asked its length before the cache's state was
    loaded), and one taken in the first epoch once the read-ahead had filled the cache said "carried" for an
    epoch running strict (the fuzz, seed 11 pipeline 173 and seed 211 pipeline 23)."""
    def make():
        cache = bf.CacheData(bf.FilterData(_tagged(11), not_one_in_three))
        return STAGES[kind](cache, 2, plus_one, buffer_size=4)

    def plain(dps):
        return [np.asarray(c).tolist() for dp in dps for c in dp]

    with make() as f:
        runs = [plain(f) for _ in range(3)]
    assert len(runs[0]) == 2 * 7
    for epoch, k in [(0, 1), (0, 4), (0, 7), (1, 0), (1, 3), (2, 6)]:
        before, state = _saved_after(make, k, epoch)
        with make() as g:
            g.load_state_dict(state)
            rest = [plain(g) for _ in range(3 - epoch)]
        assert [plain(before) + rest[0], *rest[1:]] == runs[epoch:], (epoch, k)


@pytest.mark.parametrize("runner", ["MultiProcessRunner", "PrefetchData", "MultiProcessRunnerZMQ", "MultiThreadRunner"])
def test_an_unseeded_runner_saves_its_workers_seed_so_a_map_stage_over_it_resumes_exactly(runner, leak_check):
    """seed=None: a runner's state taken before a worker gave anything held no seed, and the resumed workers reset
    their copies with another, so a map stage over it, which goes back to a snapshot of the runner taken before its
    first datapoint, read another permutation: datapoints repeated and as many lost, silently (issue 39)."""
    def make():
        data = bf.DataFromList([[i] for i in range(150)])  # unseeded: each worker's copy shuffles by its seed
        if runner == "MultiThreadRunner":
            stage = MultiThreadRunner(lambda: bf.DataFromList([[i] for i in range(150)]), num_thread=1)
        elif runner == "MultiProcessRunnerZMQ":
            stage = bf.MultiProcessRunnerZMQ(data, num_proc=1)
        else:
            stage = getattr(bf, runner)(data, num_proc=1)
        return bf.MultiThreadMapData(stage, 2, times_ten)

    with make() as df:
        states, ref = {}, []
        for e in range(2):
            if e == 0:
                states["fresh"] = json.loads(json.dumps(df.state_dict()))
            it = iter(df)
            if e == 0:
                states[0] = json.loads(json.dumps(df.state_dict()))
            epoch = []
            for dp in it:
                epoch.append(dp[0])
                if e == 0 and len(epoch) in (10, 100):
                    states[len(epoch)] = json.loads(json.dumps(df.state_dict()))
            ref.append(epoch)
    for k, state in states.items():
        with make() as again:
            again.load_state_dict(state)
            got = [[dp[0] for dp in again] for _ in range(2)]
        skip = 0 if k == "fresh" else k
        assert got == [ref[0][skip:], ref[1]], k
    assert states[0]["source"]["seed"] == states[10]["source"]["seed"] is not None


def test_a_runner_inside_a_runners_copy_draws_its_workers_seed_from_that_copys(leak_check):
    """An unseeded thread runner inside a process runner's copy drew its workers' seed from the OS: a copy
    restarted from the outer runner's saved seed (a state taken before its worker gave anything) read other
    random datapoints from the first one on, silently (issue 39's fuzz, pipeline 129)."""
    def make():
        inner = MultiThreadRunner(lambda: bf.FakeData([[1]], size=40, dtype="int64", domain=(0, 10**9)), num_thread=1)
        return bf.MultiProcessRunner(inner, num_proc=1)

    with make() as df:
        state = json.loads(json.dumps(df.state_dict()))  # before any worker started
        ref = [[int(dp[0][0]) for dp in df] for _ in range(2)]
    with make() as again:
        again.load_state_dict(state)
        assert [[int(dp[0][0]) for dp in again] for _ in range(2)] == ref
