"""TensorFlow adapter: QueueInput, StagingInput, tf.data and Keras inputs from any DataFlow.

Importing this package imports TensorFlow (the core ``bridgeflow`` package never does), and raises
:class:`~bridgeflow.MissingDependencyError` with the command that installs it when it is missing.

- :class:`QueueInput`: a FIFOQueue filled from a DataFlow by a background thread (eager
  ``tf.function`` steps, or ``tf.compat.v1`` graph mode with ``start(sess)``).
- :class:`StagingInput`: prefetches ``nr_stage`` batches of another input onto the device.
- :func:`to_tf_dataset`: a ``tf.data.Dataset`` over a DataFlow, for ``model.fit``.
- :class:`FeedInput` (feed_dict / per-call arguments) and :class:`DummyConstantInput` (constant tensors)
  to compare with and to time the model alone.
"""

from bridgeflow.engine import require

require("tensorflow", "bridgeflow.adapters.tensorflow")  # first: a missing TensorFlow is named, with its install

from ._dataset import to_tf_dataset  # noqa: E402
from ._feed import DummyConstantInput, FeedInput  # noqa: E402
from ._queue_input import QueueInput  # noqa: E402
from ._signature import Signature, infer_signature  # noqa: E402
from ._source import InputSource, InputSourceError  # noqa: E402
from ._staging import StagingInput  # noqa: E402

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
