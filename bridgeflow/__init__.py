"""bridgeflow: length-free DataFlows that keep TensorFlow and PyTorch accelerators fed.

Data is any Python iterator of datapoints (lists or dicts of components). Sources, transforms,
parallel stages and batching are separate wrappers that compose; adapters in ``bridgeflow.adapters``
hand the result to PyTorch or TensorFlow while the model trains.

Importing bridgeflow loads only numpy and the standard library.
"""

from .augment import AugmentImageComponent, AugmentImageComponents, AugmentImageCoordinates
from .base import DataFlow
from .batch import BatchData, BatchDataByShape, UnbatchData, batch_datapoints
from .combine import ConcatData, JoinData, LocallyShuffleData, RandomChooseData, RandomMixData
from .errors import (
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
from .image_sources import ImageFromFile
from .iterables import as_dataflow
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
from .proxy import ProxyDataFlow
from .queues import DataFromQueue, MultiThreadPrefetchData
from .remote import (
    MessageTooLargeError,
    ProducerError,
    ProducerLostError,
    RayMapData,
    RemoteConnectionError,
    RemoteDataZMQ,
    send_dataflow_zmq,
)
from .rng import RNGDataFlow, get_rng, worker_seed_scope
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
from .shard import ShardData, UnshardedWarning, rank_and_world
from .sources import DataFromGenerator, DataFromIterable, DataFromList, FakeData
from .speed import TestDataSpeed, collect_stats
from .state import NotResumableError, StateError, StateMismatchError
from .transforms import (
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
    "send_dataflow_zmq",
    "worker_seed_scope",
]
