"""A ``fork()`` in the consumer's process leaves its pipelines alone (bridgeflow.parallel._transport.forking).

Each scenario runs in a fresh interpreter (a child of pytest that calls ``sys.exit`` would run pytest's own
exit path): it starts a pipeline, takes a few datapoints, forks, lets the child end in one way, then reads
the rest in the parent and prints what happened as one JSON line.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import have

_SCENARIO = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from collections import Counter
    from bridgeflow import DataFromList, MapData, MultiProcessMapData, MultiProcessRunner, MultiThreadMapData
    from bridgeflow.engine import BackgroundIterator

    def f(dp):
        return [np.full(50_000, dp[0], np.int64)]  # 400 KB: results travel in shared-memory slabs

    stage, how = sys.argv[1], sys.argv[2]
    src = DataFromList([[i] for i in range(60)], shuffle=False)
    df = {"MultiProcessMapData": lambda: MultiProcessMapData(src, 2, f),
          "MultiThreadMapData": lambda: MultiThreadMapData(src, 2, f),
          "MultiProcessRunner": lambda: MultiProcessRunner(MapData(src, f), 4, 2),
          "BackgroundIterator": lambda: None}[stage]()
    if df is None:
        it = iter(BackgroundIterator(range(60), lambda x: [np.full(50_000, x, np.int64)], depth=4))
    else:
        df.reset_state()
        it = iter(df)
    got = [next(it) for _ in range(5)]
    segments = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"bf{os.getpid()}_"))
    before = segments()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        if how == "iterate":
            try:
                next(it)
                os.write(w, b"iterated")
            except Exception as exc:
                os.write(w, f"{type(exc).__name__}: {exc}".encode())
            sys.exit(0)
        if how == "exit":
            sys.exit(0)
        if how == "_exit":
            os._exit(3)
        if how == "raise":
            raise RuntimeError("the child fails")
    os.close(w)
    child_said = os.read(r, 4096).decode()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    time.sleep(0.3)  # what the child's exit did to the workers, if anything, has happened by now
    after = segments()
    got += list(it)
    if stage == "MultiProcessRunner":  # each worker runs the whole flow: any order, each datapoint up to twice
        counts = Counter(int(dp[0][0]) for dp in got)
        ok = all(dp[0][0] == dp[0][-1] for dp in got) and set(counts) <= set(range(60)) and max(counts.values()) <= 2
    else:
        ok = all(int(dp[0][0]) == i and int(dp[0][-1]) == i for i, dp in enumerate(got))
    if df is not None:
        df.close()
    print(json.dumps({"n": len(got), "ok": ok, "child": status, "said": child_said,
                      "kept_segments": set(before) <= set(after), "left": segments()}))
""")


def _run(tmp_path, stage: str, how: str) -> dict:
    script = tmp_path / "fork_scenario.py"
    script.write_text(_SCENARIO)
    proc = subprocess.run([sys.executable, str(script), stage, how], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_multiprocessing_still_keeps_its_children_in_a_set():
    """Canary: forking.forget_children uses multiprocessing's private list of a process's children."""
    assert isinstance(multiprocessing.process._children, set)


@pytest.mark.parametrize("how", ["exit", "_exit", "raise"])
@pytest.mark.parametrize("stage", ["MultiProcessMapData", "MultiProcessRunner"])
def test_a_forked_child_that_ends_leaves_the_parents_workers_and_segments_alone(tmp_path, stage, how):
    out = _run(tmp_path, stage, how)
    assert out["child"] == {"exit": 0, "_exit": 3, "raise": 1}[how]
    assert out["n"] == 60 and out["ok"], out  # the whole epoch, every array intact
    assert out["kept_segments"], out  # the child's exit removed none of the parent's shared memory
    assert out["left"] == [], out  # and the parent's close removed all of it


@pytest.mark.parametrize("stage", ["MultiProcessMapData", "MultiProcessRunner", "MultiThreadMapData",
                                   "BackgroundIterator"])
def test_a_forked_child_that_iterates_the_parents_pipeline_gets_a_clear_error(tmp_path, stage):
    out = _run(tmp_path, stage, "iterate")
    assert out["child"] == 0
    assert out["said"].startswith("BridgeflowError: "), out
    assert "is a fork of it" in out["said"] and "build the pipeline in the child" in out["said"].lower(), out
    assert out["ok"] and out["n"] == 60 and out["left"] == [], out  # the parent's stream went on, intact


# --- pipelines started from many threads at once, under fork -------------------------------------

_THREADS = textwrap.dedent('''
    import json, os, sys, threading
    import numpy as np
    from bridgeflow import BatchData, DataFromList, MapData, MultiProcessMapData, MultiProcessRunner

    KINDS = json.loads(sys.argv[1])  # 2 and 3 (torch's DataLoader) where torch is installed
    if 2 in KINDS:
        import torch
        from bridgeflow.adapters.torch import DataLoader

        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 32
            def __getitem__(self, i):
                return torch.tensor([i * i]), np.random.rand()

    class Recorder:  # a module a forked worker imports is a deadlock waiting for a thread of the parent
        def find_spec(self, name, path=None, target=None):
            if name not in sys.modules:
                os.write(2, f"forked worker {os.getpid()} imports {name}\\\\n".encode())
            return None

    os.register_at_fork(after_in_child=lambda: sys.meta_path.insert(0, Recorder()))

    def double(dp):
        return [dp[0] * 2, np.random.randint(1 << 30)]  # draws numbers, as augmentations do

    def src():
        return DataFromList([[i] for i in range(32)], shuffle=False)

    def build(kind):
        if kind == 0:
            return MultiProcessMapData(src(), 2, double, start_method="fork")
        if kind == 1:
            return MultiProcessRunner(BatchData(MapData(src(), double), 4), 4, 2, start_method="fork")
        if kind == 2:
            return DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        return DataLoader(MapData(src(), double), batch_size=4, num_workers=2, multiprocessing_context="fork")

    counts, errors = [None] * 8, []
    go = threading.Barrier(8)

    def run(i):
        try:
            df = build(KINDS[i % len(KINDS)])
            go.wait()
            counts[i] = sum(1 for _ in df)
            getattr(df, "close", lambda: None)()
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"counts": counts, "errors": errors}))
''')


def test_eight_threads_start_pipelines_at_once_under_fork_without_deadlock(tmp_path):
    """Stage workers and DataLoader workers forked from 8 threads at once: all finish (within the timeout,
    not stuck on a lock a thread of the parent held at the fork), and no forked worker imports a module
    (a lazy import in a fresh child, numpy.random above all, is how such a deadlock begins)."""
    script = tmp_path / "threads.py"
    script.write_text(_THREADS)
    kinds = [0, 1, 2, 3] if have("torch") else [0, 1]  # the core's stages, then torch's DataLoader over each
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(kinds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its deadlocked workers
        stdout, stderr = proc.communicate()
        pytest.fail(f"deadlocked: no end after 120 s\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["counts"] == [[32, 8, 8, 8][k] for k in kinds] * (8 // len(kinds)), out
    assert "imports" not in stderr, stderr[-3000:]
