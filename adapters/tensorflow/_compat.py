"""The one place that touches TensorFlow's private API.

``StagingArea`` (``tensorflow.python.ops.data_flow_ops``) has no public TF2 name, but it still works in
graph mode and inside ``tf.function`` (its ``get()`` fails in plain eager code). A canary test
(tests/test_tf_compat.py) fails as soon as a TensorFlow release drops or changes it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from bridgeflow import BridgeflowError

__all__ = ["TFCompatError", "default_device", "staging_area_class"]


class TFCompatError(BridgeflowError, ImportError):
    """The installed TensorFlow lacks a private symbol this adapter relies on."""


def staging_area_class() -> type:
    """``tensorflow.python.ops.data_flow_ops.StagingArea``, or a :class:`TFCompatError` saying what to use."""
    try:
        from tensorflow.python.ops.data_flow_ops import StagingArea
    except ImportError as exc:
        raise TFCompatError(
            f"TensorFlow {tf.__version__} has no tensorflow.python.ops.data_flow_ops.StagingArea, which "
            "StagingInput needs; use QueueInput alone, or to_tf_dataset(...) with "
            "tf.data.experimental.prefetch_to_device") from exc
    for attr in ("put", "get", "size", "clear"):
        if not hasattr(StagingArea, attr):
            raise TFCompatError(f"TensorFlow {tf.__version__}: StagingArea has no {attr}(); StagingInput "
                                "cannot work with this release")
    return StagingArea


def default_device() -> str:
    """``/gpu:0`` when TensorFlow sees a GPU, else ``/cpu:0`` (initializes TF's runtime: call lazily)."""
    gpus: Any = tf.config.list_logical_devices("GPU")
    return "/gpu:0" if gpus else "/cpu:0"
