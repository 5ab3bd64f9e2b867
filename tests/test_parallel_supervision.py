"""Supervised restarts of a WorkerPool's process workers (``max_restarts``): a dead worker is replaced and its
tasks run again, exactly; a task that kills every worker it meets is named, or skipped; past the budget, the
error carries the restarts' history. Workers die of real signals here: SIGKILL, SIGSEGV (ctypes), the OOM
killer of a memory cgroup."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest
from deaths import die, kill_child, once

from bridgeflow._errors import WorkerError
from bridgeflow.parallel import WorkerPool
from bridgeflow.parallel._transport import shm
from bridgeflow.parallel._transport.supervision import FaultPolicy
from conftest import PROMPTLY_S, ROOT, shm_entries, wait_for


def killing_init(flag, victim, ctx):
    """``x * 10``, with the worker that meets ``victim`` killed by SIGKILL, the first time only; each result
    says which worker (id, seed, pid) made it."""
    def run(x):
        if x == victim and once(flag):
            os.kill(os.getpid(), signal.SIGKILL)
        return x * 10, ctx.worker_id, ctx.seed, os.getpid()
    return run


def poison_init(victim, how, tally, ctx):
    def run(x):
        if x == victim:
            die(how, tally)
        return x
    return run


class Skipping(FaultPolicy):
    skip = True

    def describe(self, task_id, payload, item):
        return f"the number {payload}"

    def skipped(self, task_id, payload, why):
        return ("skipped", payload, why)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("chunk", [1, 4])
def test_a_killed_worker_is_replaced_by_one_with_its_id_and_seed_and_the_results_are_the_undisturbed_ones(
        tmp_path, ordered, chunk, leak_check):
    init = functools.partial(killing_init, str(tmp_path / "once"), 13)
    with WorkerPool(init, 2, base_seed=100, ordered=ordered, chunk_size=chunk, max_restarts=1, name="Stage") as pool:
        pool.start()
        first = list(pool.pids)
        ids = [pool.put(i) for i in range(40)]
        got = [pool.get()[1] for _ in ids]
        assert pool.restarts == 1 and pool.alive()
        assert len(set(pool.pids) - set(first)) == 1  # one new process
    values = [v for v, _, _, _ in got]
    assert (values if ordered else sorted(values)) == [10 * i for i in range(40)]
    assert {(w, seed) for _, w, seed, _ in got} == {(0, 100), (1, 100 + 1)}  # same ids, same seeds
    assert len({pid for _, _, _, pid in got}) == 3


def test_past_the_budget_the_death_is_raised_with_the_history_of_the_restarts(tmp_path, leak_check):
    def init(ctx):
        def run(x):
            if x in (5, 9) and once(str(tmp_path / f"kill{x}")):
                os.kill(os.getpid(), signal.SIGKILL)
            return x
        return run

    with WorkerPool(init, 2, max_restarts=1, name="Stage") as pool:
        pool.start()
        ids = [pool.put(i) for i in range(20)]
        with pytest.raises(WorkerError) as info:
            for _ in ids:
                pool.get()
    err = info.value
    assert err.exitcode == -signal.SIGKILL and err.stage == "Stage"
    assert "killed by SIGKILL" in str(err) and "after 1 restart of max_restarts=1: worker 1 (pid " in str(err)


def test_without_a_budget_a_death_is_the_error_it_always_was(tmp_path, leak_check):
    with WorkerPool(functools.partial(poison_init, 3, "kill", str(tmp_path / "tally")), 2, name="Stage") as pool:
        pool.start()
        ids = [pool.put(i) for i in range(6)]
        with pytest.raises(WorkerError, match=r"worker 1 \(pid \d+\) of Stage was killed by SIGKILL") as info:
            for _ in ids:
                pool.get()
    assert "restart" not in str(info.value)


@pytest.mark.parametrize("how", ["segv", "kill"])
@pytest.mark.parametrize("chunk", [1, 4])
def test_a_task_that_kills_every_worker_it_meets_is_named_after_two_deaths_running_alone(how, chunk, tmp_path,
                                                                                         leak_check):
    init = functools.partial(poison_init, 6, how, str(tmp_path / "tally"))
    with WorkerPool(init, 2, chunk_size=chunk, max_restarts=5, name="Stage") as pool:
        pool.start()
        ids = [pool.put(i) for i in range(16)]
        with pytest.raises(WorkerError) as info:
            for _ in ids:
                pool.get()
        # a chunk of several tasks: its first death names none of them, and they run again one a message
        assert pool.restarts in ((1, 2) if chunk == 1 else (2,))  # tasks held back by the byte budget may go together
    signame = "SIGSEGV" if how == "segv" else "SIGKILL"
    assert "task #6: it killed 2 worker processes in turn (worker 0 (pid" in str(info.value)
    assert str(info.value).count(f"killed by {signame}") >= 2 and "is not run again" in str(info.value)


def test_a_poison_task_is_answered_as_skipped_under_a_skip_policy(tmp_path, leak_check):
    init = functools.partial(poison_init, 6, "segv", str(tmp_path / "tally"))
    with WorkerPool(init, 2, chunk_size=4, max_restarts=5, fault_policy=Skipping(), name="Stage") as pool:
        pool.start()
        ids = [pool.put(i) for i in range(16)]
        got = [pool.get()[1] for _ in ids]
        assert pool.restarts in (2, 3)  # a chunk's death (if it went in one), then two of the task alone
    assert got[:6] == list(range(6)) and got[7:] == list(range(7, 16))
    assert got[6][:2] == ("skipped", 6) and "killed 2 worker processes in turn" in got[6][2]


def test_a_worker_killed_before_it_started_the_task_does_not_count_against_that_task(tmp_path, leak_check):
    """Task 3 kills its worker (once); the worker replacing it is killed while it starts, before it reads the
    task again: a second death, but not one of task 3, which two deaths would have made a poison task."""
    pids = tmp_path / "starting"

    def init(ctx):
        if ctx.worker_id == 1 and os.path.exists(tmp_path / "kill3") and once(str(tmp_path / "stall")):
            pids.write_text(str(os.getpid()))
            threading.Event().wait(PROMPTLY_S)  # killed here, while starting
        def run(x):
            if x == 3 and once(str(tmp_path / "kill3")):
                os.kill(os.getpid(), signal.SIGKILL)
            return x
        return run

    def killer():
        assert wait_for(pids.exists)
        assert kill_child(int(pids.read_text()))

    thread = threading.Thread(target=killer)
    thread.start()
    with WorkerPool(init, 2, max_restarts=3, name="Stage") as pool:
        pool.start()
        ids = [pool.put(i) for i in range(8)]
        got = [pool.get()[1] for _ in ids]
        assert pool.restarts == 2
    thread.join()
    assert got == list(range(8))


def big_result_init(ctx):
    """Results of 2 MiB of bytes: without shared memory, pickled into the message, through the pipe, far more
    than the pipe holds."""
    return lambda x: (x, bytes([x]) * (2 << 20))


def _writing(pid: int) -> bool:
    """Whether ``pid``'s main thread is in the write system call (1 on x86-64): blocked on a full pipe."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0] == "1"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads the x86-64 number of write() in /proc")
