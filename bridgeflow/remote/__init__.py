"""Beyond one machine: stream datapoints over ZeroMQ (encrypted and authenticated with CurveZMQ keys:
:mod:`bridgeflow.remote._keys`), run the map stage on Ray.

pyzmq and Ray are imported only when a flow is used (extras ``zmq`` and ``ray``).
"""

from ._errors import MessageTooLargeError, ProducerError, ProducerLostError, RemoteConnectionError
from ._keys import CurveKeys, generate_keys, load_keys
from ._ray_map import RayMapData
from ._zmq_flow import RemoteDataZMQ, send_dataflow_zmq

__all__ = [
    "CurveKeys",
    "MessageTooLargeError",
    "ProducerError",
    "ProducerLostError",
    "RayMapData",
    "RemoteConnectionError",
    "RemoteDataZMQ",
    "generate_keys",
    "load_keys",
    "send_dataflow_zmq",
]
