"""What every TensorFlow input of this adapter shares: the InputSource protocol and its step loop.

An input hands the model tensors with :meth:`InputSource.dequeue` (inside a ``tf.function`` step, or once
while building a ``tf.compat.v1`` graph), is started with :meth:`~InputSource.start` (``start(sess)`` in
graph mode), and is driven to the end of its data by :meth:`~InputSource.run_until_end`, which turns
TensorFlow's ``OutOfRangeError`` into a normal end and re-raises an error of the flow with its own type
and message. ``close()`` (or ``with``) stops whatever runs in the background.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf

from bridgeflow import BridgeflowError

from ._signature import Signature

__all__ = ["InputSource", "InputSourceError", "graph_mode"]

log = logging.getLogger(__name__)
_Source = TypeVar("_Source", bound="InputSource")
_F = TypeVar("_F", bound=Callable[..., Any])


class InputSourceError(BridgeflowError, RuntimeError):
    """An input used in the wrong mode or order (graph mode without a session, a step before start)."""


def not_autographed(method: _F) -> _F:
    """``tf.autograph.experimental.do_not_convert``, keeping ``method``'s signature for type checkers
    (TensorFlow ships no types: its decorators turn what they wrap into ``Any``)."""
    return tf.autograph.experimental.do_not_convert(method)


def graph_mode() -> bool:
    """True while building a ``tf.compat.v1`` graph (a Session will run it); False in eager TF2 code,
    including inside a ``tf.function`` trace."""
    return not tf.compat.v1.executing_eagerly_outside_functions()


class InputSource:
    """Base of QueueInput, StagingInput, FeedInput and DummyConstantInput."""

    _closed = False

    @property
    def signature(self) -> Signature:
        raise NotImplementedError

    def dequeue(self) -> tuple | dict:
        """Tensors of the next datapoint, in its structure (a tuple, or a dict)."""
        raise NotImplementedError

    def start(self, sess: Any = None) -> None:
        """Start feeding; ``sess`` (a ``tf.compat.v1.Session``) is needed in graph mode. Idempotent."""

    def close(self) -> None:
        """Stop background work and release the flow. Idempotent."""
        self._closed = True

    def stats(self) -> dict[str, float]:
        return {}

    def raise_if_failed(self) -> None:
        """Re-raise an exception of the flow, if one ended the data early."""

    def _unreported_error(self) -> BaseException | None:
        """The flow's exception if nothing has raised it to the consumer yet."""
        return None

    # --- hooks for run_until_end ----------------------------------------------------------------
    def _before_step(self, sess: Any) -> bool:
        """Called before each step; False means there is no data left (clean end)."""
        return True

    def _after_step(self) -> None:
        pass

    def _run_kwargs(self) -> tuple[list, dict | None]:
        """Extra fetches and the feed_dict for one ``sess.run`` in graph mode."""
        return [], None

    def run_until_end(self, step: Any, sess: Any = None, max_steps: int | None = None,
                      callback: Callable[[Any], None] | None = None) -> int:
        """Run training steps until the data ends (or ``max_steps``); returns the number of steps run.

        Eager/``tf.function``: ``step`` is a callable taking no argument (FeedInput passes the batch).
        Graph mode: ``step`` is what to fetch (a train op, a list) and ``sess`` the Session; the input adds
        its own fetches and feeds to the same ``sess.run``. ``callback`` receives each step's result.
        ``tf.errors.OutOfRangeError`` at the end of the data ends the loop normally; an exception raised by
        the flow is re-raised here with its original type and message.

        Example:
            >>> import numpy as np
            >>> from bridgeflow import BatchData, DataFromList
            >>> from bridgeflow.adapters.tensorflow import QueueInput
            >>> df = BatchData(DataFromList([[np.float32(i), i] for i in range(4)], shuffle=False), 2)
            >>> labels = []
            >>> with QueueInput(df) as qi:
            ...     train_step = tf.function(lambda: tf.reduce_sum(qi.dequeue()[1]), autograph=False)
            ...     qi.run_until_end(train_step, callback=lambda total: labels.append(int(total)))
            2
            >>> labels  # 0 + 1, 2 + 3
            [1, 5]
        """
        if max_steps is not None and max_steps < 0:
            raise ValueError(f"max_steps must be >= 0 or None, got {max_steps}")
        self.start(sess)
        n = 0
        while max_steps is None or n < max_steps:
            if not self._before_step(sess):
                break
            try:
                result = self._call_step(step, sess)
            except tf.errors.OutOfRangeError:
                self.raise_if_failed()
                break
            self._after_step()
            n += 1
            if callback is not None:
                callback(result)
        self.raise_if_failed()
        return n

    def _call_step(self, step: Any, sess: Any) -> Any:
        if sess is None:
            if not callable(step):
                raise TypeError(f"{type(self).__name__}.run_until_end: without sess=, step must be "
                                f"a callable (a tf.function), got {type(step).__name__}")
            return step()
        extra, feed = self._run_kwargs()
        if extra:
            return sess.run([step, *extra], feed_dict=feed)[0]
        return sess.run(step, feed_dict=feed)

    def __enter__(self: _Source) -> _Source:  # ``with QueueInput(df) as qi``: qi is a QueueInput
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        """Close; then raise the flow's exception if the block ended without seeing it (a hand-written
        graph loop that took the ``OutOfRangeError`` of the closed queue for the end of the data)."""
        self.close()
        if exc is None or isinstance(exc, tf.errors.OutOfRangeError):
            error = self._unreported_error()
            if error is not None:
                self.raise_if_failed()
