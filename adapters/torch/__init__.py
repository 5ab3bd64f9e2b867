"""PyTorch adapter: a drop-in DataLoader on bridgeflow workers and a CUDA-stream prefetcher.

Importing this package imports torch (and raises an error naming the extra to install when it is missing).

Example:
    >>> from bridgeflow.adapters.torch import DataLoader
    >>> [b.tolist() for b in DataLoader([1, 2, 3], batch_size=2)]
    [[1, 2], [3]]
"""

from ._epoch import LoaderStateError
from ._flows import DoubleShuffleWarning, UnsplitFlowWarning
from ._loader import DataLoader
from ._prefetcher import CUDAPrefetcher, DeviceUnavailableError
from ._ranks import AllRanksState
from ._state import ResumeStateError

__all__ = ["AllRanksState", "CUDAPrefetcher", "DataLoader", "DeviceUnavailableError", "DoubleShuffleWarning",
           "LoaderStateError", "ResumeStateError", "UnsplitFlowWarning"]
