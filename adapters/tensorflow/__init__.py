"""TensorFlow adapter: QueueInput, StagingInput, tf.data and Keras inputs from any DataFlow.

Importing this package imports TensorFlow (the core ``bridgeflow`` package never does).

- :class:`QueueInput`: a FIFOQueue filled from a DataFlow by a background thread (eager
  ``tf.function`` steps, or ``tf.compat.v1`` graph mode with ``start(sess)``).
- :class:`StagingInput`: prefetches ``nr_stage`` batches of another input onto the device.
- :func:`to_tf_dataset`: a ``tf.data.Dataset`` over a DataFlow, for ``model.fit``.
- :class:`FeedInput` (feed_dict / per-call arguments) and :class:`DummyConstantInput` (constant tensors)
  to compare with and to time the model alone.
"""

from ._dataset import to_tf_dataset
from ._feed import DummyConstantInput, FeedInput
from ._queue_input import QueueInput
from ._signature import Signature, infer_signature
from ._source import InputSource, InputSourceError
from ._staging import StagingInput

__all__ = [
    "DummyConstantInput",
    "FeedInput",
    "InputSource",
    "InputSourceError",
    "QueueInput",
    "Signature",
    "StagingInput",
    "infer_signature",
    "to_tf_dataset",
]
