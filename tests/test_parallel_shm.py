"""The shared-memory transport under pressure: few file descriptors, a /dev/shm shared with other pid
namespaces (containers), segments removed by someone else."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from bridgeflow._errors import WorkerError
from bridgeflow.parallel import WorkerPool
from bridgeflow.parallel._transport import segments
from bridgeflow.parallel._transport import shm as shm_mod
from conftest import PROMPTLY_S, shm_entries, wait_for

FORK = mp.get_context("fork")


def quarter_mb_init(ctx):
    return lambda i: np.full(1 << 18, i % 251, np.uint8)


# --- descriptors ------------------------------------------------------------------------------------

_FD_SCRIPT = textwrap.dedent("""
    import json, logging, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import numpy as np
    from bridgeflow.parallel import WorkerPool

    def fds(pid="self"):
        return len(os.listdir(f"/proc/{{pid}}/fd"))

    def hog_then_arrays(ctx):
        hogged = []
        if {hog}:  # the worker itself is at its limit: slabs cannot be created
            try:
                while True:
                    hogged.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
        return lambda i: np.full(1 << 18 if i >= 0 else 1, i % 251, np.uint8)

    with WorkerPool(hog_then_arrays, 2) as pool:
        pool.start()
        for w in range(2):  # both workers started and sent one (small) result
            pool.put(-1, worker=w, flush=True)
            pool.get()
        fds0, workers0 = fds(), [fds(p) for p in pool.pids]
        held = []
        for i in range({hold}):
            pool.put(i, flush=True)
            held.append(pool.get()[1])
        with open("/proc/self/maps") as f:
            slabs = sum(f"/dev/shm/bf{{os.getpid()}}_" in line and "ctl" not in line for line in f)
        out = {{"fds": [fds0, fds()], "worker_fds": [workers0, [fds(p) for p in pool.pids]], "slabs": slabs,
                "intact": all(a.nbytes == 1 << 18 and (a == i % 251).all() for i, a in enumerate(held))}}
    print(json.dumps(out))
