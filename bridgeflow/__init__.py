"""bridgeflow: length-free DataFlows that keep TensorFlow and PyTorch accelerators fed.

Data is any Python iterator of datapoints (lists or dicts of components). Sources, transforms,
parallel stages and batching are separate wrappers that compose; adapters in ``bridgeflow.adapters``
hand the result to PyTorch or TensorFlow while the model trains.

Importing bridgeflow loads only numpy and the standard library.
"""

from ._augment import AugmentImageComponent, AugmentImageComponents, AugmentImageCoordinates
from ._base import DataFlow
from ._batch import BatchData, BatchDataByShape, UnbatchData, batch_datapoints
from ._combine import ConcatData, JoinData, LocallyShuffleData, RandomChooseData, RandomMixData
from ._errors import (
    BatchError,
    BridgeflowError,
    DataFlowReentrantError,
    DataFlowTerminated,
    DatapointError,
    LengthUnknownError,
    MissingDependencyError,
    WorkerError,
    WorkerTimeoutError,
)
from ._image_sources import ImageFromFile
from ._iterables import as_dataflow
from ._proxy import ProxyDataFlow
from ._queues import DataFromQueue, MultiThreadPrefetchData
from ._rng import RNGDataFlow, get_rng, sample_scope, worker_seed_scope
from ._shard import ShardData, UnshardedWarning, rank_and_world
from ._sources import DataFromGenerator, DataFromIterable, DataFromList, FakeData
from ._speed import TestDataSpeed, collect_stats
from ._state import NotResumableError, StateError, StateMismatchError
from ._transforms import (
    CacheData,
    FilterData,
    FixedSizeData,
    MapData,
    MapDataComponent,
    PrintData,
    RepeatedData,
    RepeatedDataPoint,
    SelectComponent,
)
from .parallel import (
    MultiProcessMapAndBatchData,
    MultiProcessMapAndBatchDataZMQ,
    MultiProcessMapData,
    MultiProcessMapDataZMQ,
    MultiProcessPrefetchData,
    MultiProcessRunner,
    MultiProcessRunnerZMQ,
    MultiThreadMapData,
    MultiThreadRunner,
    OversubscribedWarning,
    PrefetchData,
    PrefetchDataZMQ,
    ThreadedMapData,
    WorkerPool,
)
from .pipeline import iter_flows
from .remote import (
    MessageTooLargeError,
    ProducerError,
    ProducerLostError,
    RayMapData,
    RemoteConnectionError,
    RemoteDataZMQ,
    send_dataflow_zmq,
)
from .serialize import (
    CorruptDataError,
    DatasetChangedError,
    DatasetNotFoundError,
    HDF5Data,
    HDF5Serializer,
    LMDBData,
    LMDBDataDecoder,
    LMDBDataPoint,
    LMDBDataset,
    LMDBSerializer,
    NumpyData,
    NumpySerializer,
    SerializationError,
    TargetExistsError,
    load_dataset,
)

__version__ = "0.1.0"

__all__ = [
    "AugmentImageComponent",
    "AugmentImageComponents",
    "AugmentImageCoordinates",
    "BatchData",
    "BatchDataByShape",
    "BatchError",
    "BridgeflowError",
    "CacheData",
    "ConcatData",
    "CorruptDataError",
    "DataFlow",
    "DataFlowReentrantError",
    "DataFlowTerminated",
    "DataFromGenerator",
    "DataFromIterable",
    "DataFromList",
    "DataFromQueue",
    "DatapointError",
    "DatasetChangedError",
    "DatasetNotFoundError",
    "FakeData",
    "FilterData",
    "FixedSizeData",
    "HDF5Data",
    "HDF5Serializer",
    "ImageFromFile",
    "JoinData",
    "LMDBData",
    "LMDBDataDecoder",
    "LMDBDataPoint",
    "LMDBDataset",
    "LMDBSerializer",
    "LengthUnknownError",
    "LocallyShuffleData",
    "MapData",
    "MapDataComponent",
    "MessageTooLargeError",
    "MissingDependencyError",
    "MultiProcessMapAndBatchData",
    "MultiProcessMapAndBatchDataZMQ",
    "MultiProcessMapData",
    "MultiProcessMapDataZMQ",
    "MultiProcessPrefetchData",
    "MultiProcessRunner",
    "MultiProcessRunnerZMQ",
    "MultiThreadMapData",
    "MultiThreadPrefetchData",
    "MultiThreadRunner",
    "OversubscribedWarning",
    "NotResumableError",
    "NumpyData",
    "NumpySerializer",
    "PrefetchData",
    "PrefetchDataZMQ",
    "PrintData",
    "ProducerError",
    "ProducerLostError",
    "ProxyDataFlow",
    "RNGDataFlow",
    "RandomChooseData",
    "RandomMixData",
    "RayMapData",
    "RemoteConnectionError",
    "RemoteDataZMQ",
    "RepeatedData",
    "RepeatedDataPoint",
    "SelectComponent",
    "SerializationError",
    "ShardData",
    "StateError",
    "StateMismatchError",
    "TargetExistsError",
    "TestDataSpeed",
    "ThreadedMapData",
    "UnbatchData",
    "UnshardedWarning",
    "WorkerError",
    "WorkerPool",
    "WorkerTimeoutError",
    "__version__",
    "as_dataflow",
    "batch_datapoints",
    "collect_stats",
    "get_rng",
    "iter_flows",
    "load_dataset",
    "rank_and_world",
    "sample_scope",
    "send_dataflow_zmq",
    "worker_seed_scope",
]
