"""The parallel stages' faults: ``on_error="skip"`` (a datapoint ``map_func`` fails on is dropped, counted, logged,
and remembered by the state), and ``max_restarts`` on map stages and runners (a dead worker is replaced and the
epoch goes on exactly; a datapoint that kills every worker it meets is named, or skipped)."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from deaths import die, once
from procs import alive

import bridgeflow as bf
from bridgeflow._errors import WorkerError


def picky(dp, bad=(7, 17, 18, 33)):
    """Fails on a few datapoints; the others become an array (in a slab when large) and their number."""
    x = dp[0]
    if x in bad:
        raise ValueError(f"cannot decode {x}")
    return [np.full(5000, x, np.int64), x]


def numbers(n=40):
    return bf.DataFromList([[i] for i in range(n)], shuffle=False)


def kept(n=40, bad=(7, 17, 18, 33)):
    return [i for i in range(n) if i not in bad]


STAGES = {
    "processes": lambda src, f, **kw: bf.MultiProcessMapData(src, 2, f, buffer_size=12, **kw),
    "threads": lambda src, f, **kw: bf.MultiThreadMapData(src, 2, f, buffer_size=12, **kw),
}


@pytest.mark.parametrize("kind", sorted(STAGES))
@pytest.mark.parametrize("ordered", [True, False])
def test_skip_drops_the_datapoints_map_func_fails_on_counts_and_logs_them(kind, ordered, caplog, leak_check):
    stage = STAGES[kind](numbers(), picky, ordered=ordered, strict=True, on_error="skip")
    with caplog.at_level(logging.WARNING, "bridgeflow.parallel._stages"), stage:
        got = [int(dp[1]) for dp in stage]
        stats = stage.stats()[type(stage).__name__]
    assert (got if ordered else sorted(got)) == kept()
    assert stats["skipped"] == 4 and stats["datapoints"] == 36
    lines = [r.getMessage() for r in caplog.records if "skipped the source datapoint" in r.getMessage()]
    assert len(lines) == 4 and any("[17]" in m and "ValueError: cannot decode 17" in m for m in lines), lines
    if ordered:  # an ordered stage knows each datapoint's place in the epoch
        assert any("[17] (#17 of the epoch)" in m for m in lines), lines


@pytest.mark.parametrize("kind", sorted(STAGES))
@pytest.mark.parametrize("ordered", [True, False])
def test_a_skip_in_a_fused_batch_refills_it_as_batchdata_over_the_map_would(kind, ordered, leak_check):
    """The batches are made in the workers; a group with a datapoint left out comes back short and is refilled
    from the next groups, as ``BatchData`` over ``MapData(... returns None ...)`` refills it in one process."""
    ref = bf.BatchData(bf.MapData(numbers(), lambda dp: None if dp[0] in (7, 17, 18, 33) else picky(dp)), 4,
                       remainder=True)
    ref.reset_state()
    want = [b[1].tolist() for b in ref]
    df = bf.BatchData(STAGES[kind](numbers(), picky, ordered=ordered, strict=True, on_error="skip"), 4,
                      remainder=True)
    with df:
        got = [b[1].tolist() for b in df]
        stats = next(iter(df.stats().values()))
    assert stats["skipped"] == 4
    if ordered:
        assert got == want
    else:
        assert sorted(sum(got, [])) == sorted(sum(want, [])) and all(len(b) == 4 for b in got[:-1])


def test_raise_is_the_default_and_stats_keep_their_keys(leak_check):
    stage = bf.MultiProcessMapData(numbers(), 2, picky)
    with stage, pytest.raises(ValueError, match="cannot decode 7"):
        for _ in stage:
            pass
    plain = bf.MultiProcessMapData(numbers(), 2, lambda dp: dp)
    with plain:
        list(plain)
        assert not {"skipped", "restarts"} & set(plain.stats()["MultiProcessMapData"])


@pytest.mark.parametrize("bad", ["ignore", None, True])
def test_on_error_is_raise_or_skip(bad):
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        bf.MultiProcessMapData(numbers(), 2, picky, on_error=bad)
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
        bf.MultiProcessRunner(numbers(), 4, 2, max_restarts=-1)


# --- resuming after skips ---------------------------------------------------------------------------


def flaky(dp, path):
    """Fails on the datapoints listed in the file at ``path``: what fails in one run need not in the next."""
    with open(path) as f:
        bad = json.load(f)
    return picky(dp, bad=tuple(bad))


BAD = [3, 4, 9, 20, 21, 41]


def resumable(path, ordered, batch):
    stage = bf.MultiProcessMapData(numbers(60), 2, functools.partial(flaky, path=path), buffer_size=8,
                                   ordered=ordered, strict=not ordered, seed=1, on_error="skip")
    return bf.BatchData(stage, batch, remainder=True) if batch else stage


def values(items, batch):
    return [int(v) for b in items for v in (b[1] if batch else [b[1]])]


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("batch", [0, 4])
def test_a_resume_after_skips_is_exact(tmp_path, ordered, batch, leak_check):
    """The same datapoints fail in every run: the interrupted run's head and the resumed run's rest are the
    uninterrupted run's epoch (in order, or as a multiset), and the skips of the two add up to its skips."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(BAD))
    with resumable(str(bad), ordered, batch) as df:
        full = values(list(df), batch)
        assert next(iter(df.stats().values()))["skipped"] == len(BAD)
    with resumable(str(bad), ordered, batch) as df:
        it = iter(df)
        head = [next(it) for _ in range(7 if batch else 30)]
        state = json.loads(json.dumps(df.state_dict()))
    with resumable(str(bad), ordered, batch) as df:
        df.load_state_dict(state)
        rest = values(list(df), batch)
    got = values(head, batch) + rest
    assert (got if ordered else sorted(got)) == (full if ordered else sorted(full))
    assert sorted(full) == [i for i in range(60) if i not in BAD]


