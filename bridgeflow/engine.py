"""The engine seam: what the framework adapters and :mod:`bridgeflow.remote` may use of the core beyond its public API.

The adapters (``bridgeflow.adapters.torch``, ``bridgeflow.adapters.tensorflow``) and ``bridgeflow.remote``
import public names (``bridgeflow.DataFlow``, ``bridgeflow.MapData``, ``bridgeflow.parallel.WorkerPool``, the
errors, ...) from their public places, and everything else of the core from here: no private module of the core
is imported from outside it. The ``seam`` contract in ``pyproject.toml`` (``lint-imports``) holds this.

The names fall in six groups:

- the background thread: :class:`Producer` and :class:`BackgroundIterator`;
- the worker pool's parts that a pool owner needs beside :class:`bridgeflow.parallel.WorkerPool`:
  :class:`FaultPolicy`, :func:`check_max_restarts`, :func:`pack_exception`, :func:`unpack_exception`;
- the flows' hooks: :class:`ParallelStage`, :class:`IndexedSource`, :func:`reset_once`,
  :func:`warn_if_unsharded`, :func:`check_datapoint`, :data:`DATAPOINT_TYPES`, :func:`not_a_flow`,
  :func:`load_object`;
- helpers: :func:`require`, :func:`progress_bar`, :data:`DECODE_ERRORS`, and the state's :data:`MAX_DEPTH` and
  :func:`short`;
- batches read into their rows (:mod:`bridgeflow._stacked`): :func:`collating` and :func:`take_block`;
- the state schema an adapter declares its state with: :class:`Field`, :class:`Count`, :class:`Flag`,
  :class:`Value`, :func:`check_fields`.

``bridgeflow.remote`` lives inside the package, so it cannot import ``bridgeflow`` itself (that would make an
import cycle through ``bridgeflow/__init__``); for it the seam also hands on the base classes and errors it
builds on, by the same objects as their public names: :class:`DataFlow`, :class:`ProxyDataFlow`,
:class:`BridgeflowError`, :class:`DataFlowTerminated`, :class:`WorkerError`. The adapters take those from
``bridgeflow``.

These names are for code that extends bridgeflow; they carry no promise of stability beyond the package's own
adapters.

Example:
    >>> from bridgeflow.engine import BackgroundIterator
    >>> list(BackgroundIterator(range(3), lambda x: x + 1, depth=1))
    [1, 2, 3]
"""

from __future__ import annotations

from ._background import BackgroundIterator, Producer
from ._base import DataFlow, reset_once
from ._codec import DECODE_ERRORS
from ._commands import load_object
from ._deps import require
from ._errors import BridgeflowError, DataFlowTerminated, WorkerError
from ._iterables import not_a_flow
from ._order import IndexedSource
from ._progress import progress_bar
from ._proxy import ProxyDataFlow
from ._shard import warn_if_unsharded
from ._stacked import collating, take_block
from ._state import MAX_DEPTH, short
from ._state_schema import Count, Field, Flag, Value, check_fields
from ._transforms import _DATAPOINT_TYPES as DATAPOINT_TYPES
from ._transforms import check_datapoint
from .parallel._common import ParallelStage
from .parallel._transport.supervision import FaultPolicy, check_max_restarts
from .parallel._transport.worker import pack_exception, unpack_exception

__all__ = [
    # the background thread
    "BackgroundIterator",  # fn(item) for each item of an iterable, computed by a thread some items ahead
    "Producer",  # a daemon producer thread with a bounded queue, a stop, its error and its join
    # the worker pool's parts beside bridgeflow.parallel.WorkerPool
    "FaultPolicy",  # how a pool's owner names its tasks in errors and whether it skips items that kill workers
    "check_max_restarts",  # validates a max_restarts argument (an integer >= 0)
    "pack_exception",  # a worker's exception as a picklable tuple, traceback included
    "unpack_exception",  # the exception to raise in the consumer for pack_exception's tuple
    # the flows' hooks
    "ParallelStage",  # base of a flow that starts a worker pool in reset_state and closes it in close
    "IndexedSource",  # a random-access source read in a shuffled, sharded, resumable epoch order
    "reset_once",  # reset_state() unless the flow was reset already
    "warn_if_unsharded",  # warns when this process is one of several ranks and nothing takes a part per rank
    "check_datapoint",  # a datapoint, or a DatapointError naming who produced something else
    "DATAPOINT_TYPES",  # the types a datapoint may have: list, tuple, dict
    "not_a_flow",  # the TypeError for a value given where a flow or iterable is needed
    "load_object",  # resolves MODULE:ATTR or FILE.py:ATTR given on a command line
    # helpers
    "require",  # imports an optional dependency or raises MissingDependencyError naming its extra
    "progress_bar",  # a tqdm bar on stderr without tqdm's monitor thread
    "DECODE_ERRORS",  # the errors decoding raises on purpose
    "MAX_DEPTH",  # the deepest nesting of dicts and lists a state may have
    "short",  # repr() cut to about 60 characters, for error messages about untrusted states
    # batches read into their rows
    "collating",  # around reading and collating one batch: readers may read its arrays into the rows of a block
    "take_block",  # the block whose rows, in order, are the arrays given (made while collating), or None
    # the state schema, to declare an adapter's state with the core's fields
    "Field",  # one field of a state: its name and what a saved state may hold in it
    "Count",  # a field holding an integer from 0 to a bound
    "Flag",  # a field holding a bool
    "Value",  # a field holding a value of given types, checked further by a hook
    "check_fields",  # every declared field there (or optional) and as declared, and no other
    # the base names, for bridgeflow.remote (the adapters import them from bridgeflow)
    "BridgeflowError",
    "DataFlow",
    "DataFlowTerminated",
    "ProxyDataFlow",
    "WorkerError",
]
