"""tensorpack's ImageNet and CIFAR example pipelines, ported by changing the import, on generated data.

The ImageNet one is examples/tensorpack_imagenet.py (train and val dataflows, and the evaluation loop
over StagingInput(QueueInput(df))); the CIFAR one is tests/tensorpack_cifar_port.py.
"""

from __future__ import annotations

import ast
import importlib.util
import os

import numpy as np
import pytest

from bridgeflow.dataflow import dataset
from conftest import need, source_tree

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(source_tree(), "examples", "tensorpack_imagenet.py")


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ported_code_imports_only_bridgeflow_dataflow():
    tree = ast.parse(open(EXAMPLE).read())
    imports = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module.startswith("bridgeflow")]
    assert imports == ["bridgeflow.dataflow"]
    funcs = {n.name: ast.get_source_segment(open(EXAMPLE).read(), n) for n in tree.body
             if isinstance(n, ast.FunctionDef)}
    assert "bridgeflow" not in funcs["fbresnet_augmentor"] + funcs["get_imagenet_dataflow"]


def test_imagenet_pipeline(tmp_path, monkeypatch, leak_check):
    need("tensorflow")  # its evaluation runs StagingInput(QueueInput(df))
    monkeypatch.setenv("TENSORPACK_DATASET", str(tmp_path))
    load(EXAMPLE, "tensorpack_imagenet").main(str(tmp_path))  # asserts shapes, epochs, order, evaluation


def test_imagenet_train_augmentation_differs_between_epochs(tmp_path, monkeypatch, leak_check):
    example = load(EXAMPLE, "tensorpack_imagenet")
    datadir = dataset.write_fake_ilsvrc12(str(tmp_path / "d"), classes=2, train_per_class=4, val=2,
                                          meta_dir=str(tmp_path / "ilsvrc_metadata"))
    monkeypatch.setenv("TENSORPACK_DATASET", str(tmp_path))
    df = example.get_imagenet_dataflow(datadir, "train", batch_size=8, parallel=2)
    with df:
        df.reset_state()
        a, b = (next(iter(df))[0] for _ in range(2))
    assert a.shape == (8, 224, 224, 3) and not np.array_equal(a, b)


@pytest.fixture
def cifar(tmp_path, monkeypatch):
    root = tmp_path / "tp_data"
    dataset.write_fake_cifar(str(root / "cifar10_data"), per_batch=30)
    monkeypatch.setenv("TENSORPACK_DATASET", str(root))
    return load(os.path.join(HERE, "tensorpack_cifar_port.py"), "tensorpack_cifar_port")


def test_cifar_pipeline(cifar, leak_check):
    train = cifar.get_data("train")
    assert (train.num_prefetch, train.num_workers) == (3, 2)  # tensorpack's MultiProcessRunner(ds, 3, 2)
    with train:
        train.reset_state()
        batches = [b for _ in range(3) for b in train]  # 150 images: one batch of 128 per epoch
    assert len(batches) == 3
    for images, labels in batches:
        assert images.shape == (128, 32, 32, 3) and images.dtype == np.float32 and labels.shape == (128,)
    test = cifar.get_data("test")
    test.reset_state()
    (images, labels), = list(test)  # 30 images, remainder kept, in file order
    raw = dataset.Cifar10("test", allow_pickle=True, shuffle=False)
    mean = dataset.Cifar10("train", allow_pickle=True).get_per_pixel_mean(("train",))
    expected = np.stack([img for img, _ in raw]).astype(np.float32) - mean
    np.testing.assert_allclose(images, expected, rtol=0, atol=1e-4)
    assert labels.tolist() == [label for _, label in raw]
