"""Random numbers: generators that are reproducible for a seed and distinct in every parallel worker.

:func:`get_rng` makes a ``numpy.random.RandomState``; :class:`worker_seed_scope` mixes a worker's seed
into every generator made inside it; :class:`RNGDataFlow` is a flow with ``self.rng``, seeded in
``reset_state()``.

Example:
    >>> a = get_rng(seed=1).randint(100, size=3)
    >>> with worker_seed_scope(7):
    ...     b = get_rng(seed=1).randint(100, size=3)
    >>> bool((a == get_rng(seed=1).randint(100, size=3)).all()), bool((a == b).all())
    (True, False)
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

from ._base import DataFlow
from ._errors import outside_bridgeflow

__all__ = ["RNGDataFlow", "ReseededWarning", "get_rng", "worker_seed_scope"]

_seed_local = threading.local()


class worker_seed_scope:
    """Within this scope, ``get_rng`` derives generators from ``seed`` (used by parallel workers).

    Parallel stages enter it in each worker, with a distinct seed, around ``reset_state()`` of the
    worker's copy of the flow, so two workers never draw the same random stream.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def __enter__(self) -> worker_seed_scope:
        self._prev = getattr(_seed_local, "seed", None)
        _seed_local.seed = self.seed
        return self

    def __exit__(self, *exc: object) -> None:
        _seed_local.seed = self._prev


def get_rng(obj: object = None, seed: int | None = None) -> np.random.RandomState:
    """A ``RandomState`` for ``obj``: reproducible when ``seed`` is given, distinct per worker.

    With ``seed=None`` outside a worker the generator is seeded from OS entropy. Inside a worker scope
    the worker's seed is mixed in, so copies of one flow in different workers draw different streams
    while staying reproducible for a fixed ``seed``.
    """
    worker = getattr(_seed_local, "seed", None)
    if seed is None and worker is None:
        return np.random.RandomState(int(np.random.SeedSequence().generate_state(1)[0]))
    entropy = 0 if seed is None else int(seed) & 0xFFFFFFFFFFFFFFFF
    # The worker goes into the spawn key, not the entropy list: SeedSequence pads entropy with zeros,
    # so [seed, 0] would equal [seed] and worker 0 would repeat the consumer's stream.
    spawn_key = () if worker is None else (int(worker) & 0xFFFFFFFFFFFFFFFF, int(seed is None))
    state = np.random.SeedSequence(entropy, spawn_key=spawn_key).generate_state(1)[0]
    return np.random.RandomState(int(state))


def warn_if_reseeded(flow: DataFlow, seed: int | None, what: str = "it") -> None:
    """Called as ``flow.reset_state()`` seeds ``what`` from ``seed``: warn when that repeats the generator an
    epoch already drew from (the same seed, in the same worker's scope, after an ``iter()``).

    tensorpack's habit of a ``reset_state()`` per epoch drew a new seed there; here the epoch repeats. A copy
    in a worker (a fork included) is seeded in the worker's own scope, which is no repeat.
    """
    key = (seed, getattr(_seed_local, "seed", None))
    repeats = getattr(flow, "_reseed_repeats", None)
    if seed is not None and flow._iterated() and flow.__dict__.get("_seeded_from") == key and (
            repeats is None or repeats()):
        warnings.warn(
            f"{type(flow).__name__}.reset_state() called again after an epoch seeds {what} again from "
            f"seed={seed}: the next epoch repeats the first one's random order and draws. Call "
            "reset_state() once (iter() does it): the epochs after it then differ, reproducibly (a source "
            "read by epoch also takes set_epoch(n) before a reset_state())",
            ReseededWarning,
            stacklevel=outside_bridgeflow(),
        )
    flow.__dict__["_seeded_from"] = key


class ReseededWarning(UserWarning):
    """A seeded flow's ``reset_state()`` called again after an epoch: the next epoch repeats its draws."""


class RNGDataFlow(DataFlow):
    """A flow with ``self.rng``, a ``numpy.random.RandomState`` seeded in ``reset_state()``.

    Set ``self.seed`` (subclasses take a ``seed=`` argument) for reproducible output.
    """

    seed: int | None = None
    rng: np.random.RandomState

    def _reseed_repeats(self) -> bool:
        """Whether seeding ``rng`` again repeats an epoch read already (a source read by epoch: unless
        ``set_epoch`` moved it ahead)."""
        return True

    def _on_reset(self) -> None:
        warn_if_reseeded(self, self.seed)
        self.rng = get_rng(self, self.seed)
        super()._on_reset()