@pytest.mark.parametrize("ordered", [True, False])
def test_a_datapoint_skipped_before_the_state_is_not_read_again(tmp_path, ordered, caplog, leak_check):
    """The skips the consumer received before the state count as received: the resumed run never reads them
    again, even where they would not fail any more (a transient error); those in flight are read again."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(BAD))
    with caplog.at_level(logging.WARNING, "bridgeflow.parallel._stages"), resumable(str(bad), ordered, 0) as df:
        it = iter(df)
        head = [next(it) for _ in range(30)]
        state = json.loads(json.dumps(df.state_dict()))
    received = {int(m.split("datapoint [")[1].split("]")[0]) for m in (r.getMessage() for r in caplog.records)
                if "skipped the source datapoint" in m}
    assert received and received <= set(BAD) - {41}
    if ordered:  # all those before the 30th datapoint received
        assert received == {3, 4, 9, 20, 21}
    bad.write_text(json.dumps([]))  # nothing fails now
    with resumable(str(bad), ordered, 0) as df:
        df.load_state_dict(state)
        rest = values(list(df), 0)
    got = values(head, 0) + rest
    assert not received & set(got)
    assert sorted(got) == [i for i in range(60) if i not in received]


# --- restarts ---------------------------------------------------------------------------------------


def killing(dp, flag, at):
    if dp[0] == at and once(flag):
        os.kill(os.getpid(), signal.SIGKILL)
    return picky(dp, bad=())


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("batch", [0, 4])
def test_a_map_stage_replaces_a_killed_worker_and_gives_the_undisturbed_epoch(tmp_path, ordered, batch, leak_check):
    f = functools.partial(killing, flag=str(tmp_path / "once"), at=13)
    stage = bf.MultiProcessMapData(numbers(), 2, f, buffer_size=12, ordered=ordered, strict=True, max_restarts=1)
    df = bf.BatchData(stage, batch, remainder=True) if batch else stage
    with df:
        held = list(df)  # held to the end: arrays of the dead worker's slabs among them
        stats = next(iter(df.stats().values()))
    rows = [(int(a[0]), int(x)) for b in held for a, x in (zip(b[0], b[1]) if batch else [(b[0], b[1])])]
    assert all(a == x for a, x in rows)
    xs = [x for _, x in rows]
    assert (xs if ordered else sorted(xs)) == list(range(40))
    assert stats["restarts"] == 1 and "skipped" not in stats


def leaving_a_child(dp, flag, at, pids):
    """At datapoint ``at`` (once): start a ``sleep`` and die by SIGKILL, leaving the sleep behind."""
    if dp[0] == at and once(flag):
        child = subprocess.Popen(["sleep", "120"])
        with open(pids, "w") as f:
            f.write(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    return picky(dp, bad=())


def test_a_replaced_worker_takes_the_processes_its_tasks_started_with_it(tmp_path, leak_check):
    """A worker killed while a process its task started runs: the replacement does not leave that process
    running until the stage closes (it would hold the caller's stdout, and a pool restarting often would
    gather them)."""
    pids = tmp_path / "pids"
    f = functools.partial(leaving_a_child, flag=str(tmp_path / "once"), at=9, pids=str(pids))
    with bf.MultiProcessMapData(numbers(), 2, f, buffer_size=12, strict=True, max_restarts=1) as stage:
        got = sorted(int(dp[1]) for dp in stage)
        assert stage.stats()["MultiProcessMapData"]["restarts"] == 1
        orphan = int(pids.read_text())
        deadline = time.monotonic() + 5
        while alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(orphan), f"the dead worker's child {orphan} outlived its replacement"
    assert got == list(range(40))


def segfault_on(dp, at, tally):
    if dp[0] == at:
        die("segv", tally)
    return picky(dp, bad=())


@pytest.mark.parametrize("batch", [0, 4])
def test_a_datapoint_that_segfaults_every_worker_is_named_or_skipped(batch, tmp_path, caplog, leak_check):
    def make(on_error):
        f = functools.partial(segfault_on, at=23, tally=str(tmp_path / f"tally_{on_error}"))
        stage = bf.MultiProcessMapData(numbers(), 2, f, buffer_size=12,
                                       max_restarts=4, on_error=on_error)
        return bf.BatchData(stage, batch, remainder=True) if batch else stage

    with make("raise") as df, pytest.raises(WorkerError) as info:
        list(df)
    text = str(info.value)
    assert "MultiProcessMapData: the source datapoint [23]" in text and "killed by SIGSEGV" in text
    assert "on_error='skip' skips it" in text
    if batch:  # named in its group (the datapoint is marked as it starts), with its place in the epoch
        assert "[23] (#23 of the epoch): it killed 2 worker processes" in text
    with caplog.at_level(logging.WARNING, "bridgeflow.parallel._stages"), make("skip") as df:
        got = [int(x) for b in df for x in (b[1] if batch else [b[1]])]
        stats = next(iter(df.stats().values()))
    assert got == [i for i in range(40) if i != 23]
    assert stats["skipped"] == 1 and 2 <= stats["restarts"] <= 3
    assert any("skipped the source datapoint [23]" in r.getMessage() and "killed 2 worker processes" in r.getMessage()
               for r in caplog.records)


class Tagged(bf.RNGDataFlow):
    """``[tag, i]``: ``tag`` drawn from the copy's seed; worker copies that meet ``kill_at`` die there, once."""

    def __init__(self, flag, kill_at, n=30, resumable=True):  # each datapoint takes 5 ms
        self.flag, self.kill_at, self.n, self.resumable, self.i, self.tag = flag, kill_at, n, resumable, 0, -1

    def __len__(self):
        return self.n

    def reset_state(self):
        super().reset_state()
        self.tag, self.i = int(self.rng.randint(1 << 30)), 0

    def __iter__(self):
        while True:
            if self.i == self.kill_at and once(self.flag):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.005)
            self.i += 1
            yield [self.tag, self.i - 1]

    def state_dict(self):
        if not self.resumable:
            raise bf.NotResumableError("this copy cannot say where it is", [type(self).__name__])
        return {"i": self.i, "tag": self.tag}

    def load_state_dict(self, state):
        self.i, self.tag = state["i"], state["tag"]


