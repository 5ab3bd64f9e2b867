"""Mapping hooks: told once when a slab mapping opens and once before it is unmapped, whatever ends it."""

from __future__ import annotations

import logging
import os
import signal
import threading

import numpy as np
import pytest

import bridgeflow as bf
from bridgeflow._errors import WorkerError
from bridgeflow.parallel import MultiProcessMapData, WorkerPool
from bridgeflow.parallel._transport import shm as shm_mod
from conftest import wait_for


def megabyte_init(ctx):
    return lambda i: np.full(1 << 20, i % 256, np.uint8)


def megabyte(i):
    return [np.full(1 << 20, i % 256, np.uint8), i]


def _is_mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split()[0].split("-")
            if int(lo, 16) <= address < int(hi, 16):
                return True
    return False


def _slab_mappings() -> int:
    prefix = f"/dev/shm/bf{os.getpid()}_"
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if prefix in line and "ctl" not in line)


class Recorder:
    """Records every call, and whether the memory was mapped at that moment."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.lock = threading.Lock()

    def opened(self, mapping, address, nbytes):
        with self.lock:
            self.events.append(("opened", mapping, address, nbytes, _is_mapped(address)))

    def closing(self, mapping, address, nbytes):
        with self.lock:
            self.events.append(("closing", mapping, address, nbytes, _is_mapped(address)))

    def names(self, kind: str) -> list[str]:
        return [e[1] for e in self.events if e[0] == kind]

    def open_now(self) -> set[str]:
        return set(self.names("opened")) - set(self.names("closing"))

    def check_pairs(self) -> None:
        """Every mapping opened once and closed once, after it opened, with the same memory, still mapped."""
        opened = {e[1]: (i, e) for i, e in enumerate(self.events) if e[0] == "opened"}
        closed = {e[1]: (i, e) for i, e in enumerate(self.events) if e[0] == "closing"}
        assert len(opened) == len(self.names("opened")), "a mapping was opened twice"
        assert len(closed) == len(self.names("closing")), "a mapping was closed twice"
        assert set(opened) == set(closed), f"opened but never closed: {set(opened) - set(closed)}"
        for name, (i, o) in opened.items():
            j, c = closed[name]
            assert i < j and o[2:4] == c[2:4], (o, c)
            assert o[4] and c[4], f"{name}: not mapped when opened ({o[4]}) or closing ({c[4]})"


def test_every_mapping_opened_is_closed_once_before_it_is_unmapped(leak_check):
    """Retired slabs (the consumer held 30 results, then let go) and the rest at close: each gets one
    closing(), while still mapped, and nothing of the pool stays mapped afterwards."""
    rec = Recorder()
    with WorkerPool(megabyte_init, 2, mapping_hooks=rec) as pool:
        pool.start()
        held = []
        for i in range(30):
            pool.put(i, flush=True)
            held.append(pool.get()[1])
        assert len(rec.names("opened")) >= 30 and not rec.names("closing")
        del held
        for i in range(2 * shm_mod.TRIM_WINDOW):
            pool.put(i, flush=True)
            assert int(pool.get()[1][0]) == i % 256
        retired = len(rec.names("closing"))
        assert retired >= 20, "the slabs the workers retired were not closed"
    assert len(rec.names("closing")) > retired  # the rest, at close
    rec.check_pairs()
    assert _slab_mappings() == 0


def test_an_array_held_past_close_keeps_its_mapping_until_it_goes(leak_check):
    rec = Recorder()
    pool = WorkerPool(megabyte_init, 1, mapping_hooks=rec).start()
    pool.put(7, flush=True)
    kept = pool.get()[1]
    pool.close()
    assert len(rec.open_now()) == 1  # still mapped: closing() not yet
    assert (kept == 7).all()
    del kept
    assert not rec.open_now()
    rec.check_pairs()
    assert _slab_mappings() == 0


def test_hooks_installed_late_open_what_is_alive_and_replaced_hooks_close_it(leak_check):
    first, second = Recorder(), Recorder()
    with WorkerPool(megabyte_init, 2) as pool:
        pool.start()
        held = []
        for i in range(6):
            pool.put(i, flush=True)
            held.append(pool.get()[1])
        pool.set_mapping_hooks(first)
        assert len(first.open_now()) == 6  # every slab held or mapped, told at once
        pool.set_mapping_hooks(second)
        assert not first.open_now() and len(second.open_now()) == 6
        first.check_pairs()
        pool.set_mapping_hooks(None)
        assert not second.open_now() and pool.mapping_hooks is None
        second.check_pairs()
        assert [int(a[0]) for a in held] == list(range(6))  # removing hooks never unmaps anything
        with pytest.raises(TypeError, match="opened.*closing"):
            pool.set_mapping_hooks(object())


class RaisesIn(Recorder):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def opened(self, mapping, address, nbytes):
        super().opened(mapping, address, nbytes)
        if self.where == "opened" and len(self.names("opened")) == 3:
            raise RuntimeError("cannot register")

    def closing(self, mapping, address, nbytes):
        super().closing(mapping, address, nbytes)
        if self.where == "closing":
            raise RuntimeError("cannot unregister")


@pytest.mark.parametrize("where", ["opened", "closing"])
def test_a_hook_that_raises_is_logged_once_and_the_pipeline_goes_on(where, leak_check, caplog):
    hooks = RaisesIn(where)
    with caplog.at_level(logging.WARNING, logger="bridgeflow.parallel._transport.mapping"):
        with WorkerPool(megabyte_init, 1, mapping_hooks=hooks, name="Stage") as pool:
            pool.start()
            held = []
            for i in range(10):
                pool.put(i, flush=True)
                held.append(pool.get()[1])
            assert [int(a[0]) for a in held] == list(range(10))
            del held
    warnings = [r for r in caplog.records if "mapping hook" in r.getMessage()]
    assert len(warnings) == 1 and "Stage" in warnings[0].getMessage() and where in warnings[0].getMessage()
    if where == "opened":
        assert len(hooks.names("opened")) == 3  # dropped after it raised
        assert len(hooks.names("closing")) == 2  # the two it did open are still closed
    assert _slab_mappings() == 0  # a closing() that raised unmaps all the same


def test_mappings_of_a_dead_worker_are_closed(leak_check):
    rec = Recorder()
    with WorkerPool(megabyte_init, 2, mapping_hooks=rec) as pool:
        pool.start()
        for i in range(8):
            pool.put(i, flush=True)
            pool.get()
        assert any("_r1_" in n for n in rec.names("opened"))
        os.kill(pool.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="SIGKILL"):
            for i in range(8):
                pool.put(i, flush=True)
                pool.get(timeout=10)
    rec.check_pairs()
    assert _slab_mappings() == 0


def test_a_stage_keeps_its_hooks_across_worker_restarts(leak_check):
    rec = Recorder()
    df = bf.BatchData(MultiProcessMapData(bf.DataFromList(list(range(64)), shuffle=False), 2, megabyte), 4)
    stage = df.ds
    stage.set_mapping_hooks(rec)
    df.reset_state()
    pools = []
    for restart in ("first", "interrupted", "reset_state"):
        if restart == "interrupted":
            stage._pool.interrupted = True  # as after Ctrl-C mid-receive: the next iteration restarts
        elif restart == "reset_state":
            df.reset_state()
        batches = list(df)
        assert [int(b[1][0]) for b in batches] == list(range(0, 64, 4))
        pools.append(stage._pool._channel.prefix)
        del batches
    df.close()
    assert len(set(pools)) == 3
    for prefix in pools:  # each pool's slabs reached the hooks
        assert any(name.startswith(prefix) for name in rec.names("opened")), prefix
    rec.check_pairs()
    assert wait_for(lambda: _slab_mappings() == 0)
