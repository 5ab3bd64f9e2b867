"""WorkerPool, the engine under every parallel stage and the torch adapter, and its shared-memory transport."""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import threading
import time

import numpy as np
import pytest
from procs import alive

from bridgeflow._errors import BridgeflowError, WorkerError
from bridgeflow.parallel import EXHAUSTED, WorkerContext, WorkerPool
from bridgeflow.parallel._transport import shm as shm_mod
from conftest import PROMPTLY_S, InterruptAfterRead, shm_entries, wait_for


def scale_init(factor, ctx):
    return lambda x: x * factor


def context_init(ctx):
    return lambda _: (ctx.worker_id, ctx.num_workers, ctx.seed, ctx.stage)


def countdown_init(n, ctx):
    it = iter(range(n))
    return lambda _: next(it)


def failing_init(ctx):
    raise RuntimeError(f"cannot open the dataset in worker {ctx.worker_id}")


def sleepy_init(ctx):
    return lambda seconds: time.sleep(seconds)


def slow_echo_init(ctx):
    def run(payload):
        time.sleep(0.2)
        return payload

    return run


def array_init(ctx):
    return lambda i: {"a": np.full(100_000, i, np.int32), "small": np.arange(3), "i": i}


@pytest.mark.parametrize("processes", [False, True])
def test_results_come_back_in_task_order_from_round_robin_workers(processes, leak_check):
    with WorkerPool(context_init, 3, processes=processes, name="Ctx", base_seed=100) as pool:
        pool.start()
        for _ in range(7):
            pool.put(None)
        got = [pool.get() for _ in range(7)]
    assert [w for w, _ in got] == [0, 1, 2, 0, 1, 2, 0]  # task k goes to worker k % n
    assert {v for _, v in got} == {(0, 3, 100, "Ctx"), (1, 3, 101, "Ctx"), (2, 3, 102, "Ctx")}


@pytest.mark.parametrize("processes", [False, True])
def test_chunks_and_explicit_workers(processes, leak_check):
    with WorkerPool(functools.partial(scale_init, 3), 2, processes=processes, chunk_size=4) as pool:
        pool.start()
        ids = [pool.put(i, worker=i % 2) for i in range(10)]
        assert pool.outstanding == 10
        assert [pool.get()[1] for _ in ids] == [3 * i for i in range(10)]
        assert pool.outstanding == 0
        with pytest.raises(BridgeflowError, match="no task outstanding"):
            pool.get()


@pytest.mark.parametrize("processes", [False, True])
def test_stop_iteration_in_a_worker_is_exhausted(processes, leak_check):
    with WorkerPool(functools.partial(countdown_init, 2), 1, processes=processes) as pool:
        pool.start()
        for _ in range(4):
            pool.put(None)
        assert [pool.get()[1] for _ in range(4)] == [0, 1, EXHAUSTED, EXHAUSTED]


@pytest.mark.parametrize("processes", [False, True])
def test_init_failure_is_raised_by_get(processes, leak_check):
    with WorkerPool(failing_init, 2, processes=processes, name="Loader") as pool:
        pool.start()
        pool.put(1)
        with pytest.raises(RuntimeError, match="cannot open the dataset in worker [01]") as info:
            pool.get()
    assert "while starting" in "".join(getattr(info.value, "__notes__", [])) or info.value.__cause__


def test_a_worker_that_reported_its_error_and_exited_is_not_called_dead(leak_check):
    """A worker that cannot start (its control segment is gone: removed here while it was being spawned)
    sends why and exits with code 0. A task sent after it exited meets a closed pipe; the worker's message is
    still waiting to be read, and is what the consumer gets, not "worker 0 exited with code 0 without
    reporting an error". The task is sent only once the worker has gone: the order that lost the message."""
    with WorkerPool(context_init, 1, processes=True, name="Loader", start_method="spawn") as pool:
        pool.start()
        os.unlink(os.path.join(shm_mod.SHM_DIR, pool._channel.prefix + "ctl"))  # before the spawned worker opens it
        assert wait_for(lambda: pool.worker_processes[0].exitcode is not None)
        assert pool.worker_processes[0].exitcode == 0
        with pytest.raises(WorkerError, match="stopped: .*control segment .* vanished before the worker started"):
            pool.put(1)
            pool.get()