@pytest.mark.filterwarnings("ignore::bridgeflow.UnshardedWarning")
def test_a_restarted_runner_worker_continues_its_copy_where_the_dead_one_was(tmp_path, leak_check):
    df = bf.MultiProcessRunner(Tagged(str(tmp_path / "once"), 20), 6, 2, seed=5, max_restarts=1)
    with df:
        got = [tuple(dp) for _ in range(4) for dp in df]
        assert df.stats()["MultiProcessRunner"]["restarts"] == 1
    streams: dict = {}
    for tag, i in got:
        streams.setdefault(tag, []).append(i)
    assert len(streams) == 2 and len(got) == 120
    assert all(numbers == list(range(len(numbers))) for numbers in streams.values())  # no gap, no repeat
    assert max(len(numbers) for numbers in streams.values()) > 20  # the killed copy went on past 20


@pytest.mark.filterwarnings("ignore::bridgeflow.UnshardedWarning")
def test_a_runner_worker_whose_copy_cannot_say_where_it_was_starts_it_again(tmp_path, caplog, leak_check):
    df = bf.MultiProcessRunner(Tagged(str(tmp_path / "once"), 20, resumable=False), 6, 2, seed=5, max_restarts=1)
    with caplog.at_level(logging.WARNING), df:
        got = [tuple(dp) for _ in range(4) for dp in df]
    assert len(got) == 120
    assert any("starts its copy from the beginning" in r.getMessage() for r in caplog.records)
    again = [i for tag, i in got]
    assert again.count(0) == 3  # each copy's first datapoint, and the restarted copy's again
