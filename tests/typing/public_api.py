"""bridgeflow's public API as a user's code sees it, checked by ``mypy --strict`` (tests/test_typing.py).

Written as a user writes a pipeline; each ``assert_type`` pins a return type that user code relies on, so a
change that makes it ``Any`` (or wrong) fails the check. Type-checked only: never imported or run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type  # typing.assert_type is 3.11+; this file is only type-checked

import bridgeflow
from bridgeflow import (
    BatchData,
    DataFlow,
    DataFromList,
    HDF5Data,
    HDF5Serializer,
    LMDBDataset,
    LMDBSerializer,
    MapData,
    MultiProcessMapData,
    TestDataSpeed,
)
from bridgeflow.adapters.tensorflow import QueueInput, Signature, StagingInput, infer_signature, to_tf_dataset
from bridgeflow.adapters.torch import DataLoader


def scale(dp: list[Any]) -> list[Any]:
    image, label = dp
    return [np.asarray(image, np.float32) / 255, label]


def pipeline(items: list[list[Any]]) -> BatchData:
    source = DataFromList(items, shuffle=True, seed=0)
    assert_type(source, DataFromList)
    mapped = MultiProcessMapData(MapData(source, scale), num_proc=2, map_func=scale, buffer_size=64)
    assert_type(mapped, MultiProcessMapData)
    batched = BatchData(mapped, 32, remainder=True)
    assert_type(len(batched), int)
    assert_type(batched.size(), int)  # tensorpack's spelling
    return batched


def iterate(df: DataFlow) -> int:
    df.reset_state()
    n = 0
    with df:
        for dp in df:
            n += len(dp)
    with pipeline([]) as batched:  # a with-block keeps the flow's own type
        assert_type(batched, BatchData)
    return n


def resume(df: DataFlow) -> None:
    state = df.state_dict()
    assert_type(state, dict[str, Any])
    df.load_state_dict(state)
    assert_type(df.stats(), dict[str, dict[str, float]])


def serialize(df: DataFlow, folder: str) -> None:
    count = LMDBSerializer.save(df, f"{folder}/train.lmdb", overwrite=True, progress=False)
    assert_type(count, int)
    lmdb = LMDBSerializer.load(f"{folder}/train.lmdb", shuffle=False)
    assert_type(lmdb, LMDBDataset)
    assert_type(len(lmdb), int)
    HDF5Serializer.save(df, f"{folder}/train.h5", overwrite=True, progress=False)
    h5 = HDF5Serializer.load(f"{folder}/train.h5", shuffle=False)
    assert_type(h5, HDF5Data)
    assert_type(bridgeflow.load_dataset(f"{folder}/train.h5"), DataFlow)


def speed(df: DataFlow) -> float:
    rate = TestDataSpeed(df, size=100, progress=False).start()
    assert_type(rate, float)
    return rate


def batch_arrays(dps: list[list[npt.NDArray[np.float32]]]) -> None:
    batch = bridgeflow.batch_datapoints(dps)
    print(batch)


def torch_loader(df: DataFlow) -> None:
    loader: DataLoader[Any] = DataLoader(df, batch_size=8, num_workers=2)
    for batch in loader:
        print(batch)
    state = loader.state_dict()
    assert_type(state, dict[str, Any])
    loader.load_state_dict(state)


def tensorflow_inputs(df: DataFlow) -> None:
    sig = infer_signature([np.zeros(3, np.float32), 1])
    print(sig)
    with QueueInput(df, queue_size=8, epochs=1) as qi:
        assert_type(qi, QueueInput)
        assert_type(qi.signature, Signature)
        staged = StagingInput(qi)
        assert_type(staged.dequeue(), tuple[Any, ...] | dict[Any, Any])
    print(to_tf_dataset(df))
