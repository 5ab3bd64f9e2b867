"""RayMapData on a real local Ray instance (2 CPUs), started once for this module."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from bridgeflow import DataFromList, MapData, WorkerError
from bridgeflow.parallel._transport.pool import RemoteTraceback
from bridgeflow.remote import RayMapData
from bridgeflow.testing import assert_same_datapoints, check_dataflow
from conftest import need

# One test process starts the module's Ray cluster: split over pytest-xdist's processes, each would start one (~6 s).
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def ray():
    ray_mod = need("ray")
    from ray import cloudpickle

    ray_mod.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors cannot import the tests folder
    yield ray_mod
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray_mod.shutdown()


def source(n: int = 60) -> DataFromList:
    return DataFromList([[np.full((3, 4), i, np.int32), i] for i in range(n)], shuffle=False)


def double(dp):
    return [dp[0] * 2, dp[1] + 1]


def drop_odd(dp):
    return None if dp[1] % 2 else [dp[0] + 1, dp[1]]


def slow_double(dp):
    time.sleep(0.01)
    return double(dp)


def fail_at_13(dp):
    if dp[1] == 13:
        raise ValueError(f"bad datapoint {dp[1]}")
    return dp


def test_output_equals_local_map_in_order(ray):
    df = RayMapData(source(), double, num_workers=2, batch_size=4)
    got = check_dataflow(df, deterministic=True)
    assert_same_datapoints(got, list(MapData(source(), double)), ordered=True)
    assert len(df) == 60
    assert ray.is_initialized()  # a Ray this flow did not start is left running


def test_unordered_with_dropped_datapoints(ray):
    with RayMapData(source(), drop_odd, num_workers=2, ordered=False, batch_size=3, max_in_flight=3) as df:
        df.reset_state()
        got = list(df)
        stats = df.stats()["RayMapData"]
    assert_same_datapoints(got, list(MapData(source(), drop_odd)), ordered=False)
    assert stats["datapoints"] == 30 and stats["workers"] == 2 and 0 < stats["buffer_fill"] <= 1


def test_exception_in_map_keeps_type_message_and_traceback(ray):
    with RayMapData(source(), fail_at_13, num_workers=2, batch_size=4) as df:
        df.reset_state()
        with pytest.raises(ValueError, match="bad datapoint 13") as info:
            list(df)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "fail_at_13" in str(info.value.__cause__)


def test_killed_actor_is_restarted_and_the_output_is_complete(ray):
    with RayMapData(source(120), slow_double, num_workers=2, batch_size=4, max_restarts=2) as df:
        df.reset_state()
        it = iter(df)
        got = [next(it) for _ in range(20)]
        pid = ray.get(df.actors[0].ready.remote())[1]
        ray.kill(df.actors[0], no_restart=False)
        got += list(it)
        assert ray.get(df.actors[0].ready.remote())[1] != pid  # a new process took over
    assert_same_datapoints(got, list(MapData(source(120), double)), ordered=True)


def test_killed_actor_without_restarts_is_a_clear_error(ray):
    with RayMapData(source(200), slow_double, num_workers=2, batch_size=4, max_restarts=0) as df:
        df.reset_state()
        it = iter(df)
        next(it)
        survivor, victim = df.actors
        ray.kill(victim)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="actor 1 died") as info:
            list(it)
        assert time.monotonic() - t0 < 30 and info.value.worker == 1
    assert df.actors == []
    with pytest.raises(ray.exceptions.RayActorError):  # close() released the surviving actor too
        ray.get(survivor.ready.remote(), timeout=30)


def test_more_workers_than_cpus_fails_at_start_instead_of_hanging(ray):
    df = RayMapData(source(), double, num_workers=3, start_timeout=2)
    with pytest.raises(WorkerError, match="did not start"):
        df.reset_state()
    assert df.actors == []  # the two that started were released
    df.close()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_workers"):
        RayMapData(source(), double, num_workers=0)
    with pytest.raises(ValueError, match="batch_size"):
        RayMapData(source(), double, batch_size=0)
    with pytest.raises(TypeError, match="map_func"):
        RayMapData(source(), "double")
    with pytest.raises(ValueError, match="task_timeout"):
        RayMapData(source(), double, task_timeout=-1)


@pytest.mark.slow
def test_starts_and_shuts_down_its_own_ray_even_beside_a_cluster_ray_would_join():
    """Without ray_address or RAY_ADDRESS a new local Ray, though this machine's Ray folder names a cluster
    (``ray start`` and ray.cluster_utils write it; plain ``ray.init(num_cpus=1)`` would connect to it and
    fail); close() shuts down the Ray it started."""
    need("ray")
    code = (
        "import numpy as np, ray\n"
        "from bridgeflow import DataFromList\n"
        "from bridgeflow.remote import RayMapData\n"
        "df = RayMapData(DataFromList([[i] for i in range(10)], shuffle=False), lambda dp: [dp[0] * 3],\n"
        "                num_workers=1, batch_size=4)\n"
        "df.reset_state()\n"
        "print([dp[0] for dp in df])\n"
        "df.close()\n"
        "print(ray.is_initialized())\n"
    )
    # Ray's folder is $TMPDIR/ray: a short one of this test's (its sockets' paths must stay under 108 bytes)
    tmp = tempfile.mkdtemp(prefix="bfray", dir="/tmp")
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:9")  # a cluster that ray.init() would try to join: nothing listens there
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": tmp}
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=300)  # ~11 s on an idle machine
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # Ray's own processes too, if it did not end
            proc.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, err[-2000:]
    lines = out.strip().splitlines()
    assert lines[-2] == str([3 * i for i in range(10)]) and lines[-1] == "False"
