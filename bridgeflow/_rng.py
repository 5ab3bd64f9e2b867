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

import numpy as np

from ._base import DataFlow

__all__ = ["RNGDataFlow", "get_rng", "worker_seed_scope"]

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


class RNGDataFlow(DataFlow):
    """A flow with ``self.rng``, a ``numpy.random.RandomState`` seeded in ``reset_state()``.

    Set ``self.seed`` (subclasses take a ``seed=`` argument) for reproducible output.
    """

    seed: int | None = None
    rng: np.random.RandomState

    def _on_reset(self) -> None:
        self.rng = get_rng(self, self.seed)
        super()._on_reset()
