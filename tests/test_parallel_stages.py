"""Parallel stages: same output as the sequential flow, every failure loud, nothing left behind."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
from procs import alive

import bridgeflow as bf
from bridgeflow._errors import DataFlowTerminated, DatapointError, WorkerError
from bridgeflow.parallel import (
    MultiProcessMapData,
    MultiProcessRunner,
    MultiThreadMapData,
    MultiThreadRunner,
    RemoteError,
)
from bridgeflow.parallel._common import usable_cpus
from bridgeflow.testing import assert_same_datapoints, check_dataflow
from conftest import PROMPTLY_S, InterruptAfterRead, child_pids, shm_entries, wait_for

START_METHODS = ["fork", "spawn", "forkserver"]


# --- functions the workers run (module level, so spawn can pickle them) ----------------------------

def image_of(i):
    return [np.full((3, 16, 16), i % 251, np.uint8), i, f"id{i}"]


def drop_some(i):
    return None if i % 5 == 2 else [np.full(40, i % 7, dtype=np.float32), i]


def as_dict(i):
    return {"img": np.full((2, 8), i, np.int16), "label": i, "name": str(i)}


def fail_at_13(i):
    if i == 13:
        raise KeyError(f"no such sample: {i}")
    return [i]


def exit_at_5(i):
    if i == 5:
        sys.exit(3)
    return [i]


def hard_exit_at_5(i):
    if i == 5:
        os._exit(7)
    return [i]


def sleep_forever(i):
    time.sleep(3600)


def kill_self_at_20(i):
    if i == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    return [np.zeros(50_000, np.uint8), i]


def first_hangs_second_dies(i):
    if i == 0:
        time.sleep(60)
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return [i]


def random_draw(i):
    return [np.random.randint(0, 2**31), i]


def drop_nothing(dp):
    return dp


def returns_int(i):
    return i


def widen(dp):
    return [dp[0].astype(np.float32), dp[1]]


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def returns_unpicklable(i):
    return [Unpicklable()]


def source(n=200):
    return bf.DataFromList(list(range(n)), shuffle=False)


def sequential(fn, n=200):
    return list(bf.MapData(source(n), fn))


def make(kind, fn, n=200, **kw):
    if kind == "thread":
        return MultiThreadMapData(source(n), 2, fn, buffer_size=kw.pop("buffer_size", 32), **kw)
    return MultiProcessMapData(source(n), 2, fn, buffer_size=kw.pop("buffer_size", 32), start_method=kind, **kw)


# --- same output ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["thread", *START_METHODS])
@pytest.mark.parametrize("strict", [True, False])
def test_ordered_output_equals_sequential(kind, strict, leak_check):
    expected = sequential(image_of)
    with make(kind, image_of, strict=strict) as df:
        first = check_dataflow(df, deterministic=True)
    assert_same_datapoints(expected, first)


@pytest.mark.parametrize("kind", ["thread", "fork"])
def test_dict_datapoints_and_dropped_ones(kind, leak_check):
    with make(kind, as_dict) as df:
        df.reset_state()
        assert_same_datapoints(sequential(as_dict), list(df))
    with make(kind, drop_some) as df:
        df.reset_state()
        out = list(df)
    assert_same_datapoints(sequential(drop_some), out)
    assert len(out) == 160


@pytest.mark.parametrize("kind", ["thread", "fork", "spawn"])
def test_unordered_output_is_the_same_multiset(kind, leak_check):
    with make(kind, image_of, ordered=False, strict=True) as df:
        df.reset_state()
        assert_same_datapoints(sequential(image_of), list(df), ordered=False)


@pytest.mark.parametrize("kind", ["thread", "fork", "spawn"])
@pytest.mark.parametrize("fn", [image_of, drop_some, as_dict])
def test_batching_after_the_stage_equals_batching_in_process(kind, fn, leak_check):
    """BatchData over a map stage stacks in the workers; the batches must be exactly the same."""
    for remainder in (False, True):
        expected = list(bf.BatchData(bf.MapData(source(), fn), 16, remainder=remainder))
        with bf.BatchData(make(kind, fn), 16, remainder=remainder) as df:
            df.reset_state()
            assert_same_datapoints(expected, list(df))
            assert_same_datapoints(expected, list(df))


def test_thread_and_process_variants_agree(leak_check):
    with make("thread", image_of) as t, make("fork", image_of) as p:
        t.reset_state()
        p.reset_state()
        assert_same_datapoints(list(t), list(p))


def test_batching_before_the_stage(leak_check):
    """BatchData inside the source: batches are what travels through the workers."""
    def double(batch):
        return [batch[0] * 2, batch[1]]

    src = bf.BatchData(bf.MapData(source(64), image_of), 8)
    with MultiThreadMapData(src, 2, double) as df:
        out = check_dataflow(df)
    assert len(out) == 8 and out[0][0].shape == (8, 3, 16, 16)
    assert (out[1][0][0] == 2 * 8).all()


def test_non_strict_epochs_continue_the_stream(leak_check):
    with make("fork", image_of, n=50, strict=False) as df:
        df.reset_state()
        it = iter(df)
        first = [next(it)[1] for _ in range(10)]
        del it  # break early: the non-strict stage keeps its work in flight for the next epoch
        rest = [dp[1] for dp in df]
    assert first == list(range(10))
    assert rest == list(range(10, 50)) + list(range(10))  # one epoch = len(ds) datapoints, continuing


class FailsInFirstEpoch(bf.DataFlow):
    """Twenty datapoints per epoch; the first epoch raises at datapoint 13 (a flaky disk)."""

    def __init__(self):
        self.epochs = 0

    def __len__(self):
        return 20

    def __iter__(self):
        self.epochs += 1
        for i in range(20):
            if i == 13 and self.epochs == 1:
                raise OSError("read error at 13")
            yield [np.full(4, i), i]


@pytest.mark.parametrize("kind", ["thread", "fork"])
@pytest.mark.parametrize("batched", [False, True])
def test_non_strict_stage_recovers_after_a_source_error(kind, batched, leak_check):
    """The epoch after a source error is a whole epoch: neither 'generator raised StopIteration' nor empty."""
    src = FailsInFirstEpoch()
    stage = (MultiThreadMapData(src, 2, drop_nothing, buffer_size=4) if kind == "thread" else
             MultiProcessMapData(src, 2, drop_nothing, buffer_size=4, start_method=kind))
    df = bf.BatchData(stage, 4) if batched else stage
    with df:
        df.reset_state()
        with pytest.raises(OSError, match="read error at 13"):
            list(df)
        again = list(df)
        assert len(again) == len(df) == (5 if batched else 20)
        labels = [int(v) for b in again for v in b[1]] if batched else [dp[1] for dp in again]
        start = labels.index(0)  # what was in flight when the source raised, then a new pass over it
        assert start < 13 and labels[start:] == list(range(len(labels) - start))
    assert src.epochs >= 2


def test_strict_epochs_restart_after_an_early_break(leak_check):
    with make("fork", image_of, n=50, strict=True) as df:
        df.reset_state()
        for dp in df:
            if dp[1] == 5:
                break
        assert [dp[1] for dp in df] == list(range(50))


def test_each_worker_gets_its_own_random_stream(leak_check):
    with make("fork", random_draw, n=64, seed=123) as df:
        df.reset_state()
        draws = [dp[0] for dp in df]
    with make("fork", random_draw, n=64, seed=123) as df:
        df.reset_state()
        again = [dp[0] for dp in df]
    assert draws == again  # reproducible for a fixed seed
    assert len(set(draws)) > 60  # forked workers do not replay one RNG state


def test_received_arrays_stay_valid_and_writable(leak_check):
    """Arrays from shared memory stay intact while held, even as their worker's slabs get reused."""
    with MultiProcessMapData(source(300), 2, image_of, buffer_size=8, start_method="fork") as df:
        df.reset_state()
        held = list(df)
    for i, dp in enumerate(held):
        assert (dp[0] == i % 251).all()
    held[0][0][...] = 7
    assert (held[0][0] == 7).all()


