"""Beyond one machine: stream datapoints over ZeroMQ, run the map stage on Ray.

pyzmq and Ray are imported only when a flow is used (extras ``zmq`` and ``ray``).
"""

from .errors import MessageTooLargeError, ProducerError, ProducerLostError, RemoteConnectionError
from .ray_map import RayMapData
from .zmq_flow import RemoteDataZMQ, send_dataflow_zmq

__all__ = [
    "MessageTooLargeError",
    "ProducerError",
    "ProducerLostError",
    "RayMapData",
    "RemoteConnectionError",
    "RemoteDataZMQ",
    "send_dataflow_zmq",
]
