"""dataset.ILSVRC12Files / ILSVRC12 / Cifar10 / Cifar100 over generated copies laid out like the real ones."""

from __future__ import annotations

import os
import shutil

import cv2
import numpy as np
import pytest

from bridgeflow.dataflow import dataset
from bridgeflow.serialize import PickleNotAllowedError
from bridgeflow.testing import check_dataflow


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    return dataset.write_fake_ilsvrc12(str(tmp_path_factory.mktemp("ilsvrc")), classes=3, train_per_class=4, val=5)


def meta(root):
    return os.path.join(root, "meta")


def read_list(root, name):
    with open(os.path.join(meta(root), f"{name}.txt")) as f:
        return [(a, int(b)) for a, b in (line.split() for line in f if line.strip())]


def test_ilsvrc12_files_train_and_val(imagenet):
    train = dataset.ILSVRC12Files(imagenet, "train", meta_dir=meta(imagenet), shuffle=False)
    got = check_dataflow(train)
    listed = read_list(imagenet, "train")
    assert got == [[os.path.join(imagenet, "train", f), label] for f, label in listed]
    assert {label for _, label in got} == {0, 1, 2}
    synsets = dataset.ILSVRCMeta(meta(imagenet)).get_synset_1000()
    assert all(os.path.basename(os.path.dirname(f)) == synsets[label] for f, label in got)
    val = dataset.ILSVRC12Files(imagenet, "val", meta_dir=meta(imagenet))
    assert not val.shuffle and train.shuffle is False
    assert list(val) == [[os.path.join(imagenet, "val", f), label] for f, label in read_list(imagenet, "val")]
    shuffled = dataset.ILSVRC12Files(imagenet, "train", meta_dir=meta(imagenet), seed=0)
    assert shuffled.shuffle
    shuffled.reset_state()
    epochs = [list(shuffled), list(shuffled)]
    assert sorted(epochs[0]) == sorted(got) and epochs[0] != epochs[1]


def test_ilsvrc12_images_are_bgr_arrays_with_their_labels(imagenet):
    df = dataset.ILSVRC12(imagenet, "train", meta_dir=meta(imagenet), shuffle=False)
    for (img, label), (fname, _) in zip(df, read_list(imagenet, "train")):
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
        np.testing.assert_array_equal(img, cv2.imread(os.path.join(imagenet, "train", fname)))
        assert isinstance(label, int)


def test_val_in_synset_folders_is_detected(imagenet, tmp_path):
    root = str(tmp_path / "nested")
    shutil.copytree(imagenet, root)
    synsets = dataset.ILSVRCMeta(meta(root)).get_synset_1000()
    for fname, label in read_list(root, "val"):
        os.makedirs(os.path.join(root, "val", synsets[label]), exist_ok=True)
        os.rename(os.path.join(root, "val", fname), os.path.join(root, "val", synsets[label], fname))
    got = list(dataset.ILSVRC12Files(root, "val", meta_dir=meta(root)))
    assert [label for _, label in got] == [label for _, label in read_list(root, "val")]
    assert all(os.path.isfile(f) and os.path.basename(os.path.dirname(f)) == synsets[label] for f, label in got)