def test_timeout(leak_check):
    with WorkerPool(sleepy_init, 1, processes=True) as pool:
        pool.start()
        pool.put(120)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="0.3 s"):
            pool.get(timeout=0.3)
        assert time.monotonic() - t0 < PROMPTLY_S  # not the task's 120 s


@pytest.mark.parametrize("processes", [False, True])
def test_put_does_not_wait_for_a_busy_worker_and_close_drops_the_backlog(processes, leak_check):
    """2 MB of small tasks (each pickled into the pipe) for one worker that takes 0.2 s per task."""
    with WorkerPool(slow_echo_init, 1, processes=processes) as pool:
        pool.start()
        done = threading.Event()

        def put_all():
            for i in range(256):
                pool.put(bytes([i % 256]) * 8192)
            done.set()

        threading.Thread(target=put_all, daemon=True).start()
        if not done.wait(10):
            for pid in pool.pids:  # unblock the stuck put() before failing
                os.kill(pid, 9)
            pytest.fail("put() blocked on a busy worker")
        assert pool.get()[1] == bytes(8192)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < PROMPTLY_S  # the 255 tasks still queued are dropped, not run (51 s)


def test_discarded_tasks_never_come_back(leak_check):
    with WorkerPool(functools.partial(scale_init, 1), 2, processes=True, chunk_size=3) as pool:
        pool.start()
        for i in range(5):
            pool.put(i)
        pool.discard_outstanding()
        assert pool.outstanding == 0
        pool.put(100)
        assert pool.get()[1] == 100


def test_unordered_returns_everything(leak_check):
    with WorkerPool(functools.partial(scale_init, 2), 2, processes=True, ordered=False, chunk_size=2) as pool:
        pool.start()
        for i in range(9):
            pool.put(i)
        assert sorted(pool.get()[1] for _ in range(9)) == [2 * i for i in range(9)]


def test_unordered_results_waiting_from_every_worker_are_read_in_turns(leak_check):
    """With a message waiting from each worker, the pool reads them in turns: it read the first worker's first
    whenever it had one, so a worker that always had one kept the next one's results unread, and an unordered
    stage whose source never ran out (a carried one) never gave them (100 of every 1,000 datapoints, issue 39)."""
    with WorkerPool(context_init, 2, processes=True, ordered=False, chunk_size=1) as pool:
        pool.start()
        for _ in range(2):  # what results cost is learned from the first ones
            pool.put(None)
        assert sorted(pool.get()[0] for _ in range(2)) == [0, 1]
        for _ in range(12):
            pool.put(None)
        assert wait_for(lambda: pool._channel.unread(pool.results_received) >= 12)  # all twelve are waiting
        workers = [pool.get()[0] for _ in range(12)]
    assert sorted(workers) == [0] * 6 + [1] * 6
    assert set(workers[:4]) == {0, 1}, workers


def test_arrays_cross_through_shared_memory(leak_check):
    before = shm_entries()
    with WorkerPool(array_init, 2, processes=True) as pool:
        pool.start()
        for i in range(6):
            pool.put(i)
        out = [pool.get()[1] for _ in range(6)]
        during = shm_entries() - before
    assert any("_r0_" in name for name in during)  # result slabs exist while the pool runs
    for i, dp in enumerate(out):
        assert dp["a"].dtype == np.int32 and (dp["a"] == i).all() and dp["i"] == i
        assert dp["a"].flags.writeable
        assert list(dp["small"]) == [0, 1, 2]
    assert not (shm_entries() & during)  # and are gone after close()


def test_lifecycle_errors():
    pool = WorkerPool(context_init, 1, processes=False)
    with pytest.raises(BridgeflowError, match="not started"):
        pool.put(1)
    pool.start()
    pool.close()
    pool.close()
    with pytest.raises(BridgeflowError, match="closed"):
        pool.start()
    with pytest.raises(ValueError, match="chunk_size"):
        WorkerPool(context_init, 1, chunk_size=0)
    with pytest.raises(TypeError, match="init_fn"):
        WorkerPool(42, 1)


def test_dead_worker_is_named(leak_check):
    with WorkerPool(sleepy_init, 2, processes=True, name="Stage") as pool:
        pool.start()
        pool.put(10)
        os.kill(pool.pids[0], 9)
        with pytest.raises(WorkerError) as info:
            pool.get(timeout=10)
    err = info.value
    assert (err.stage, err.worker, err.exitcode) == ("Stage", 0, -9)
    assert f"pid {err.pid}" in str(err) and "SIGKILL" in str(err)


