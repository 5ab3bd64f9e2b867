"""The random draws an epoch makes, in torch's order, and the indices it reads.

The same arguments give torch's batches only if every number is drawn from the same generator at the same
point as torch's iterators draw it. When an epoch starts, :class:`DrawOrder` draws from the loader's
``generator`` (torch's global RNG without one): a DataPipe's shuffle seed (its graph reshuffled with it), then
the workers' base seed (kept instead by persistent workers and by a state taken between their epochs). The
sampler's iterator draws the epoch's order at its first index, so the RNG states it may draw from are
snapshotted just before (:meth:`~._state.EpochRecord.snapshot_rngs`): a resumed epoch replays the sampler from
them (:func:`~._state.replayed_indices`). Draws from torch's global RNG go through
:func:`~._state.loader_draws`, which keeps the chain of epochs of a resumed loader.

Example:
    >>> import torch
    >>> from bridgeflow.adapters.torch import DataLoader
    >>> it = iter(DataLoader(range(4), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0)))
    >>> isinstance(it.draws.base_seed, int)
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _compat
from ._compat import torch
from ._fetch import MAP
from ._state import EpochRecord, apply_generators, loader_draws, replayed_indices

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["DrawOrder"]


def _seeded(seed: int) -> Any:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


class DrawOrder:
    """An iterator's draws: ``base_seed``, ``shared_seed`` (a DataPipe's, else None), ``dataset`` (a DataPipe
    reseeded for the epoch) and the epoch's indices (:meth:`next_index`)."""

    def __init__(self, dataset: Any, kind: str) -> None:
        self.dataset = dataset
        self.kind = kind
        self.is_pipe = isinstance(dataset, _compat.IterDataPipe)
        self.seed_group = _compat.seed_group() if self.is_pipe else None
        self.base_seed: int | None = None
        self.shared_seed: int | None = None
        self._indices: Any = None
        self._first_pending = False  # the epoch's first index is still to draw (its RNGs not yet noted)

    def start(self, loader: DataLoader, record: EpochRecord, kept_seed: int | None = None, first: bool = True) -> None:
        """A fresh epoch: the iterator's first (``first``, base seed drawn unless ``kept_seed``), or another
        on the same persistent workers (they keep their seeds, as torch's ``_reset`` does)."""
        self._indices = iter(_compat.index_sampler(loader))
        with loader_draws(loader, record):  # torch's draws, in torch's order
            self._reseed(self._draw_shared(loader))
            if first:
                self.base_seed = kept_seed if kept_seed is not None else torch.empty(
                    (), dtype=torch.int64).random_(generator=loader.generator).item()
        self._first_pending = self.kind == MAP
        record.base_seed, record.shared_seed = self.base_seed, self.shared_seed

    def resume(self, loader: DataLoader, record: EpochRecord, state: dict, first_task: int) -> None:
        """An epoch in progress, from its checked ``state``: its seeds, and the sampler replayed up to task
        ``first_task`` (iterables: nothing to replay, the generators go on from where they were)."""
        self.base_seed = state["base_seed"]
        self._reseed(state["shared_seed"] if self.is_pipe else None)
        if self.kind == MAP:
            self._indices = replayed_indices(loader, state, first_task)
        else:
            apply_generators(loader, state.get("rng_now"))
            self._indices = iter(_compat.index_sampler(loader))
        # a state taken before the epoch's first index was drawn: drawn as an uninterrupted epoch draws it
        self._first_pending = self.kind == MAP and state.get("rng_first") is None
        record.base_seed, record.shared_seed = self.base_seed, self.shared_seed

    def redraw_shared_seed(self, loader: DataLoader) -> None:
        """torch's multi-process iterator draws a DataPipe's seed a second time for its own copy (its workers
        keep the first): drawn too, so that the generator's later draws stay torch's."""
        if self.is_pipe:
            kept = self.shared_seed
            self._reseed(self._draw_shared(loader))
            self.shared_seed = kept

    def next_index(self, loader: DataLoader | None, record: EpochRecord) -> Any:
        """The sampler's next index (batch); raises ``StopIteration`` at the epoch's end."""
        if self._first_pending and loader is not None:  # the epoch's first index: note what it draws from
            self._first_pending = False
            with loader_draws(loader, record):  # the sampler draws its epoch's seed now
                record.snapshot_rngs(loader)
                return next(self._indices)
        return next(self._indices)

    def _draw_shared(self, loader: DataLoader) -> int | None:
        return _compat.share_seed(loader.generator, self.seed_group) if self.is_pipe else None

    def _reseed(self, seed: int | None) -> None:
        """A DataPipe's graph reshuffled with the epoch's seed."""
        self.shared_seed = seed
        if seed is not None:
            self.dataset = _compat.apply_random_seed(self.dataset, _seeded(seed))