def test_tensorpack_default_meta_dir(imagenet, tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORPACK_DATASET", str(tmp_path))
    with pytest.raises(dataset.DatasetFilesMissingError, match="ilsvrc_metadata not found.*caffe_ilsvrc12"):
        dataset.ILSVRC12Files(imagenet, "val")
    shutil.copytree(meta(imagenet), tmp_path / "ilsvrc_metadata")
    assert len(dataset.ILSVRC12Files(imagenet, "val")) == 5


def test_missing_pieces_are_named(imagenet, tmp_path):
    with pytest.raises(dataset.DatasetFilesMissingError, match=r"folder .*test not found.*ILSVRC2012_img_test"):
        dataset.ILSVRC12Files(imagenet, "test", meta_dir=meta(imagenet))
    with pytest.raises(dataset.DatasetFilesMissingError, match="nowhere not found"):
        dataset.ILSVRC12Files(str(tmp_path / "nowhere"), "train", meta_dir=meta(imagenet))
    os.makedirs(tmp_path / "empty_meta")
    with pytest.raises(dataset.DatasetFilesMissingError, match=r"train\.txt not found.*caffe_ilsvrc12\.tar\.gz"):
        dataset.ILSVRC12Files(imagenet, "train", meta_dir=str(tmp_path / "empty_meta"))
    with pytest.raises(ValueError, match="name must be one of"):
        dataset.ILSVRC12Files(imagenet, "training", meta_dir=meta(imagenet))
    broken = str(tmp_path / "broken")
    shutil.copytree(imagenet, broken)
    first = read_list(broken, "train")[0][0]
    os.remove(os.path.join(broken, "train", first))
    with pytest.raises(dataset.DatasetFilesMissingError, match=first.split("/")[1]):
        dataset.ILSVRC12Files(broken, "train", meta_dir=meta(broken))
    last = read_list(broken, "train")[-1][0]  # beyond the first ten: found when read
    with open(os.path.join(broken, "train", last), "wb") as f:
        f.write(b"truncated")
    with open(os.path.join(meta(broken), "train.txt")) as f:
        lines = f.read().splitlines()
    with open(os.path.join(meta(broken), "train.txt"), "w") as f:
        f.write("\n".join(lines[1:]) + "\n")
    with pytest.raises(ValueError, match=f"could not decode .*{os.path.basename(last)}"):
        list(dataset.ILSVRC12(broken, "train", meta_dir=meta(broken), shuffle=False))
    with open(os.path.join(meta(broken), "val.txt"), "a") as f:
        f.write("only_a_name\n")
    with pytest.raises(ValueError, match=r"val\.txt line 6: expected '<image path> <label>'"):
        dataset.ILSVRC12Files(broken, "val", meta_dir=meta(broken))


@pytest.mark.parametrize("classnum", [10, 100])
def test_cifar_layout_and_labels(tmp_path, classnum):
    root = dataset.write_fake_cifar(str(tmp_path), cifar_classnum=classnum, per_batch=4)
    cls = dataset.Cifar10 if classnum == 10 else dataset.Cifar100
    train = cls("train", shuffle=False, dir=root, allow_pickle=True)
    got = check_dataflow(train)
    assert len(got) == (20 if classnum == 10 else 4)
    for k, (img, label) in enumerate(got):
        assert img.shape == (32, 32, 3) and img.dtype == np.uint8 and isinstance(label, int)
        i = k % 4  # index inside its batch
        np.testing.assert_array_equal(img[..., 0], label * 20)  # R plane
        np.testing.assert_array_equal(img[..., 1], i)  # G plane
        assert img[1, 2, 2] == 34 and img[0, 5, 2] == 5  # B: (y * 32 + x) % 256, so rows are rows
    test = cls("test", dir=root, allow_pickle=True)
    assert len(test) == 4 and not test.shuffle and train.train_or_test == "train"
    names = train.get_label_names()
    assert len(names) == classnum and names[3] == "class3"
    mean = train.get_per_pixel_mean(("train",))
    np.testing.assert_allclose(mean, np.mean([img for img, _ in got], axis=0).astype(np.float32), rtol=1e-6)
    both = train.get_per_pixel_mean()
    assert both.shape == (32, 32, 3) and both.dtype == np.float32
    np.testing.assert_allclose(train.get_per_channel_mean(("train",)), mean.mean(axis=(0, 1)), rtol=1e-6)


def test_cifar_refuses_pickle_unless_allowed_and_names_missing_files(tmp_path, monkeypatch):
    root = dataset.write_fake_cifar(str(tmp_path / "c"), per_batch=2)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        dataset.Cifar10("train", dir=root)
    monkeypatch.setenv("TENSORPACK_DATASET", str(tmp_path / "elsewhere"))
    with pytest.raises(dataset.DatasetFilesMissingError,
                       match=r"cifar10_data/cifar-10-batches-py/data_batch_1 not found.*cifar-10-python\.tar\.gz"):
        dataset.Cifar10("train", allow_pickle=True)
    os.makedirs(tmp_path / "elsewhere")
    shutil.copytree(root, tmp_path / "elsewhere" / "cifar10_data")
    assert len(dataset.Cifar10("train", allow_pickle=True)) == 10  # tensorpack's default place
    with pytest.raises(ValueError, match="'train' or 'test'"):
        dataset.Cifar10("val", dir=root, allow_pickle=True)


def test_cifar_images_cannot_be_changed_in_place(tmp_path):
    df = dataset.Cifar10("test", dir=dataset.write_fake_cifar(str(tmp_path), per_batch=2), allow_pickle=True)
    img, _ = next(iter(df))
    with pytest.raises(ValueError, match="read-only"):
        img += 1


def test_datasets_resume_and_shard(imagenet):
    from bridgeflow.testing import check_resumable

    check_resumable(lambda: dataset.ILSVRC12Files(imagenet, "train", meta_dir=meta(imagenet), seed=1))
    check_resumable(lambda: dataset.ILSVRC12(imagenet, "val", meta_dir=meta(imagenet), shuffle=True, seed=2),
                    positions=[0, 2, 5])
    whole = sorted(map(tuple, dataset.ILSVRC12Files(imagenet, "train", meta_dir=meta(imagenet), shuffle=False)))
    parts = [list(dataset.ILSVRC12Files(imagenet, "train", meta_dir=meta(imagenet), seed=5, shard=(r, 3)))
             for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(tuple(dp) for p in parts for dp in p) == whole


def test_cifar_resumes(tmp_path):
    root = dataset.write_fake_cifar(str(tmp_path), 10, per_batch=3)
    from bridgeflow.testing import check_resumable

    check_resumable(lambda: dataset.Cifar10("train", dir=root, allow_pickle=True, seed=4), positions=[0, 5, 15])
