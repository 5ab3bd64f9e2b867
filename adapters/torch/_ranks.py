"""Every rank's DataLoader state in one checkpoint: :class:`AllRanksState`.

Under ``torch.distributed`` each rank reads its own shard, so each rank's loader has a state of its own (a
``DistributedSampler``'s rank, its workers' seeds and dataset states). Checkpoint code that writes one
rank's copy of the objects it was given (Accelerate's ``register_for_checkpointing`` and
``save_state()`` write the main process's) would hand rank 0's state to every rank, which the loader
refuses (another ``rank``). :class:`AllRanksState` wraps the loader: its ``state_dict()`` gathers every
rank's state (a collective call: every rank calls it, as ``save_state()`` does), and ``load_state_dict()``
gives each rank its own. A state from another world size is refused with a
:class:`~bridgeflow.adapters.torch._state.ResumeStateError` naming both sizes.

Example:
    >>> from accelerate import Accelerator                                   # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=8, num_workers=2,                 # doctest: +SKIP
    ...                     sampler=DistributedSampler(ds, shuffle=True))
    >>> accelerator.register_for_checkpointing(AllRanksState(loader))        # doctest: +SKIP
    >>> accelerator.save_state(folder)   # ... later, in a new job:          # doctest: +SKIP
    >>> accelerator.load_state(folder)   # every rank resumes where it was   # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._compat import torch
from ._state import ResumeStateError

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["AllRanksState"]

FORMAT = "bridgeflow.adapters.torch.AllRanksState"


class AllRanksState:
    """A stateful view of ``loader`` whose state holds every rank's (see the module doc).

    ``group`` is the process group to gather over (default: the world).
    """

    def __init__(self, loader: DataLoader, group: Any = None) -> None:
        self.loader = loader
        self.group = group

    def _rank_and_size(self) -> tuple[int, int]:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state, by rank (call it on every rank)."""
        rank, size = self._rank_and_size()
        mine = self.loader.state_dict()
        states: list[Any] = [None] * size
        if size == 1:
            states[0] = mine
        else:
            torch.distributed.all_gather_object(states, mine, group=self.group)
        return {"format": FORMAT, "world_size": size, "ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Give this rank's loader its own state; another world size is refused."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ResumeStateError(f"AllRanksState.load_state_dict: not a state of AllRanksState (no 'format': "
                                   f"{FORMAT!r} entry)")
        rank, size = self._rank_and_size()
        ranks = state.get("ranks")
        if state.get("world_size") != size or not isinstance(ranks, list) or len(ranks) != size:
            raise ResumeStateError(f"AllRanksState.load_state_dict: the state was saved with world size "
                                   f"{state.get('world_size')!r}, this job has world size {size}")
        self.loader.load_state_dict(ranks[rank])