def test_unpicklable_init_under_spawn_names_the_culprit(leak_check):
    pool = WorkerPool(functools.partial(scale_init, lambda: 1), 1, processes=True, start_method="spawn")
    with pytest.raises(TypeError, match="lambda.*cannot be pickled.*spawn"):
        pool.start()
    pool.close()


# --- the transport, in one process ----------------------------------------------------------------

def _pair(max_slabs=4):
    ctl = mmap.mmap(-1, 4096)
    flags = memoryview(ctl)[:max_slabs]
    prefix = f"bftest{os.getpid()}_"
    return shm_mod.SlabWriter(prefix, flags, max_slabs), shm_mod.SlabReader(flags), flags, prefix


def test_slab_released_only_when_every_view_is_gone():
    writer, reader, flags, prefix = _pair()
    try:
        msg = writer.dumps([np.arange(50_000, dtype=np.int64), np.ones(40_000, np.uint8), "text"])
        assert flags[0] == shm_mod.IN_USE
        a, b, text = reader.loads(msg)
        assert text == "text" and a[-1] == 49_999 and b.sum() == 40_000
        view = a[10:20]
        del a, b
        assert flags[0] == shm_mod.IN_USE  # a view still points into the slab
        del view
        assert flags[0] == shm_mod.FREE
        writer.dumps([np.zeros(50_000)])
        assert len(writer.slabs) == 1  # the freed slab was reused
    finally:
        writer.close()
        shm_mod.sweep_segments(prefix)


def test_full_pool_of_slabs_falls_back_to_the_pipe():
    writer, reader, flags, prefix = _pair(max_slabs=2)
    try:
        held = [reader.loads(writer.dumps([np.full(60_000, i, np.uint8)])) for i in range(4)]
        assert [int(h[0][0]) for h in held] == [0, 1, 2, 3]  # slabs 0-1 in use, then in-band, still correct
        assert len(writer.slabs) == 2
    finally:
        writer.close()
        shm_mod.sweep_segments(prefix)


def test_arrays_built_in_place_are_not_copied():
    writer, reader, flags, prefix = _pair()
    try:
        writer.reserve(300_000)
        arr = writer.alloc((3, 50_000), np.int16)
        arr[...] = 5
        out = reader.loads(writer.dumps({"batch": arr}))
        assert out["batch"].shape == (3, 50_000) and (out["batch"] == 5).all()
        arr[0, 0] = 9  # the worker's array and the received one are the same memory: no copy was made
        assert out["batch"][0, 0] == 9
    finally:
        writer.close()
        shm_mod.sweep_segments(prefix)


def test_a_large_pickle_travels_in_its_slab_and_the_slab_is_free_once_read():
    """A batch of many small arrays (all pickled in-band) is a large pickle: it goes into a slab, the pipe
    carries a head of a few hundred bytes (a send never waits for the consumer), and the slab is free again
    as soon as the consumer has read the message, since no array of it lives on in shared memory."""
    writer, reader, flags, prefix = _pair()
    try:
        rng = np.random.default_rng(0)
        batch = [[rng.random(int(k), dtype=np.float32) for k in rng.integers(8, 257, 64)],
                 [rng.integers(0, 256, int(k), dtype=np.uint8) for k in rng.integers(100, 2001, 64)],
                 list(range(5_000))]
        assert len(pickle.dumps(batch, protocol=5)) > 64 * 1024  # more than a pipe holds
        msg = writer.dumps(batch)
        assert len(msg) < 512 and flags[0] == shm_mod.IN_USE
        out = reader.loads(msg)
        assert flags[0] == shm_mod.FREE  # read: nothing of the slab is kept
        assert pickle.dumps(out, protocol=5) == pickle.dumps(batch, protocol=5)
        assert all(a.flags.writeable for a in out[0] + out[1])
        out2 = reader.loads(writer.dumps([batch, np.arange(50_000)]))  # with a large array: held by it
        assert [flags[i] for i in range(len(writer.slabs))].count(shm_mod.IN_USE) == 1
        assert pickle.dumps(out2[0], protocol=5) == pickle.dumps(batch, protocol=5)
        del out2
        assert [flags[i] for i in range(len(writer.slabs))].count(shm_mod.IN_USE) == 0
    finally:
        writer.close()
        shm_mod.sweep_segments(prefix)


