"""Small fake copies of ILSVRC12 and CIFAR, laid out like the real ones, to try pipelines and test them.

Example:
    >>> from bridgeflow.dataset import ILSVRC12Files
    >>> root = write_fake_ilsvrc12("fake_imagenet", classes=3, train_per_class=4, val=6)
    >>> df = ILSVRC12Files(root, "train", meta_dir=os.path.join(root, "meta"))
    >>> len(df)
    12
"""

from __future__ import annotations

import os
import pickle

import numpy as np

from ..imgaug._transform import cv2

__all__ = ["write_fake_cifar", "write_fake_ilsvrc12"]


def _image(rng: np.random.RandomState, label: int, size: tuple[int, int]) -> np.ndarray:
    """A noisy image whose mean colour encodes the label (BGR)."""
    h, w = size
    base = np.array([(37 * label) % 200, (91 * label) % 200, (53 * label) % 200], np.float32) + 30
    noise = rng.randint(-20, 21, size=(h, w, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def write_fake_ilsvrc12(dir: str, classes: int = 4, train_per_class: int = 5, val: int = 8,
                        size_range: tuple[int, int] = (40, 72), seed: int = 0, meta_dir: str | None = None) -> str:
    """Write JPEGs under ``dir/train/<synset>/`` and ``dir/val/``, and Caffe-style metadata under
    ``meta_dir`` (default ``dir/meta``: synsets.txt, synset_words.txt, train.txt, val.txt). Image sizes
    are random in ``size_range``; an image's mean colour follows its label. Returns ``dir``."""
    c = cv2()
    rng = np.random.RandomState(seed)
    meta = meta_dir or os.path.join(dir, "meta")
    os.makedirs(meta, exist_ok=True)
    synsets = [f"n{10000000 + 1117 * k:08d}" for k in range(classes)]

    def size() -> tuple[int, int]:
        return int(rng.randint(*size_range)), int(rng.randint(*size_range))

    train_lines = []
    for label, syn in enumerate(synsets):
        os.makedirs(os.path.join(dir, "train", syn), exist_ok=True)
        for j in range(train_per_class):
            rel = f"{syn}/{syn}_{j}.JPEG"
            c.imwrite(os.path.join(dir, "train", rel), _image(rng, label, size()))
            train_lines.append(f"{rel} {label}")
    os.makedirs(os.path.join(dir, "val"), exist_ok=True)
    val_lines = []
    for i in range(val):
        label = int(rng.randint(classes))
        name = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
        c.imwrite(os.path.join(dir, "val", name), _image(rng, label, size()))
        val_lines.append(f"{name} {label}")
    for name, lines in (("synsets.txt", synsets), ("synset_words.txt", [f"{s} fake class {k}" for k, s in
                                                                        enumerate(synsets)]),
                        ("train.txt", train_lines), ("val.txt", val_lines)):
        with open(os.path.join(meta, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    return dir


def write_fake_cifar(dir: str, cifar_classnum: int = 10, per_batch: int = 6, seed: int = 0) -> str:
    """Write CIFAR python batches (pickles, as the official archive has them) of ``per_batch`` images.

    Pixel ``(y, x)`` of image ``i`` in a batch is ``(R, G, B) = (label * 20, i, (y * 32 + x) % 256)``, so
    the layout of the stored planes can be checked. Returns ``dir``.
    """
    rng = np.random.RandomState(seed)
    folder = os.path.join(dir, "cifar-10-batches-py" if cifar_classnum == 10 else "cifar-100-python")
    os.makedirs(folder, exist_ok=True)
    label_key = b"labels" if cifar_classnum == 10 else b"fine_labels"

    def batch(n: int) -> dict:
        labels = rng.randint(min(cifar_classnum, 12), size=n).tolist()
        data = np.empty((n, 3, 32, 32), np.uint8)
        for i, label in enumerate(labels):
            data[i, 0], data[i, 1] = label * 20, i
            data[i, 2] = np.arange(32 * 32).reshape(32, 32) % 256
        return {b"data": data.reshape(n, 3072), label_key: labels, b"filenames": [b"x.png"] * n}

    names = ([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]) if cifar_classnum == 10 else ["train", "test"]
    for name in names:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch(per_batch), f)
    meta_name, key = ("batches.meta", b"label_names") if cifar_classnum == 10 else ("meta", b"fine_label_names")
    with open(os.path.join(folder, meta_name), "wb") as f:
        pickle.dump({key: [f"class{k}".encode() for k in range(cifar_classnum)]}, f)
    return dir