_INBAND_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    import bridgeflow as bf
    from test_parallel_stages import widen
    if __name__ == "__main__":
        src = bf.DataFromList([[np.full(3072, i % 256, np.uint8), i] for i in range(600)], shuffle=False)
        if {kind!r} == "thread":
            df = bf.MultiThreadMapData(src, 2, widen, buffer_size=100)
        else:
            df = bf.MultiProcessMapData(src, 2, widen, buffer_size=100, start_method={kind!r})
        with df:
            df.reset_state()
            got = [(dp[0].dtype.str, float(dp[0][0]), dp[1]) for dp in df]
        assert got == [("<f4", float(i % 256), i) for i in range(600)], got[:3]
        print("ok", len(got))
""")


@pytest.mark.parametrize("kind", ["thread", "fork", "spawn"])
def test_small_arrays_both_ways_do_not_deadlock(kind, tmp_path):
    """Datapoints under the shared-memory threshold travel in the pipes, tasks and results alike.

    3 KB in and 12 KB out per datapoint, 100 in flight: the consumer's task writes and a worker's result
    writes each fill a pipe. The two used to wait on each other forever at the first datapoint.
    """
    script = tmp_path / "inband.py"
    script.write_text(_INBAND_SCRIPT.format(tests=os.path.dirname(__file__), kind=kind))
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{kind}: the stage hung with in-band tasks and results")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "600"]


# --- failures ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["thread", "fork", "spawn"])
def test_map_exception_keeps_its_type_and_worker_traceback(kind, leak_check):
    with make(kind, fail_at_13) as df:
        df.reset_state()
        got = []
        with pytest.raises(KeyError, match="no such sample: 13") as info:
            for dp in df:
                got.append(dp[0])
    assert got == list(range(13))  # ordered: everything before the failure arrives first
    assert "fail_at_13" in str(info.value.__cause__)  # the worker's traceback


def test_map_returning_a_non_datapoint_names_the_function(leak_check):
    with make("fork", returns_int) as df, pytest.raises(DatapointError, match="returns_int"):
        df.reset_state()
        list(df)


def test_unpicklable_result_is_an_error_naming_the_problem(leak_check):
    with make("fork", returns_unpicklable) as df, pytest.raises(TypeError, match="cannot be sent"):
        df.reset_state()
        list(df)


@pytest.mark.parametrize("fn", [exit_at_5, hard_exit_at_5])
def test_worker_exit_becomes_an_error(fn, leak_check):
    with make("fork", fn) as df:
        df.reset_state()
        t0 = time.monotonic()
        with pytest.raises((WorkerError, RemoteError)) as info:
            list(df)
    assert time.monotonic() - t0 < PROMPTLY_S
    if fn is hard_exit_at_5:
        err = info.value
        assert isinstance(err, WorkerError) and err.exitcode == 7 and err.pid and err.stage == "MultiProcessMapData"
        assert "exited with code 7" in str(err)
    else:
        assert "SystemExit" in str(info.value)


def test_sigkilled_worker_is_reported_within_seconds(leak_check):
    with make("fork", kill_self_at_20, n=400) as df:
        df.reset_state()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="SIGKILL") as info:
            list(df)
    assert time.monotonic() - t0 < PROMPTLY_S
    assert info.value.exitcode == -signal.SIGKILL and info.value.worker in (0, 1)


def test_dead_worker_is_reported_while_the_consumer_waits_for_another(leak_check):
    """Ordered output waits for worker 0's hanging task; worker 1's death must not wait behind it."""
    with make("fork", first_hangs_second_dies, buffer_size=4) as df:  # one task per chunk: task i -> worker i % 2
        df.reset_state()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="worker 1 .*SIGKILL") as info:
            next(iter(df))
        assert time.monotonic() - t0 < PROMPTLY_S
    assert info.value.worker == 1 and info.value.exitcode == -signal.SIGKILL


def test_worker_killed_from_outside(leak_check):
    with make("fork", image_of, n=10**6) as df:
        df.reset_state()
        it = iter(df)
        next(it)
        os.kill(df._pool.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="worker 1"):
            for _ in range(10**6):
                next(it)
        del it


class HoldsALock:
    def __init__(self):
        self.guard = threading.Lock()

    def __call__(self, i):
        return [i]


def with_resource(resource, i):
    return [i]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("fn, named", [
    (lambda i: [i], r"map_func '<lambda>' \(test_parallel_stages.py, line \d+\) cannot be pickled"),
    (functools.partial(with_resource, threading.Lock()),
     r"map_func 'with_resource' .* in functools.partial, whose argument 0 \(an instance of _thread.lock\)"),
    (HoldsALock(), r"map_func an instance of .*HoldsALock, whose attribute 'guard' \(an instance of _thread.lock"),
])
def test_unpicklable_map_fails_before_any_worker_starts(method, fn, named, leak_check):
    before = child_pids()
    df = MultiProcessMapData(source(), 2, fn, start_method=method)
    with pytest.raises(TypeError, match=named) as info:
        df.reset_state()
    assert f"start_method={method!r}" in str(info.value)
    assert child_pids() == before
    df.close()


def test_hanging_map_is_stopped_by_close(leak_check):
    """A consumer blocked on a map that never returns gets a clear error when the stage is closed."""
    df = make("fork", sleep_forever)
    df.reset_state()
    outcome = {}

    def consume():
        try:
            next(iter(df))
        except BaseException as exc:
            outcome["error"] = exc

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.5)
    assert consumer.is_alive()  # the map hangs, and so does the consumer
    df.close()
    consumer.join(PROMPTLY_S)
    assert not consumer.is_alive()
    assert isinstance(outcome["error"], DataFlowTerminated)


# --- nothing leaks --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["thread", "fork", "spawn"])
def test_early_break_then_close_leaks_nothing(kind, leak_check):
    df = make(kind, image_of)
    df.reset_state()
    for dp in df:
        if dp[1] == 3:
            break
    df.close()
    df.close()  # idempotent


@pytest.mark.parametrize("kind", ["thread", "fork", "spawn"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_closed_stage_starts_new_workers_when_read_again(kind, strict, leak_check):
    """``with df`` (or ``with QueueInput(df)``) twice: close() stops the workers, and the next pass starts new
    ones (it used to raise "closed") and reads the source's next epoch: the one a stage left open reads when
    strict; when not strict, a complete epoch (the read-ahead into the source's next epoch is dropped)."""

    def build():
        src = bf.DataFromList(list(range(40)), shuffle=True, seed=5)
        if kind == "thread":
            return MultiThreadMapData(src, 2, image_of, buffer_size=8, strict=strict)
        return MultiProcessMapData(src, 2, image_of, buffer_size=8, start_method=kind, strict=strict)

    ids = lambda df: [int(dp[1]) for dp in df]
    with build() as df:
        expected = [ids(df), ids(df)]
    df = build()
    got = []
    for _ in range(2):
        with df:
            got.append(ids(df))
    assert sorted(got[1]) == list(range(40)) and got[0] == expected[0]
    if strict:
        assert got[1] == expected[1]


def test_consumer_exception_then_del_leaks_nothing(leak_check):
    def consume():
        df = bf.BatchData(make("fork", image_of), 8)
        df.reset_state()
        for _ in df:
            raise ValueError("the training step failed")

    with pytest.raises(ValueError):
        consume()


def test_collected_stage_stops_its_workers(leak_check):
    df = make("fork", image_of)
    df.reset_state()
    next(iter(df))
    pids = df._pool.pids
    del df
    assert wait_for(lambda: not (set(pids) & child_pids()))


_ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import bridgeflow as bf
    from bridgeflow.parallel import MultiProcessMapData
    from test_parallel_stages import image_of
    df = MultiProcessMapData(bf.DataFromList(list(range(10**6)), shuffle=False), 2, image_of,
                             start_method={method!r})
    df.reset_state()
    it = iter(df)
    next(it)
    print(" ".join(str(p) for p in df._pool.pids), flush=True)
    {action}
""")


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_exit_when_the_parent_is_sigkilled(method):
    shm_before = shm_entries(mine_only=False)
    script = _ORPHAN_SCRIPT.format(tests=os.path.dirname(__file__), method=method, action="time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not any(alive(p) for p in pids)), "orphaned workers kept running"
    left = lambda: {n for n in shm_entries(mine_only=False) - shm_before if n.startswith(f"bf{proc.pid}_")}
    assert wait_for(lambda: not left()), f"shared memory left: {sorted(left())}"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigterm_to_the_whole_process_group_leaves_no_shared_memory(method):
    """Slurm, `timeout` and a closed terminal signal the consumer and its workers together: the consumer
    dies without cleaning up, so the workers must."""
    shm_before = shm_entries(mine_only=False)
    script = _ORPHAN_SCRIPT.format(tests=os.path.dirname(__file__), method=method, action="time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    assert proc.returncode == -signal.SIGTERM
    assert wait_for(lambda: not any(alive(p) for p in pids)), "workers kept running"
    left = lambda: {n for n in shm_entries(mine_only=False) - shm_before if n.startswith(f"bf{proc.pid}_")}
    assert wait_for(lambda: not left()), f"shared memory left: {sorted(left())}"


def test_worker_sigtermed_alone_is_reported_as_killed_by_sigterm(leak_check):
    with make("fork", image_of, n=10**6) as df:
        df.reset_state()
        it = iter(df)
        next(it)
        os.kill(df._pool.pids[0], signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="worker 0 .*SIGTERM") as info:
            for _ in range(10**6):
                next(it)
        assert time.monotonic() - t0 < PROMPTLY_S and info.value.exitcode == -signal.SIGTERM
        del it


def test_ctrl_c_in_the_consumer_leaves_nothing():
    shm_before = shm_entries(mine_only=False)
    script = _ORPHAN_SCRIPT.format(tests=os.path.dirname(__file__), method="fork",
                                   action="for dp in it: time.sleep(0.01)")
    # a session of its own: if the consumer hangs, the whole group (its forked workers too) is killed below
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=PROMPTLY_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "KeyboardInterrupt" in err
    assert wait_for(lambda: not any(alive(p) for p in pids))
    left = lambda: {n for n in shm_entries(mine_only=False) - shm_before if n.startswith(f"bf{proc.pid}_")}
    assert wait_for(lambda: not left()), f"shared memory left: {sorted(left())}"


# --- runners -------------------------------------------------------------------------------------

class Shard(bf.RNGDataFlow):
    """Ten random draws per epoch from the worker's own RNG (tensorpack-style: only __iter__)."""

    def __iter__(self):
        for _ in range(10):
            yield [int(self.rng.randint(0, 2**31))]

    def __len__(self):
        return 10


@pytest.mark.parametrize("kind", ["thread", "fork", "spawn"])
def test_runner_workers_iterate_their_own_reset_copies(kind, leak_check):
    if kind == "thread":
        df = MultiThreadRunner(Shard, 4, 2, seed=5)
    else:
        df = MultiProcessRunner(Shard(), 4, 2, start_method=kind, seed=5)
    with df:
        df.reset_state()
        epoch1 = [dp[0] for dp in df]
        epoch2 = [dp[0] for dp in df]
    assert len(epoch1) == 10 and len(epoch2) == 10
    assert len(set(epoch1 + epoch2)) == 20  # distinct seeds per worker: no stream is duplicated


def test_runner_source_error_reaches_the_consumer(leak_check):
    with MultiProcessRunner(bf.MapData(source(30), fail_at_13), 4, 2, start_method="fork") as df:
        df.reset_state()
        with pytest.raises(KeyError, match="13"):
            list(df)


def test_runner_with_batching_inside(leak_check):
    with MultiProcessRunner(bf.BatchData(bf.MapData(source(64), image_of), 16), 4, 2) as df:
        out = check_dataflow(df, deterministic=False)
    assert len(out) == 4 and out[0][0].shape == (16, 3, 16, 16)


def test_a_started_stage_copied_into_a_runner_keeps_working_here(leak_check):
    """The runner's forked workers inherit the inner stage's running pool. Resetting their copy must not
    stop this process's workers or remove its shared memory; a process pool inside a process worker is a
    clear error."""
    inner = make("fork", image_of, n=40)
    with inner:
        inner.reset_state()
        assert len(list(inner)) == 40
        with MultiProcessRunner(inner, 4, 2, start_method="fork") as runner:
            runner.reset_state()
            with pytest.raises(bf.BridgeflowError, match="cannot start worker processes inside .*MultiThreadMapData"):
                next(iter(runner))
            assert_same_datapoints(sequential(image_of, 40), list(inner))  # (the runner's close() closes it)


# --- statistics ------------------------------------------------------------------------------------

def slow_image_of(i):
    time.sleep(0.002)
    return image_of(i)


@pytest.mark.parametrize("stage", [MultiProcessMapData, MultiThreadMapData])
def test_stats_show_the_slow_side(stage, leak_check, capsys):
    with stage(source(400), 2, image_of, buffer_size=40) as df:
        rate = bf.TestDataSpeed(df, size=300, progress=False).start()
        stats = df.stats()[stage.__name__]
    assert rate > 0
    assert stats["datapoints"] >= 300 and stats["workers"] == 2
    for key in ("buffer_fill", "consumer_wait_frac", "workers_busy"):
        assert 0.0 <= stats[key] <= 1.0, key
    out = capsys.readouterr().out
    assert f"  {stage.__name__}: datapoints=" in out and "\nbottleneck: " in out


def test_stats_of_a_pipeline_name_every_stage_under_it(leak_check, capsys):
    """BatchData over a map stage reports the stage (through the flow that batches in its workers), and so does
    any flow above it; the verdict names a stage by its path."""
    inner = MultiThreadMapData(source(200), 2, slow_image_of, buffer_size=16)
    df = bf.MapData(bf.BatchData(inner, 8), lambda b: b)
    with df:
        bf.TestDataSpeed(df, size=20, progress=False).start()
        stats = df.stats()
        own = inner.stats()  # the stage alone, by its own name
    path = "MapData/BatchData/WorkerBatching/MultiThreadMapData"
    assert list(stats) == [path] and stats[path]["datapoints"] >= 160
    assert stats[path]["workers_busy"] > 0
    assert list(own) == ["MultiThreadMapData"] and own["MultiThreadMapData"]["datapoints"] == stats[path]["datapoints"]
    assert [p for p, _ in bf.iter_flows(df)] == ["MapData", "MapData/BatchData", "MapData/BatchData/WorkerBatching",
                                                 path, path + "/DataFromList"]
    assert "bottleneck: " in capsys.readouterr().out


def test_argument_validation():
    with pytest.raises(ValueError, match="number of workers"):
        MultiProcessMapData(source(), 0, image_of)
    with pytest.raises(ValueError, match="buffer_size"):
        MultiThreadMapData(source(), 2, image_of, buffer_size=-1)
    with pytest.raises(TypeError, match="map_func"):
        MultiProcessMapData(source(), 2, "not callable")
    with pytest.raises(ValueError, match="start_method"):
        MultiProcessMapData(source(), 2, image_of, start_method="teleport").reset_state()
    with pytest.raises(TypeError, match="DataFlow or a function"):
        MultiThreadRunner(42, 4, 2)


# --- tensorpack's other names ------------------------------------------------------------------------

def test_tensorpack_names_take_tensorpack_argument_orders(leak_check):
    expected = list(bf.BatchData(bf.MapData(source(64), image_of), 16))
    with bf.MultiProcessMapAndBatchDataZMQ(source(64), 2, image_of, 16) as df:
        df.reset_state()
        assert_same_datapoints(expected, list(df))
    with bf.MultiProcessMapDataZMQ(source(64), 2, image_of, buffer_size=8) as df:
        df.reset_state()
        assert_same_datapoints(sequential(image_of, 64), list(df))
    zmq_runner = bf.PrefetchDataZMQ(Shard(), 3)  # (ds, num_proc=1, hwm=50)
    assert (zmq_runner.num_workers, zmq_runner.num_prefetch) == (3, 50)
    with zmq_runner:
        zmq_runner.reset_state()
        assert len(list(zmq_runner)) == 10


def test_old_tensorpack_spellings():
    df = bf.RepeatedDataPoint(source(3), 2)
    assert df.size() == 6
    df.reset_state()
    assert [dp for dp in df.get_data()] == [0, 0, 1, 1, 2, 2]
    assert bf.ThreadedMapData(source(), 2, image_of).num_workers == 2
    assert bf.MultiProcessPrefetchData(Shard(), 4, 2).num_workers == 2


@pytest.mark.parametrize("batched", [False, True])
def test_an_iteration_interrupted_mid_receive_restarts_the_workers(batched, leak_check, caplog):
    df = MultiProcessMapData(bf.DataFromList(list(range(100)), shuffle=False), 2, image_of, buffer_size=8)
    flow = bf.BatchData(df, 10) if batched else df
    labels = (lambda out: [int(x) for b in out for x in b[1]]) if batched else (lambda out: [dp[1] for dp in out])
    with flow:
        flow.reset_state()
        first_pids = set(df._pool.pids)
        it = iter(flow)
        next(it)
        df._pool._channel.readers[1] = InterruptAfterRead(df._pool._channel.readers[1])
        with pytest.raises(KeyboardInterrupt):
            for _ in it:
                pass
        it.close()
        assert labels(list(flow)) == list(range(100))  # a whole epoch, from new workers
        assert not first_pids & set(df._pool.pids)
        assert "interrupted while receiving" in caplog.text


# --- tensorpack's positional orders and older keywords ------------------------------------------------

RUNNERS = {  # name -> (call in tensorpack's positional order, workers it starts, its num_prefetch)
    "MultiProcessRunner": (lambda: MultiProcessRunner(Shard(), 3, 2), 2, 3),
    "PrefetchData": (lambda: bf.PrefetchData(Shard(), 3, 2), 2, 3),
    "MultiProcessPrefetchData": (lambda: bf.MultiProcessPrefetchData(Shard(), 5, 1), 1, 5),
    "MultiProcessRunnerZMQ": (lambda: bf.MultiProcessRunnerZMQ(Shard(), 2), 2, 50),
    "PrefetchDataZMQ": (lambda: bf.PrefetchDataZMQ(Shard(), 3, 7), 3, 7),
    "MultiThreadRunner": (lambda: MultiThreadRunner(Shard, 3, 2), 2, 3),
}


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_runners_take_tensorpacks_positional_order(name, leak_check):
    make, workers, prefetch = RUNNERS[name]
    threads0 = threading.active_count()
    kids0 = child_pids()
    with make() as df:
        assert (df.num_workers, df.num_prefetch) == (workers, prefetch)
        df.reset_state()
        started = len(child_pids() - kids0) if df._processes else threading.active_count() - threads0
        assert started == workers
        assert len([dp for dp in df]) == 10


def test_runner_counts_by_keyword_keep_working(leak_check):
    df = MultiProcessRunner(Shard(), num_proc=2)
    assert (df.num_workers, df.num_prefetch) == (2, 16)
    df = MultiThreadRunner(Shard, num_thread=3, num_prefetch=1)
    assert (df.num_workers, df.num_prefetch) == (3, 1)
    with df:
        df.reset_state()
        assert len(list(df)) == 10  # fewer prefetched than workers: every worker still gets work


def test_runner_order_change_is_loud(caplog):
    """One count alone (bridgeflow's old ``(ds, num_proc)``) is an error; counts that read like the old order
    warn at the caller's line; keywords never warn."""
    with pytest.raises(TypeError, match=r"needs num_proc, the number of processes; the positional order is "
                                        r"tensorpack's, \(ds, num_prefetch, num_proc\) \(earlier bridgeflow "
                                        r"versions took \(ds, num_proc, num_prefetch\)\)"):
        MultiProcessRunner(Shard(), 4)
    with pytest.raises(TypeError, match=r"needs num_thread.*\(get_df, num_thread, num_prefetch\)"):
        MultiThreadRunner(Shard, 4)
    with pytest.warns(UserWarning, match=r"MultiProcessRunner\(ds, 2, 16\) starts 16 processes and prefetches 2"
                                        r".*Pass the counts by keyword") as record:
        MultiProcessRunner(Shard(), 2, 16).close()
    assert record[0].filename == __file__
    with pytest.warns(UserWarning, match=r"MultiThreadRunner\(get_df, 1, 4\) starts 4 threads"):
        MultiThreadRunner(Shard, 1, 4).close()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*the positional order")  # (3 processes may be too many here)
        MultiProcessRunner(Shard(), num_prefetch=2, num_proc=3).close()
        MultiProcessRunner(Shard(), 4, 2).close()  # tensorpack's usual shape: more prefetched than processes
        bf.MultiProcessRunnerZMQ(Shard(), 3, 2).close()
    cpus = usable_cpus()
    many = rf"MultiProcessRunner starts {2 * cpus + 1} processes on {cpus} CPUs .*pass num_proc=\d+ or fewer"
    with pytest.warns(bf.OversubscribedWarning, match=many + r" \(num_prefetch=.*tensorpack's order") as record:
        MultiProcessRunner(Shard(), 2 * cpus + 8, 2 * cpus + 1).close()
    assert record[0].filename == __file__  # the line that asked for them


DEPRECATED = [  # (class, the older keyword, the keyword it stands for, the other arguments)
    (MultiProcessRunner, "nr_proc", "num_proc", dict(num_prefetch=4)),
    (MultiProcessRunner, "nr_prefetch", "num_prefetch", dict(num_proc=2)),
    (bf.PrefetchData, "nr_proc", "num_proc", dict(num_prefetch=4)),
    (bf.PrefetchData, "nr_prefetch", "num_prefetch", dict(num_proc=2)),
    (bf.MultiProcessRunnerZMQ, "nr_proc", "num_proc", {}),
    (MultiThreadRunner, "nr_thread", "num_thread", dict(num_prefetch=4)),
    (MultiThreadRunner, "nr_prefetch", "num_prefetch", dict(num_thread=2)),
    (MultiProcessMapData, "nr_proc", "num_proc", dict(map_func=image_of)),
    (bf.MultiProcessMapDataZMQ, "nr_proc", "num_proc", dict(map_func=image_of)),
    (MultiThreadMapData, "nr_thread", "num_thread", dict(map_func=image_of)),
    (bf.ThreadedMapData, "nr_thread", "num_thread", dict(map_func=image_of)),
]


@pytest.mark.parametrize("cls, old, new, rest", DEPRECATED, ids=[f"{c.__name__}-{o}" for c, o, _, _ in DEPRECATED])
def test_tensorpacks_older_keywords_are_accepted_with_a_deprecation_warning(cls, old, new, rest):
    ds = Shard if cls is MultiThreadRunner else Shard() if "Runner" in cls.__name__ or "Prefetch" in cls.__name__ \
        else source()
    with pytest.warns(DeprecationWarning, match=rf"{cls.__name__}\({old}=\.\.\.\) is tensorpack's older name of "
                                                rf"the argument: use {new}=") as record:
        df = cls(ds, **rest, **{old: 3})
    assert record[0].filename == __file__
    attr = {"num_prefetch": "num_prefetch"}.get(new, "num_workers")
    assert getattr(df, attr) == 3
    with pytest.raises(TypeError, match=f"got both {old}= and {new}="):
        cls(ds, **rest, **{old: 3, new: 3})
    df.close()


def test_map_and_batch_takes_nr_proc(leak_check):
    with pytest.deprecated_call(match="use num_proc="):
        df = bf.MultiProcessMapAndBatchData(source(32), map_func=image_of, batch_size=8, nr_proc=2)
    with df:
        assert df.ds.num_workers == 2
        assert len(list(df)) == 4


@pytest.mark.parametrize("remainder", [False, True])
def test_fused_batching_keeps_the_workers_busy_across_epochs(remainder, leak_check):
    stage = MultiProcessMapData(bf.DataFromList(list(range(100)), shuffle=False), 2, image_of, buffer_size=64)
    df = bf.BatchData(stage, 8, remainder=remainder)
    with df:
        df.reset_state()
        for _ in range(3):
            batches = list(df)
            assert [len(b[1]) for b in batches] == [8] * 12 + ([4] if remainder else [])
            labels = [int(x) for b in batches for x in b[1]]
            assert labels == list(range(len(labels)))  # each epoch is one pass of the source, in order
            assert np.array_equal(batches[3][0], np.stack([image_of(i)[0] for i in range(24, 32)]))
            assert stage._pool.outstanding > 0  # the next epoch's groups are being mapped already
        # Unbatched next: the groups in flight are dropped (their datapoints were drawn from the carried
        # stream, which goes on), and only plain datapoints come out.
        out = list(stage)
        first = out[0][1]
        assert [dp[1] for dp in out] == [(first + i) % 100 for i in range(100)]
        assert all(type(dp) is list and dp[0].shape == (3, 16, 16) for dp in out)


def test_strict_fused_batching_leaves_nothing_in_flight(leak_check):
    stage = MultiProcessMapData(bf.DataFromList(list(range(50)), shuffle=False), 2, image_of, strict=True)
    with bf.BatchData(stage, 8) as df:
        df.reset_state()
        for _ in range(2):
            assert [int(x) for b in df for x in b[1]] == list(range(48))
            assert stage._pool.outstanding == 0


def test_fused_batching_of_an_empty_source_gives_empty_epochs(leak_check):
    with bf.BatchData(MultiProcessMapData(bf.DataFromList([], shuffle=False), 2, image_of), 4) as df:
        df.reset_state()
        assert [list(df), list(df)] == [[], []]


@pytest.mark.parametrize("batched", [False, True])
def test_reset_state_again_releases_the_source(batched, leak_check):
    """A second reset_state() (TestDataSpeed after a training loop does one) while the carried stream holds
    the source mid-epoch: the stream is closed at once, so the new one may iterate the source (it used to
    be refused as a second consumer until a garbage collection)."""
    src = bf.MapData(bf.DataFromList([[i] for i in range(256)], shuffle=False), lambda dp: dp)
    stage = MultiProcessMapData(src, 2, lambda dp: dp, buffer_size=128)
    df = bf.BatchData(stage, 32) if batched else stage
    with df:
        df.reset_state()
        assert len(list(df)) == len(df)
        df.reset_state()
        assert len(list(df)) == len(df)


# --- what a newcomer runs into ----------------------------------------------------------------------


UNGUARDED = """
import bridgeflow as bf

def double(dp):
    return [dp[0] * 2]

df = bf.MultiProcessMapData(bf.DataFromList([[i] for i in range(8)], shuffle=False), 2, double,
                            start_method="spawn")
print(sum(dp[0] for dp in df))
"""


def test_a_spawned_pipeline_without_the_main_guard_says_so(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode != 0
    # the parent's error; not always the last line: the other worker's own message may be written after it
    ours = [ln for ln in out.stderr.splitlines() if ln.startswith("bridgeflow._errors.WorkerError: worker ")]
    assert len(ours) == 1, out.stderr
    last = ours[0]
    assert "exited with code 1" in last
    assert f"re-running your script {script}" in last and 'no `if __name__ == "__main__":` guard' in last
    # and each worker says why it stopped, instead of multiprocessing's bootstrapping essay
    assert "while this process is itself starting as a worker, re-running your main module" in out.stderr

    guarded = tmp_path / "guarded.py"
    head, run = UNGUARDED.split("df = bf.")
    guarded.write_text(head + 'if __name__ == "__main__":\n' + textwrap.indent("df = bf." + run, "    "))
    ok = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "56"


def test_more_worker_processes_than_cpus_warn_once_per_request():
    cpus = usable_cpus()
    many = rf"MultiProcessMapData starts {cpus + 1} processes on {cpus} CPUs .*pass num_proc={cpus} or fewer"
    with pytest.warns(bf.OversubscribedWarning, match=many) as record:
        MultiProcessMapData(source(), cpus + 1, image_of).close()
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiProcessMapData(source(), cpus, image_of).close()
        MultiThreadMapData(source(), cpus + 4, image_of).close()  # threads: no word


def test_a_runner_over_an_unshuffled_flow_warns_of_the_repeats_it_yields(leak_check):
    """tensorpack's MultiProcessRunnerZMQ assumes i.i.d. datapoints; over a flow in a fixed order its workers
    give the same datapoints in the same order, and an epoch repeats them: said once, by name."""
    from bridgeflow.parallel import MultiProcessRunnerZMQ

    with pytest.warns(bf.UnshardedWarning, match=r"MultiProcessRunnerZMQ: its 2 workers each iterate their own copy "
                                                  r"of the flow, and nothing in it shuffles") as caught:
        df = MultiProcessRunnerZMQ(bf.DataFromList(list(range(2000)), shuffle=False), 2)
    assert caught[0].filename == __file__  # names the line that made the stage
    # what the warning is about: an epoch repeats datapoints, once both workers give their copies (a loaded
    # machine may let one worker give whole epochs before the other is scheduled: epochs are read until one
    # repeats, within PROMPTLY_S; a run that never repeats means one worker never gave anything)
    sizes, repeated, t0 = [], False, time.monotonic()
    with df:
        df.reset_state()
        while not repeated and time.monotonic() - t0 < PROMPTLY_S:
            epoch = [dp for dp in df]
            sizes.append(len(epoch))
            repeated = len(set(epoch)) < len(epoch)
    assert repeated, f"{len(sizes)} epochs in {PROMPTLY_S} s without a repeated datapoint"
    assert set(sizes) == {2000}
    # tensorpack's LMDB pipeline without its inner runner: a sequential source under LocallyShuffleData
    local = bf.MapData(bf.LocallyShuffleData(bf.DataFromList(list(range(20)), shuffle=False), 8), lambda dp: dp)
    with pytest.warns(bf.UnshardedWarning, match=r"MultiProcessRunnerZMQ: its 2 workers each iterate their own copy "
                                                  r"of the flow, whose source is read in the same order by every copy "
                                                  r"\(MapData/LocallyShuffleData shuffles only within its buffer\), "
                                                  r"so every worker gives the same datapoints, each in its own order"):
        MultiProcessRunnerZMQ(local, 2).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiProcessRunner(bf.DataFromList(list(range(20)), shuffle=True), 4, 2).close()  # random: i.i.d.
        MultiProcessRunner(bf.DataFromList(list(range(20)), shuffle=False), 4, 1).close()  # one copy