def test_a_message_without_a_slab_carries_its_pickle_and_buffers_in_the_pipe():
    writer, reader = shm_mod.SlabWriter("", None, 0), shm_mod.SlabReader(None)
    small = {"ids": list(range(3)), "x": np.arange(4)}
    big = [np.arange(50_000, dtype=np.int64), "text", [np.ones(3)] * 40_000]
    for obj in (small, big):
        out = reader.loads(writer.dumps(obj))
        assert pickle.dumps(out, protocol=5) == pickle.dumps(obj, protocol=5)
    with pytest.raises(ValueError, match="not a message"):
        reader.loads(pickle.dumps(small))


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling")


def test_reserved_slab_is_freed_when_the_message_cannot_be_pickled():
    writer, reader, flags, prefix = _pair(max_slabs=1)
    try:
        writer.reserve(300_000)
        arr = writer.alloc((100_000,), np.int16)
        with pytest.raises(TypeError, match="no pickling"):
            writer.dumps([arr, _Unpicklable()])
        assert flags[0] == shm_mod.FREE
        del arr
        out = reader.loads(writer.dumps([np.full(50_000, 3, np.int32)]))
        assert len(writer.slabs) == 1 and (out[0] == 3).all()  # the only slab is usable again
        assert flags[0] == shm_mod.IN_USE
    finally:
        writer.close()
        shm_mod.sweep_segments(prefix)


def test_context_is_frozen():
    ctx = WorkerContext(0, 1, 5, "x")
    with pytest.raises(AttributeError):
        ctx.worker_id = 3  # type: ignore[misc]


def test_segments_of_dead_processes_are_swept_by_the_next_pool(leak_check):
    """A consumer killed after its workers leaves segments nobody owns; the next pool removes them."""
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    stale = os.path.join(shm_mod.SHM_DIR, f"bf{dead}_0abcd_ctl")
    with open(stale, "wb") as f:
        f.write(b"x" * 10)
    with WorkerPool(array_init, 1, processes=True) as pool:
        pool.start()
    assert not os.path.exists(stale)


def test_a_receive_cut_short_fails_later_gets_instead_of_hanging(leak_check):
    with WorkerPool(functools.partial(scale_init, 10), 1) as pool:
        pool.start()
        pool._channel.readers[0] = InterruptAfterRead(pool._channel.readers[0])
        pool.put(1, flush=True)
        pool.put(2, flush=True)
        with pytest.raises(KeyboardInterrupt):
            pool.get()  # the result of task 0 was read, then lost
        assert pool.interrupted
        t0 = time.monotonic()
        with pytest.raises(BridgeflowError, match="interrupted while receiving"):
            pool.get(timeout=120)
        assert time.monotonic() - t0 < PROMPTLY_S  # at once, not after the 120 s timeout


def test_a_timeout_does_not_mark_the_pool_interrupted(leak_check):
    with WorkerPool(sleepy_init, 1) as pool:
        pool.start()
        pool.put(0.5, flush=True)
        with pytest.raises(TimeoutError):
            pool.get(timeout=0.05)
        assert not pool.interrupted
        assert pool.get(timeout=30) == (0, None)


def megabyte_init(ctx):
    return lambda i: np.full(1 << 20, i % 256, np.uint8)


def _slab_mappings() -> int:
    """Mappings of this process's pools' slabs (unlinked ones too) in this process."""
    prefix = f"/dev/shm/bf{os.getpid()}_"
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if prefix in line and "ctl" not in line)


