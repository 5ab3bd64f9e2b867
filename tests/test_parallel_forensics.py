"""Stalled workers: a stall warning that says which worker, in what state and where; ``timeout=`` on
every parallel stage."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import bridgeflow as bf
from bridgeflow._errors import WorkerError, WorkerTimeoutError
from bridgeflow.parallel import (
    MultiProcessMapData,
    MultiProcessRunner,
    MultiThreadMapData,
    MultiThreadRunner,
    WorkerPool,
)
from bridgeflow.parallel._transport import forensics
from conftest import PROMPTLY_S, wait_for

MAP_STAGES = [MultiProcessMapData, MultiThreadMapData]


def waits_for_a_lock_that_never_comes(i):
    if i == 3:
        time.sleep(2.0)  # a deadlock in user code, a stuck read: here, for two seconds
    return [i]


def identity(i):
    return [i]


def source(n=20):
    return bf.DataFromList(list(range(n)), shuffle=False)


def stall_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "no result for" in r.getMessage()]


@pytest.mark.parametrize("cls", MAP_STAGES)
def test_a_stall_is_logged_with_the_workers_stack_and_the_wait_goes_on(cls, leak_check, caplog):
    with caplog.at_level(logging.WARNING, logger="bridgeflow.parallel._transport.pool"):
        with cls(source(), 2, waits_for_a_lock_that_never_comes, stall_warning=0.5) as df:
            df.reset_state()
            assert [dp[0] for dp in df] == list(range(20))  # no timeout: it waits, and nothing is lost
    # the warnings about #3 (a warning about a worker still starting, on a busy machine, may come before them)
    logs = [line for line in stall_records(caplog) if "in waits_for_a_lock_that_never_comes" in line]
    assert logs, f"no stall warning names the function: {stall_records(caplog)}"
    first = logs[0]
    assert first.startswith(f"{cls.__name__}: no result for ")
    # #3 holds up the epoch: alone, or in a chunk with #0 (the first tasks go one a worker until a result
    # says what results cost, then in chunks)
    assert "holds the oldest task (#3)" in first or "holds the oldest task (#0)" in first, first
    if cls is MultiProcessMapData:
        assert "(pid " in first and "is sleeping" in first
    else:
        assert "(a thread)" in first
    assert len(logs) <= 3  # at 0.5, 1 and 2 s: the warnings thin out as the wait goes on


SLOW_MAIN = textwrap.dedent("""
    import logging, os, sys, time
    if __name__ != "__main__":  # a spawned worker re-imports this module: heavy imports on a busy machine
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 4.0)
    import bridgeflow as bf
    from bridgeflow.parallel import MultiProcessMapData

    def double(x):
        return [2 * x]

    if __name__ == "__main__":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        df = MultiProcessMapData(bf.DataFromList(list(range(30)), shuffle=False), 2, double,
                                 start_method=sys.argv[1], stall_warning=0.3)
        with df:
            df.reset_state()
            print("result", sorted(dp[0] for dp in df), flush=True)
""")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_worker_still_starting_is_never_signalled_but_reported_as_starting(tmp_path, method):
    """A spawned worker has no handler for SIGUSR1 until bridgeflow's code runs in it: before, the signal
    that asks for its stack would kill it. It is reported as starting instead, and the run completes."""
    script = tmp_path / "slow_main.py"
    script.write_text(SLOW_MAIN)
    proc = subprocess.run([sys.executable, str(script), method, "4"], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"result {list(range(0, 60, 2))}" in proc.stdout
    assert "killed by SIGUSR1" not in proc.stderr
    stalls = [line for line in proc.stderr.splitlines() if "no result for" in line]
    assert stalls, proc.stderr[-3000:]
    assert "is starting (for " in stalls[0] and "imports your main module" in stalls[0], stalls[0]


def test_dump_pipe_says_ready_only_after_the_handler(tmp_path):
    r, w = os.pipe()
    dump = forensics.DumpPipe(r)
    try:
        assert not dump.is_ready() and dump.starting().startswith("starting (for 0 s")
        pid = os.fork()
        if pid == 0:
            try:
                forensics.install_stack_dumps(w)
                time.sleep(PROMPTLY_S)  # alive until killed below, however late the parent asks for its stack
            finally:
                os._exit(0)
        try:
            assert wait_for(dump.is_ready)
            state, stack = forensics.describe_worker(pid, dump, wait=10.0)
            assert "in test_dump_pipe_says_ready_only_after_the_handler" in stack, (state, stack)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        os.close(r)
        os.close(w)


def test_a_stopped_worker_is_reported_as_such_then_times_out(leak_check, caplog):
    """SIGSTOP (or a debugger) freezes a worker: it cannot dump its stack, and the warning says why; the
    stage's timeout then raises an error naming it, and closing the stage kills it."""
    with caplog.at_level(logging.WARNING, logger="bridgeflow.parallel._transport.pool"):
        # the timeout bounds every wait, the first one's worker start-up too: 2.5 s, which a busy machine's
        # fork does not reach
        df = MultiProcessMapData(source(10**6), 2, identity, stall_warning=0.3, timeout=2.5)
        df.reset_state()
        it = iter(df)
        next(it)
        pid = df._pool.pids[1]
        os.kill(pid, signal.SIGSTOP)
        caplog.clear()  # warnings from before the stop (a worker slow to start) are not about it
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            for _ in range(10**6):
                next(it)
        waited = time.monotonic() - t0
        del it
        df.close()
    assert 2.4 < waited < PROMPTLY_S  # the timeout, not a hang (the upper bound a busy machine cannot break)
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, WorkerError)
    assert (err.stage, err.worker, err.pid) == ("MultiProcessMapData", 1, pid)
    assert f"worker 1 (pid {pid}) of MultiProcessMapData has not returned task #" in str(err)
    assert "after 2.5 s (timeout); it is stopped (SIGSTOP?)" in str(err)
    # worker 0 may hold the oldest task for a moment too on a busy machine: the warnings about worker 1
    logs = [line for line in stall_records(caplog) if f"worker 1 (pid {pid}) holds the oldest task" in line]
    assert logs, stall_records(caplog)
    assert "is stopped (SIGSTOP?). A process in this state cannot dump its stack." in logs[0]