""")


def _run_fd_script(limit: int, hold: int, hog: bool = False) -> tuple[dict, str]:
    script = _FD_SCRIPT.format(limit=limit, hold=hold, hog=hog)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_holding_many_results_under_a_low_fd_limit_holds_no_descriptor_per_slab(leak_check):
    """ulimit -n 64 (soft and hard), 300 results of 256 KB held: 256 slabs mapped at once (128 per worker,
    the rest in-band), and not one descriptor more in the consumer or the workers. The consumer used to
    keep a descriptor per mapped slab and failed with EMFILE after about 50 results."""
    got, err = _run_fd_script(limit=64, hold=300)
    assert got["intact"], err
    assert got["slabs"] >= 250
    fds0, fds1 = got["fds"]
    assert fds1 <= fds0 + 2, got
    for before, after in zip(*got["worker_fds"]):
        assert after <= before + 2, got
    assert "Too many open files" not in err


def test_a_worker_at_its_fd_limit_falls_back_to_the_pipe_saying_so(leak_check):
    got, err = _run_fd_script(limit=64, hold=20, hog=True)
    assert got["intact"], err
    assert got["slabs"] == 0  # every result came through the pipe
    assert err.count("limit of open files (ulimit -n 64 (hard limit 64))") == 2, err  # once per worker
    assert "results travel through the pipe instead" in err


def test_the_soft_fd_limit_is_raised_to_the_hard_one_at_pool_start(leak_check):
    script = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 256))
        from bridgeflow.parallel import WorkerPool
        with WorkerPool(lambda ctx: (lambda x: x), 1) as pool:
            pool.start()
            pool.put(1)
            pool.get()
        print(resource.getrlimit(resource.RLIMIT_NOFILE))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(256, 256)"


# --- ownership across pid namespaces --------------------------------------------------------------

def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _hold_control(name: str, ready, release) -> None:
    ctl = shm_mod.ControlSegment.create(name, 64)
    ready.set()
    release.wait(60)
    ctl.close()


def test_a_sweep_spares_segments_whose_owner_holds_the_lock_whatever_its_pid(leak_check, monkeypatch):
    """A pool in another container has a pid that does not exist here: only its lock says it is alive.
    While the lock is held, no sweep (nor pool start) here removes its segments; once its holder is gone
    the next sweep does. (What this process's sweeps unlink is recorded, so that sweepers of older
    versions in other processes sharing this /dev/shm, which go by the pid, cannot blur the result.)"""
    dead = _dead_pid()
    prefix = f"bf{dead}_7{os.urandom(2).hex()}_"
    slab = shm_mod.SHM_DIR + f"/{prefix}r0_0_abcdef"
    unlinked: list[str] = []
    unlink = segments.unlink_segment
    monkeypatch.setattr(segments, "unlink_segment", lambda name: (unlinked.append(name), unlink(name)))
    ready, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold_control, args=(prefix + "ctl", ready, release), daemon=True)
    holder.start()
    try:
        assert ready.wait(PROMPTLY_S)
        with open(slab, "wb") as f:
            f.write(b"x" * 4096)
        with pytest.raises(ProcessLookupError):
            os.kill(dead, 0)  # what the sweep used to rely on
        assert segments._owner_state(prefix + "ctl") == "alive"
        for _ in range(3):
            shm_mod.sweep_orphans()
        with WorkerPool(quarter_mb_init, 1) as pool:  # a start sweeps too
            pool.start()
        assert not [n for n in unlinked if n.startswith(prefix)]
        release.set()
        holder.join(PROMPTLY_S)
        # Released, the segments are fair game: a sweep in another process sharing /dev/shm (another test
        # process) may remove them before ours does ("gone"), or remove some while ours removes the others.
        assert wait_for(lambda: segments._owner_state(prefix + "ctl") != "alive")
        shm_mod.sweep_orphans()
        assert not os.path.exists(slab) and not os.path.exists(shm_mod.SHM_DIR + f"/{prefix}ctl")
    finally:
        holder.kill()
        shm_mod.sweep_segments(prefix)


def test_control_segments_of_older_versions_are_judged_by_their_pid(leak_check):
    """A control segment without the lock marker (written by a bridgeflow that took no lock) whose pid is
    alive here is left alone; one whose pid is gone is removed, as before."""
    alive = shm_mod.SHM_DIR + f"/bf{os.getppid()}_0ffff_ctl"
    dead = shm_mod.SHM_DIR + f"/bf{_dead_pid()}_0eeee_ctl"
    try:
        for path in (alive, dead):
            with open(path, "wb") as f:
                f.write(bytes(64))
        shm_mod.sweep_orphans()
        assert os.path.exists(alive) and not os.path.exists(dead)
    finally:
        for path in (alive, dead):
            if os.path.exists(path):
                os.unlink(path)


_NAMESPACED = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from bridgeflow.parallel import WorkerPool

    def init(ctx):
        return lambda i: np.full(300_000, i % 251, np.uint8)

    pool = WorkerPool(init, 2)
    pool.start()
    print(json.dumps({"pid": os.getpid(), "prefix": pool._channel.prefix}), flush=True)
    n, held, bad = 0, [], 0
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        for k in range(8):
            pool.put(n + k, flush=True)
        for k in range(8):
            a = pool.get()[1]
            bad += int(a[0] != (n + k) % 251 or a[-1] != (n + k) % 251)
            held.append(a)
        n += 8
        if len(held) > 48:  # hold a varying number: the workers keep creating and retiring slabs
            del held[:40]
    open(sys.argv[2], "w").close()  # tells the test the segments go now, before they go
    pool.close()
    print(json.dumps({"n": n, "bad": bad}), flush=True)
""")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _namespaced_pool(seconds: float, tmp_path, pid: int) -> tuple[subprocess.Popen, dict]:
    """A pool streaming for ``seconds`` in a new pid namespace, where its consumer gets pid ``pid``; it
    creates ``tmp_path / "closing"`` just before it closes the pool (and removes its segments)."""
    script = tmp_path / "namespaced.py"
    script.write_text(_NAMESPACED)
    closing = tmp_path / "closing"
    shell = (f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "
             f"{sys.executable} {script} {seconds} {closing}")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", "sh", "-c", shell],
                            stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    assert info["pid"] == pid
    return proc, info


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare --pid` (root, or unprivileged user namespaces)")
def test_pools_in_separate_pid_namespaces_share_dev_shm(leak_check, tmp_path):
    """A pool in its own pid namespace streams for 6 s while pools here start (and sweep) over and over:
    none of its segments is touched. Then its whole namespace is SIGKILLed (nobody cleans up), and the
    next pool here (or one starting in another test process) removes what it left, though a process here
    has the pid in its segments' names (the pid check of old would have kept them forever).

    Its consumer is given the pid of this test's parent: a pid that is alive here, so that sweepers of
    older versions running beside this test (they judge by pid) leave its segments alone too. A pid that
    does not exist here is the subject of the simulated test above.
    """
    here = os.getppid()
    closing = tmp_path / "closing"
    proc, info = _namespaced_pool(6.0, tmp_path, here)
    prefix = info["prefix"]
    try:
        swept = 0
        while not closing.exists() and proc.poll() is None and swept < 30:
            with WorkerPool(quarter_mb_init, 1) as pool:
                pool.start()
            swept += 1
            # segments first, then the marker: the pool removes its segments only after it wrote the marker,
            # so segments gone while no marker is there means a sweep here took them
            present = any(n.startswith(prefix) for n in shm_entries(mine_only=False))
            assert present or closing.exists()
        done = json.loads(proc.stdout.readline())
        assert proc.wait(30) == 0
        assert swept >= 3 and done["n"] > 0 and done["bad"] == 0, (swept, done)

        closing.unlink()
        proc, info = _namespaced_pool(60.0, tmp_path, here)
        prefix = info["prefix"]
        assert wait_for(lambda: any(n.startswith(prefix + "r") for n in shm_entries(mine_only=False)))
        proc.kill()  # unshare dies; its child, the namespace's init, gets SIGKILL and the namespace with it
        proc.wait(10)
        # Its lock went with it: "dead", or "gone" where a pool starting in a test process beside this one swept
        # the group first (the same removal by another sweeper, so the segments' presence is not asserted here).
        assert wait_for(lambda: segments._owner_state(prefix + "ctl") != "alive")
        os.kill(here, 0)  # the pid in the names is alive here
        with WorkerPool(quarter_mb_init, 1) as pool:
            pool.start()
        assert not {n for n in shm_entries(mine_only=False) if n.startswith(prefix)}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shm_mod.sweep_segments(prefix)


# --- segments removed by someone else -------------------------------------------------------------

def test_a_result_whose_segment_vanished_is_an_error_that_says_so(leak_check):
    with WorkerPool(quarter_mb_init, 1, name="Stage") as pool:
        pool.start()
        pool.put(1, flush=True)
        assert pool._channel.result_conns[0].poll(10)  # the result waits in the pipe, its slab in /dev/shm
        prefix = pool._channel.prefix + "r0_"
        for name in shm_entries():
            if name.startswith(prefix):
                os.unlink(os.path.join(shm_mod.SHM_DIR, name))
        with pytest.raises(WorkerError, match=r"result of worker 0 \(pid \d+\) of Stage: the shared-memory "
                                              r"segment .* vanished") as info:
            pool.get()
        assert isinstance(info.value.__cause__, FileNotFoundError)
        assert pool.interrupted  # its result is lost: later gets must not wait for it


def echo_init(ctx):
    return lambda x: x


def test_a_task_whose_segment_vanished_stops_the_worker_saying_so(leak_check):
    with WorkerPool(echo_init, 1, name="Stage") as pool:
        pool.start()
        pid = pool.pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            pool.put(np.ones(100_000), flush=True)  # 800 KB: the task travels in a slab
            prefix = pool._channel.prefix + "t0_"
            gone = [n for n in shm_entries() if n.startswith(prefix)]
            assert gone
            for name in gone:
                os.unlink(os.path.join(shm_mod.SHM_DIR, name))
        finally:
            os.kill(pid, signal.SIGCONT)
        with pytest.raises(WorkerError, match=r"worker 0 \(pid \d+\) of Stage stopped: the shared-memory segment "
                                              r".*t0_.* vanished"):
            pool.get(timeout=10)
        pool._channel.procs[0].join(5)
        # the worker left the rest of the pool's shared memory to the pool, which is alive
        assert os.path.exists(os.path.join(shm_mod.SHM_DIR, pool._channel.prefix + "ctl"))


# --- arrays of any layout ---------------------------------------------------------------------------

def _in_shm(array: np.ndarray) -> bool:
    """Whether the array's memory lies in a bridgeflow shared-memory mapping of this process."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            if f"/dev/shm/bf{os.getpid()}_" in line or f"/dev/shm/bftest{os.getpid()}_" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return True
    return False


LAYOUTS = {
    "transposed (HWC viewed as CHW)": lambda a: a.reshape(64, 64, 12).transpose(2, 0, 1),
    "channels-last 4D": lambda a: a.reshape(2, 64, 64, 6).transpose(0, 3, 1, 2),
    "every other row": lambda a: a.reshape(128, 384)[::2],
    "flipped": lambda a: a.reshape(256, 192)[::-1],
}


def layout_init(ctx):
    base = np.arange(64 * 64 * 12, dtype=np.float32)
    return lambda name: LAYOUTS[name](base)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_arrays_of_any_layout_travel_in_shared_memory_and_arrive_contiguous(layout, leak_check):
    """A view that is not C- or Fortran-contiguous is made contiguous in the slab it travels in: numpy
    below 2.3 would otherwise pickle its bytes into the message (through the pipe, and copied again here)."""
    want = LAYOUTS[layout](np.arange(64 * 64 * 12, dtype=np.float32))
    assert not (want.flags.c_contiguous or want.flags.f_contiguous) and want.nbytes >= shm_mod.INBAND_LIMIT
    with WorkerPool(layout_init, 1, start_method="fork") as pool:
        pool.start()
        pool.put(layout)
        _, got = pool.get()
        assert np.array_equal(got, want) and got.dtype == want.dtype and got.flags.c_contiguous
        assert _in_shm(got)
        del got


def test_a_message_built_in_its_slab_is_not_copied(leak_check):
    """reserve() then alloc(): arrays built in place travel as offsets, the message holds no array bytes."""
    flags = memoryview(bytearray(8))
    # not bf<pid>_: segments of that form without a pool's control segment are orphans to another process's
    # pool starting beside this test, which removes them (seen in CI with three test processes)
    writer = shm_mod.SlabWriter(f"bftest{os.getpid()}_t_", flags, 8)
    reader = shm_mod.SlabReader(flags)
    try:
        writer.reserve(3 << 20)
        built = writer.alloc((1 << 20,), np.uint16)
        built[:] = 7
        view = writer.alloc((512, 512, 3), np.uint8)
        view[:] = 3
        message = writer.dumps({"a": built, "chw": view.transpose(2, 0, 1)})  # made contiguous in the slab
        assert len(message) < 2048
        got = reader.loads(message)
        assert (got["a"] == 7).all() and got["chw"].shape == (3, 512, 512) and (got["chw"] == 3).all()
        assert _in_shm(got["a"]) and _in_shm(got["chw"])
        del got
    finally:
        reader.close()
        writer.close()


# --- large datapoints ----------------------------------------------------------------------------

def big_init(ctx):
    return lambda nbytes: np.full(nbytes, 5, np.uint8)


def test_a_large_result_gets_a_slab_of_its_size_not_the_next_power_of_two(leak_check):
    nbytes = 100 * (1 << 20) + 12345  # a power of two would be 128 MiB
    with WorkerPool(big_init, 1, start_method="fork") as pool:
        pool.start()
        pool.put(nbytes)
        _, got = pool.get()
        assert got.nbytes == nbytes and got[0] == 5 and got[-1] == 5 and _in_shm(got)
        prefix = pool._channel.prefix + "r0_"
        sizes = [os.path.getsize(os.path.join(shm_mod.SHM_DIR, n)) for n in shm_entries() if n.startswith(prefix)]
        assert sizes and max(sizes) <= nbytes + (2 << 20), sizes
        del got


def test_large_buffers_without_a_slab_travel_after_the_pickle_and_arrive_writable():
    """No shared memory to be had: the arrays' bytes follow the small pickle in one message, copied once."""
    writer, reader = shm_mod.SlabWriter("", None, 0), shm_mod.SlabReader(None)
    big = np.arange(1 << 20, dtype=np.float64)
    odd = np.arange(200 * 300, dtype=np.int32).reshape(200, 300).T  # neither C nor Fortran order
    message = writer.dumps([big, {"odd": odd, "small": np.ones(3), "text": "x"}])
    assert len(message) < big.nbytes + odd.nbytes + 4096  # each large buffer once, no pickle copy of them
    got = reader.loads(bytes(message))  # as it comes out of the pipe
    assert np.array_equal(got[0], big) and np.array_equal(got[1]["odd"], odd) and got[1]["text"] == "x"
    assert got[0].flags.writeable and got[1]["odd"].flags.writeable and got[1]["small"].sum() == 3


_SMALL_SHM = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from bridgeflow import DataFromList, MultiProcessMapData

    def make(dp):
        a = np.empty(200 << 20, np.uint8)
        a[::4096] = 9
        return [a]

    def hwm(pid):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024

    df = MultiProcessMapData(DataFromList([[0], [1]], shuffle=False), 1, make, buffer_size=1)
    df.reset_state()
    worker = df._pool.pids[0]
    base = hwm(worker)
    got = [dp[0] for dp in df]
    print(json.dumps({"ok": all(a.nbytes == 200 << 20 and a[0] == 9 and a[-4096] == 9 for a in got),
                      "base": base, "peak": hwm(worker)}))
    df.close()
""")


def _private_small_shm_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=8m tmpfs /dev/shm"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _private_small_shm_works(), reason="needs `unshare --mount` and tmpfs mounts (root)")
def test_a_datapoint_larger_than_dev_shm_goes_through_the_pipe_with_two_copies_at_most_in_the_worker(tmp_path):
    """In a private mount namespace whose /dev/shm holds 64 MiB, 200 MiB arrays go through the pipe; the
    worker's peak resident memory stays within about twice the array (the array and its message)."""
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM)
    proc = subprocess.run(["unshare", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {sys.executable} {script}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "results travel through the pipe" in proc.stderr  # said once
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    grown = out["peak"] - out["base"]
    assert grown <= 2.2 * (200 << 20), out  # 3x before the message was built in one buffer