def _slab_bytes() -> int:
    return sum(os.path.getsize(f"/dev/shm/{n}") for n in shm_entries() if not n.endswith("ctl"))


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_slabs_held_once_go_back_to_the_system_within_the_window(workers, leak_check):
    """The consumer holds 60 results of 1 MB, lets go, then streams: within about TRIM_WINDOW results
    the unused slabs are unlinked and unmapped, and /dev/shm usage drops."""
    held_n = 60
    with WorkerPool(megabyte_init, workers) as pool:
        pool.start()
        held = []
        for i in range(held_n):
            pool.put(i, flush=True)
            held.append(pool.get()[1])
        assert [int(a[0]) for a in held] == list(range(held_n))
        assert _slab_bytes() >= held_n << 20 and _slab_mappings() >= held_n
        del held
        returned_after = None
        for i in range(4 * shm_mod.TRIM_WINDOW):  # then it streams, holding one result at a time
            pool.put(i, flush=True)
            assert int(pool.get()[1][0]) == i % 256
            if _slab_bytes() <= 8 * workers << 20 and _slab_mappings() <= 4 * workers:
                returned_after = i + 1
                break
        assert returned_after is not None, "unused slabs were not unlinked and unmapped"
        per_worker = max(shm_mod.MIN_TRIM_WINDOW, shm_mod.TRIM_WINDOW // workers)
        assert returned_after <= per_worker * workers + 2 * workers, returned_after
        assert sum(r.mapped for r in pool._channel.readers) <= 4 * workers


LATE = """
import sys
import bridgeflow as bf
from bridgeflow.parallel import MultiProcessMapData

def one(x):
    return [x]

if __name__ == "__main__":
    for _ in range(int(sys.argv[2])):  # 4 datapoints: worker 0's chunk; worker 1 may start after the close
        with MultiProcessMapData(bf.DataFromList(list(range(4)), shuffle=False), 2, one,
                                 start_method=sys.argv[1]) as df:
            df.reset_state()
            assert [dp[0] for dp in df] == [0, 1, 2, 3]
    print("ok")
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_worker_starting_after_a_clean_run_ends_says_nothing(tmp_path, method):
    """A spawned worker that finishes starting after the pool closed finds its segments gone and its
    consumer's pipe closed: it exits quietly (it printed FileNotFoundError and BrokenPipeError tracebacks
    in about 1 run in 3)."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(LATE)
    proc = subprocess.run([sys.executable, str(script), method, "6"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


def test_a_worker_whose_pool_is_gone_exits_quietly():
    """process_main itself, in a real process: its control segment removed and its consumer's pipe closed."""
    import multiprocessing as mp

    from bridgeflow.parallel._transport.worker import process_main

    ctx = mp.get_context("fork")
    task_r, task_w = ctx.Pipe(duplex=False)
    result_r, result_w = ctx.Pipe(duplex=False)
    result_r.close()  # the consumer closed the pool
    proc = ctx.Process(target=process_main, args=(WorkerContext(1, 2, 0, "T"), context_init, task_r, result_w,
                                                  "bfgone_0000_ctl", "bfgone_0000_", os.getpid()))
    proc.start()
    proc.join(30)
    task_w.close()
    assert proc.exitcode == 0


# --- processes a task starts: a forked child's exit is its own, and nothing outlives the pool ---------

def _ps(pids) -> str:
    """``ps`` of ``pids`` (for an assertion's message)."""
    import subprocess

    if not pids:
        return "(none)"
    return subprocess.run(["ps", "-o", "pid,ppid,pgid,stat,etime,args", "-p", ",".join(map(str, pids))],
                          capture_output=True, text=True).stdout


def forking_init(how, ctx):
    """A task that forks a child which ends as ``how`` says, waits for it and returns its exit code."""
    import signal
    import sys

    def run(x):
        pid = os.fork()
        if pid == 0:  # the child: never waits for anything here, whatever the worker loop does after
            if how == "exit0":
                sys.exit(0)
            if how == "exit3":
                sys.exit(3)
            if how == "raise":
                raise RuntimeError("the child fails")
            return x  # "return": the child comes back to the worker loop
        deadline = time.monotonic() + PROMPTLY_S
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return x, os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)  # it stayed in the worker loop: the bug this test is about
        os.waitpid(pid, 0)
        return x, "stayed"

    return run


@pytest.mark.parametrize("processes", [True, False])
@pytest.mark.parametrize("how, code", [("exit0", 0), ("exit3", 3), ("raise", 1), ("return", 0)])
def test_a_child_forked_by_a_task_ends_as_its_own_process_not_a_worker_error(processes, how, code, leak_check):
    """``sys.exit(0)`` in a child that a map function forks (as code written for a main process ends one)
    was "SystemExit in worker 0", and the child then waited for tasks forever, holding the caller's stdout.
    The child is not the worker: it leaves with its own exit code at once, whatever way it comes back."""
    with WorkerPool(functools.partial(forking_init, how), 2, processes=processes, start_method="fork") as pool:
        pool.start()
        for i in range(4):
            pool.put(i)
        assert [pool.get(timeout=2 * PROMPTLY_S)[1] for _ in range(4)] == [(i, code) for i in range(4)]


def sleeper_init(ctx):
    """A task that starts a process left running (``sleep``) and one orphaned at once (a double fork),
    and returns their pids."""
    import subprocess

    def run(x):
        kept = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL)
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:
            grandchild = os.fork()
            if grandchild == 0:
                os.close(r)
                os.write(w, f"{os.getpid()}\n".encode())
                time.sleep(600)
            os._exit(0)  # the grandchild is an orphan now
        os.close(w)
        orphan = int(os.read(r, 64))
        os.close(r)
        os.waitpid(middle, 0)
        return kept.pid, orphan

    return run