def test_a_message_cut_short_by_the_death_is_dropped_and_its_task_runs_again(monkeypatch, leak_check):
    """Messages travel whole through the pipe when no shared memory can be had (with it, the pipe carries a
    head of a few hundred bytes, which a write puts in the pipe at once or not at all)."""
    monkeypatch.setattr(shm, "shm_available", lambda: False)
    with WorkerPool(big_result_init, 2, max_restarts=1, name="Stage") as pool:
        pool.start()
        ids = [pool.put(i) for i in range(6)]
        victim = pool.pids[1]
        assert wait_for(lambda: _writing(victim))  # half of its first message is in the pipe, half to come
        assert kill_child(victim)
        got = [pool.get()[1] for _ in ids]
        assert pool.restarts == 1
    assert [x for x, _ in got] == list(range(6))
    assert all(data == bytes([x]) * (2 << 20) for x, data in got)


def slab_init(flag, ctx):
    def run(x):
        if x == 9 and once(flag):
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full(100_000, x, np.int64)  # 800 KB: each result in a slab of its worker
    return run


def test_arrays_held_from_a_dead_worker_stay_valid_and_its_slabs_are_unlinked(tmp_path, leak_check):
    with WorkerPool(functools.partial(slab_init, str(tmp_path / "once")), 2, max_restarts=1, name="Stage") as pool:
        pool.start()
        held = []
        for i in range(9):  # the dead worker's results are held (worker 1 made the odd ones)
            pool.put(i)
            held.append(pool.get()[1])
        mine = {n for n in shm_entries() if n.startswith(pool._channel.prefix + "r1_")}
        assert mine  # worker 1's result slabs, the consumer holding arrays of them
        ids = [pool.put(i) for i in range(9, 40)]
        held += [pool.get()[1] for _ in ids]  # the new worker 1 writes while the old slabs are held
        assert pool.restarts == 1
        assert not mine & shm_entries()  # the dead worker's slabs are unlinked...
        assert all((a == i).all() for i, a in enumerate(held))  # ...and every array still reads its values