class Sleepy(bf.DataFlow):
    """Its first pass takes 1.5 s to yield anything; later passes are quick."""

    def __init__(self):
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        if self.passes == 1:
            time.sleep(1.5)
        yield [0]


def sleepy_flow():
    return Sleepy()


@pytest.mark.parametrize("make", [
    lambda: MultiProcessMapData(source(), 2, waits_for_a_lock_that_never_comes, timeout=0.5),
    lambda: MultiThreadMapData(source(), 2, waits_for_a_lock_that_never_comes, timeout=0.5),
    lambda: MultiProcessRunner(sleepy_flow(), num_proc=1, timeout=0.5),
    lambda: MultiThreadRunner(sleepy_flow, num_thread=1, timeout=0.5),
], ids=["MultiProcessMapData", "MultiThreadMapData", "MultiProcessRunner", "MultiThreadRunner"])
def test_every_parallel_stage_takes_a_timeout(make, leak_check):
    df = make()
    name = type(df).__name__
    df.reset_state()
    pattern = rf"worker \d .*of {name} has not returned task #\d+ after 0.5 s"
    with pytest.raises(WorkerTimeoutError, match=pattern) as info:
        list(df)  # raised while the task is stuck: had it waited 2 s for it, list() would have ended
    assert info.value.stage == name
    if "Thread" in name:  # a thread cannot be stopped: wait for it before closing
        time.sleep(1.6)
    df.close()


def nap(seconds):
    time.sleep(seconds)
    return seconds


def nap_init(ctx):
    return nap


def test_after_a_timeout_nothing_is_lost(leak_check):
    """Task #1 naps 3 s: the 2 s timeout fires while it naps, and the next wait (2 s more) sees it done. Task #0
    first, so that the worker has started: a timeout while it still starts would say so instead."""
    with WorkerPool(nap_init, 1, timeout=2.0, stall_warning=None) as pool:
        pool.start()
        pool.put(0.0, flush=True)
        assert pool.get()[1] == 0.0
        pool.put(3.0, flush=True)
        pool.put(0.0, flush=True)
        with pytest.raises(WorkerTimeoutError, match=r"task #1 after 2 s \(timeout\); it is sleeping, in nap \("):
            pool.get()
        assert not pool.interrupted
        assert [pool.get()[1], pool.get()[1]] == [3.0, 0.0]  # the same pool, when the worker is done


def test_timeouts_are_validated():
    for bad in (-1, "1", True):
        with pytest.raises(ValueError, match="MultiProcessMapData: timeout must be a positive number"):
            MultiProcessMapData(source(), 2, identity, timeout=bad)
        with pytest.raises(ValueError, match="MultiThreadRunner: stall_warning must be a positive number"):
            MultiThreadRunner(sleepy_flow, num_thread=1, stall_warning=bad)
    df = MultiProcessMapData(source(), 2, identity, timeout=0, stall_warning=None)  # torch's 0: no timeout
    assert df.timeout is None and df.stall_warning is None


def test_process_state_reads_proc():
    assert forensics.process_state(os.getpid()) == "running"
    assert forensics.process_state(2**22 + 12345) == "gone"
