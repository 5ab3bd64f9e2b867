"""Driver for tests/test_ray_cluster.py, run as ``python ray_cluster_run.py WHEEL OUT.json`` from a folder outside
the checkout, so that nothing of the checkout is on this driver's sys.path (Ray gives the driver's path to its
workers, and pytest's rootdir is on the path of a test process): the workers can import bridgeflow only from the
wheel that the runtime environment installs.

A Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster): the head (1 CPU, resource "head") and a
second raylet (1 CPU, resource "second"). RayMapData's two actors (1 CPU each) run one per node. Mid-epoch the
second node is killed and a third joins (as an autoscaler adds one): the epoch must be complete and in order.
Then the third is killed with nowhere to restart its actor: the wait for it, bounded by start_timeout, must end
in a WorkerError naming the actor.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster

from bridgeflow import DataFromList, MapData, WorkerError
from bridgeflow.remote import RayMapData

NAMES = ("head", "second", "third")


def source(n: int) -> DataFromList:
    return DataFromList([[np.full((3, 4), i, np.int32), i] for i in range(n)], shuffle=False)


def double(dp):
    return [dp[0] * 2, dp[1] + 1]


def double_where(dp):
    """``double``, plus the node it ran on and the folder bridgeflow was imported from there."""
    import bridgeflow

    time.sleep(0.02)  # an epoch long enough to kill a node in the middle of it
    return [dp[0] * 2, dp[1] + 1, ray.get_runtime_context().get_node_id(), os.path.dirname(bridgeflow.__file__)]


def node_names() -> dict[str, str]:
    return {n["NodeID"]: next(r for r in n["Resources"] if r in NAMES) for n in ray.nodes()
            if any(r in NAMES for r in n["Resources"])}


def main(wheel: str, out_path: str) -> None:
    out: dict = {"driver_sys_path": sys.path}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1},
                                                      "include_dashboard": False})
    try:
        second = c.add_node(num_cpus=1, resources={"second": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, runtime_env={"py_modules": [wheel]}, log_to_driver=False)
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        t0 = time.monotonic()
        # Ray installs the wheel (with numpy and tqdm) on each node before a worker starts there: a minute or more
        # on a busy machine, past RayMapData's start_timeout; done here for both nodes first.
        where = ray.remote(num_cpus=0)(lambda: os.path.dirname(__import__("bridgeflow").__file__))
        ray.get([where.options(resources={name: 0.01}).remote() for name in ("head", "second")], timeout=600)
        out["runtime_env_install_s"] = time.monotonic() - t0
        n = 160
        want = list(MapData(source(n), double))
        with RayMapData(source(n), double_where, num_workers=2, batch_size=4, max_restarts=2, seed=0,
                        start_timeout=300) as df:
            df.reset_state()
            it = iter(df)
            got = [next(it) for _ in range(40)]
            names = node_names()
            out["nodes_before"] = sorted({names[dp[2]] for dp in got})
            out["folders"] = sorted({dp[3] for dp in got})
            c.remove_node(second, allow_graceful=False)
            c.add_node(num_cpus=1, resources={"third": 1})
            t0 = time.monotonic()
            got += list(it)
            out["recovered_s"] = time.monotonic() - t0
        names = node_names()
        out["nodes_after"] = sorted({names.get(dp[2], "gone") for dp in got[40:]})
        out["datapoints"] = len(got)
        out["same_as_in_process"] = len(got) == len(want) and all(
            a[1] == b[1] and np.array_equal(a[0], b[0]) for a, b in zip(got, want))
        (third,) = c.worker_nodes
        with RayMapData(source(400), double_where, num_workers=2, batch_size=4, max_restarts=2, seed=0,
                        start_timeout=90) as df:
            df.reset_state()
            it = iter(df)
            for _ in range(8):
                next(it)
            c.remove_node(third, allow_graceful=False)
            t0 = time.monotonic()
            try:
                for _ in it:
                    pass
                out["no_room"] = "the epoch ended without the lost node's groups"
            except WorkerError as exc:
                out["no_room"] = f"WorkerError after {time.monotonic() - t0:.0f} s: {exc}"
                out["no_room_worker"] = exc.worker
    finally:
        ray.shutdown()
        c.shutdown()
        with open(out_path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
