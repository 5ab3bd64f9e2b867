"""Random numbers: generators that are reproducible for a seed and distinct in every parallel worker.

:func:`get_rng` makes a ``numpy.random.RandomState``; :class:`worker_seed_scope` mixes a worker's seed
into every generator made inside it; :class:`sample_scope` makes one sample's augmentations a function of
the sample's seed; :class:`RNGDataFlow` is a flow with ``self.rng``, seeded in ``reset_state()``.

Example:
    >>> a = get_rng(seed=1).randint(100, size=3)
    >>> with worker_seed_scope(7):
    ...     b = get_rng(seed=1).randint(100, size=3)
    >>> bool((a == get_rng(seed=1).randint(100, size=3)).all()), bool((a == b).all())
    (True, False)
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from ._base import DataFlow

__all__ = ["RNGDataFlow", "get_rng", "sample_rng", "sample_scope", "worker_seed_scope"]

log = logging.getLogger(__name__)

_seed_local = threading.local()
_sample_local = threading.local()  # .scope: the innermost sample_scope; .shared: the generator scopes reseed


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


class sample_scope:
    """Within this scope, bridgeflow's augmentors (:mod:`bridgeflow.imgaug`) draw from one generator seeded
    with ``seed`` instead of their own, so what they draw for one sample is a function of that seed alone:
    the same bytes whichever worker reads the sample, however many came before it, and after a resume.

    The generator is seeded at the first draw (a scope nothing draws in costs a thread-local assignment);
    every augmentor of the sample draws from it in turn, in the order the pipeline calls them. Outside any
    scope each augmentor draws from its own ``rng``, as tensorpack's do (draw for draw). The torch
    ``DataLoader(seed_per_sample=True)`` enters one around each sample it reads; enter one yourself with a
    seed derived from the sample (its index, its key) where the sample's randomness must not depend on
    the stream it is read in.

    Example:
        >>> from bridgeflow import imgaug
        >>> flip = imgaug.Flip(horiz=True, prob=0.5)
        >>> def draws(seed):
        ...     with sample_scope(seed):
        ...         return [flip.get_transform(np.zeros((2, 2))).__class__.__name__ for _ in range(8)]
        >>> draws(3) == draws(3)
        True
    """

    __slots__ = ("seed", "_rng", "_outer")

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self._rng: np.random.RandomState | None = None
        self._outer: sample_scope | None = None

    def __enter__(self) -> sample_scope:
        self._outer = getattr(_sample_local, "scope", None)
        _sample_local.scope = self
        return self

    def __exit__(self, *exc: object) -> None:
        _sample_local.scope, self._outer, self._rng = self._outer, None, None

    @property
    def rng(self) -> np.random.RandomState:
        """The sample's generator (seeded at the first call in the scope)."""
        rng = self._rng
        if rng is None:
            shared = getattr(_sample_local, "shared", None)
            outer = self._outer
            while outer is not None and outer._rng is not shared:
                outer = outer._outer
            if shared is None or outer is not None:  # the first scope of this thread, or an outer one uses it
                rng = np.random.RandomState()
                if shared is None:
                    _sample_local.shared = rng
            else:
                rng = shared
            rng.seed((self.seed ^ (self.seed >> 32)) & 0xFFFFFFFF)  # an int: 3 µs (an array of two: 20 µs)
            self._rng = rng
        return rng


def sample_rng() -> np.random.RandomState | None:
    """The generator of the innermost :class:`sample_scope` of this thread, None outside any."""
    scope = getattr(_sample_local, "scope", None)
    return None if scope is None else scope.rng


def in_worker_scope() -> bool:
    """Whether a :class:`worker_seed_scope` is active in this thread."""
    return getattr(_seed_local, "seed", None) is not None


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

    Set ``self.seed`` (subclasses take a ``seed=`` argument) for reproducible output. Without one, the flow
    draws a seed once, at its first ``reset_state()`` or at a ``state_dict()`` taken before it, so that a
    state taken even before the first datapoint says where the first epoch begins (in a parallel worker the
    worker's seed decides instead). The generator is seeded once per process: a second ``reset_state()`` (a
    tensorpack habit, once per epoch) goes on with the random streams and epoch counters where they are,
    instead of repeating the first epoch's shuffle.
    """

    seed: int | None = None
    rng: np.random.RandomState
    _seed_drawn: int | None = None  # the seed drawn for seed=None outside a worker
    _seeded_in: int | None = None  # the process whose reset_state() (or early state_dict()) seeded self.rng

    def _on_reset(self) -> None:
        if not self._reset_done() or self._seeded_in != os.getpid():
            self._seed_random()
        else:
            log.debug("%s: reset_state() again in this process: its random streams go on where they are (a flow "
                      "is reset once; set_epoch(n) or a new flow starts an epoch's order over)", type(self).__name__)
        super()._on_reset()

    def _seed_random(self) -> None:
        """Seed ``self.rng`` and what derives from it (a hook: sources that draw their shuffle's entropy from it
        extend it); runs once per process, in the first ``reset_state()`` or an earlier ``state_dict()``."""
        self.rng = get_rng(self, self._seed_now())
        self._seeded_in = os.getpid()

    def _seed_now(self) -> int | None:
        """``seed``; for an unseeded flow outside a worker, a seed drawn once (a worker's seed decides there)."""
        if self.seed is not None or getattr(_seed_local, "seed", None) is not None:
            return self.seed
        if self._seed_drawn is None:
            self._seed_drawn = int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
        return self._seed_drawn

    def _draw_seeds(self) -> None:
        if self.seed is None and self._seeded_in != os.getpid() and getattr(_seed_local, "seed", None) is None:
            self._seed_random()  # what reset_state() will seed: the state says where the first epoch begins