def test_a_restarted_worker_goes_on_with_the_counters_of_the_dead_one(tmp_path, leak_check):
    def init(ctx):
        def run(x):
            if x == 20 and once(str(tmp_path / "once")):
                os.kill(os.getpid(), signal.SIGKILL)
            end = __import__("time").perf_counter() + 0.002
            while __import__("time").perf_counter() < end:
                pass
            return x
        return run

    with WorkerPool(init, 2, max_restarts=1) as pool:
        pool.start()
        ids = [pool.put(i) for i in range(10)]
        [pool.get() for _ in ids]
        busy = pool.busy_seconds()
        ids = [pool.put(i) for i in range(10, 40)]
        [pool.get() for _ in ids]
        assert pool.restarts == 1
        assert pool.busy_seconds() > busy  # not started from zero by the new worker
        assert pool._channel.unread(pool.results_received) == 0


def test_thread_workers_take_max_restarts_and_are_not_supervised(leak_check):
    with WorkerPool(lambda ctx: (lambda x: x + 1), 2, processes=False, max_restarts=3) as pool:
        pool.start()
        ids = [pool.put(i) for i in range(10)]
        assert [pool.get()[1] for _ in ids] == list(range(1, 11))
        assert pool.restarts == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_max_restarts_is_a_count(bad):
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
        WorkerPool(lambda ctx: None, 1, max_restarts=bad)


def test_a_spawned_worker_is_replaced_too(tmp_path, leak_check):
    init = functools.partial(killing_init, str(tmp_path / "once"), 3)
    with WorkerPool(init, 2, start_method="spawn", max_restarts=1) as pool:
        pool.start()
        ids = [pool.put(i) for i in range(8)]
        assert [pool.get()[1][0] for _ in ids] == [10 * i for i in range(8)]
        assert pool.restarts == 1


# --- the OOM killer, in a memory cgroup -------------------------------------------------------------

OOM_SCRIPT = textwrap.dedent("""
    import os, sys
    cgroup, flag = sys.argv[1], sys.argv[2]
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:  # this process and its workers, under the limit
        f.write(str(os.getpid()))
    import numpy as np
    import bridgeflow as bf

    def grow(dp):
        if dp[0] == 7 and not os.path.exists(flag):
            open(flag, "w").close()
            block = np.ones(1 << 30, np.uint8)  # 1 GiB in a 256 MiB cgroup: the OOM killer ends this worker
            return [block[:10]]
        return [np.full(10, dp[0])]

    df = bf.MultiProcessMapData(bf.DataFromList([[i] for i in range(30)], shuffle=False), 2, grow, buffer_size=8,
                                strict=True, max_restarts=1)
    with df:
        out = [int(dp[0][0]) for dp in df]
        print(out == list(range(30)), df.stats()["MultiProcessMapData"]["restarts"])
""")


def _memory_cgroup(tmp_name: str, limit: int) -> str | None:
    """A new memory cgroup limited to ``limit`` bytes (cgroup v1, or v2 at the root), or None when none can
    be made here (not root, no memory controller, a read-only /sys/fs/cgroup)."""
    for parent, limit_file in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
        path = os.path.join(parent, tmp_name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            os.rmdir(path)
    return None


def test_a_worker_the_oom_killer_ends_under_a_memory_cgroup_is_replaced_and_the_epoch_completes(tmp_path):
    cgroup = _memory_cgroup(f"bf_test_{uuid.uuid4().hex[:8]}", 256 << 20)
    if cgroup is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable memory controller)")
    try:
        proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT, cgroup, str(tmp_path / "once")], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    finally:
        assert wait_for(lambda: not open(os.path.join(cgroup, "cgroup.procs")).read().strip())
        os.rmdir(cgroup)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "1"], proc.stderr
    assert "killed by SIGKILL from the OOM killer" in proc.stderr, proc.stderr  # its cgroup's count went up
    assert "restarting it (restart 1 of max_restarts=1)" in proc.stderr