def test_processes_that_tasks_start_end_when_the_pool_closes(leak_check):
    """Each worker leads a process group of its own; ``close()`` ends what is left in it: a process a task
    started and left running, and one orphaned at once (reparented away from the worker)."""
    with WorkerPool(sleeper_init, 2, start_method="fork") as pool:
        pool.start()
        for i in range(4):
            pool.put(i)
        pids = [p for _ in range(4) for p in pool.get(timeout=PROMPTLY_S)[1]]
        assert all(alive(p) for p in pids), _ps(pids)
        before = _ps(pids)
        workers = pool.pids
        assert all(os.getpgid(p) in workers for p in pids), before  # in the workers' groups, not pytest's
    assert wait_for(lambda: not any(alive(p) for p in pids)), f"before close():\n{before}after:\n{_ps(pids)}"


_STDOUT_SCRIPT = """
import os, subprocess, sys, time
import bridgeflow as bf

def task(x):
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a child written like a main program, never waited for
    if x < 2:
        p = subprocess.Popen(["sleep", "600"])  # a process left running
        with open(sys.argv[1], "a") as f:
            f.write(f"{p.pid} {pid}\\n")
    return [x]

if __name__ == "__main__":
    with bf.MultiProcessMapData(bf.DataFromList(list(range(8)), shuffle=False), 2, task) as df:
        df.reset_state()
        print("got", sorted(dp[0] for dp in df), flush=True)
"""


def test_a_caller_reading_the_consumers_stdout_is_not_held_by_what_tasks_started(tmp_path):
    """A caller waits for the end of the consumer's stdout (``subprocess.run(..., stdout=PIPE)``): what
    the map function forked or started inherits that pipe, so it ends when the consumer does only if
    nothing outlives the flow."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "consumer.py"
    script.write_text(_STDOUT_SCRIPT)
    pids_file = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, str(script), str(pids_file)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=2 * PROMPTLY_S)
    except subprocess.TimeoutExpired:
        out, err = "", "the caller's read did not end"
    finally:
        pids = [int(p) for p in pids_file.read_text().split()] if pids_file.exists() else []
        left = [p for p in pids if alive(p)]
        report = _ps(left)
        for p in left:  # what the bug leaves, so that it does not outlive the test either
            os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert out.strip() == f"got {list(range(8))}", err[-2000:]
    assert proc.returncode == 0 and "SystemExit" not in err, err[-2000:]
    assert len(pids) >= 4 and not left, report  # (workers read ahead into the next epoch: more tasks ran)


def batch_faults_init(ctx):
    """The page faults of one round of a batch's worth of 150 KB arrays, written and freed together, as a
    worker reading 64 samples of its own memory each frees them after the batch."""
    import resource

    def one_round(_):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [np.ones(150_000, np.uint8) for _ in range(64)]
        del held
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    return one_round


def test_a_worker_keeps_a_freed_batch_for_the_next(leak_check, monkeypatch):
    """glibc hands a batch's memory, freed at once, back to the system and faults it in again for the next batch
    (2,300 faults a round of 64 x 150 KB) until a process has run a while; a worker starts tuned (a fresh
    spawned interpreter: nothing it inherits could have tuned it), and the user's MALLOC_* settings stand."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    if not libc.startswith("glibc"):
        pytest.skip("the C library is not glibc: its malloc has no such thresholds")
    for env, tuned in ((None, True), ("131072", False)):
        if env is not None:
            monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", env)
        with WorkerPool(batch_faults_init, 1, processes=True, start_method="spawn") as pool:
            pool.start()
            for _ in range(4):
                pool.put(None)
            faults = [pool.get()[1] for _ in range(4)]
        assert faults[0] > 64 * 30, faults  # the first round faults its pages in, tuned or not
        if tuned:
            assert max(faults[1:]) < 64, faults  # then the freed memory is reused
        else:
            assert min(faults[1:]) > 64 * 30, faults  # glibc as the user set it
