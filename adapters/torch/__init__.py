"""PyTorch adapter: a drop-in DataLoader on bridgeflow workers and a CUDA-stream prefetcher.

Importing this package imports torch (and raises an error naming the extra to install when it is missing).

Example:
    >>> from bridgeflow.adapters.torch import DataLoader
    >>> [b.tolist() for b in DataLoader([1, 2, 3], batch_size=2)]
    [[1, 2], [3]]
"""

from .epoch import LoaderStateError
from .flows import DoubleShuffleWarning, UnsplitFlowWarning
from .loader import DataLoader
from .prefetcher import CUDAPrefetcher, DeviceUnavailableError
from .ranks import AllRanksState
from .state import ResumeStateError

__all__ = ["AllRanksState", "CUDAPrefetcher", "DataLoader", "DeviceUnavailableError", "DoubleShuffleWarning",
           "LoaderStateError", "ResumeStateError", "UnsplitFlowWarning"]
