"""tensorpack's ImageNet input pipeline, ported by changing the import, run on a generated folder of JPEGs.

``fbresnet_augmentor`` and ``get_imagenet_dataflow`` below have the structure, calls and arguments of
tensorpack's examples/ImageNetModels/imagenet_utils.py: with tensorpack the import line reads
``from tensorpack.dataflow import ...``; here it reads ``from bridgeflow.dataflow import ...``.

- train: ``dataset.ILSVRC12`` (decoded BGR images, shuffled), ``AugmentImageComponent`` with the
  Inception crop, colour jitter in random order, PCA lighting and a flip, ``MultiProcessRunnerZMQ``
  workers, ``BatchData``;
- val: ``dataset.ILSVRC12Files`` (file names), ``ResizeShortestEdge`` + ``CenterCrop`` applied in a
  ``MultiThreadMapData`` stage, ``BatchData(remainder=True)``, one ``MultiProcessRunnerZMQ`` worker;
- evaluation: ``StagingInput(QueueInput(val))`` and one step per batch, ``for _ in range(df.size())``,
  the loop of tensorpack's ``eval_on_ILSVRC12``.

The data is a small fake ILSVRC12 (``dataset.write_fake_ilsvrc12``) with its metadata where tensorpack
looks for it: ``$TENSORPACK_DATASET/ilsvrc_metadata``.

    python examples/tensorpack_imagenet.py
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile

import cv2
import numpy as np

from bridgeflow.dataflow import (
    AugmentImageComponent,
    BatchData,
    MultiProcessRunnerZMQ,
    MultiThreadMapData,
    TestDataSpeed,
    dataset,
    imgaug,
)

log = logging.getLogger("tensorpack_imagenet")

# ====== tensorpack's code: only the import above differs ======================================


def fbresnet_augmentor(isTrain):
    """The augmentation of fb.resnet.torch, for BGR images in [0, 255]."""
    interpolation = cv2.INTER_CUBIC
    if isTrain:
        augmentors = [
            imgaug.GoogleNetRandomCropAndResize(interp=interpolation),
            imgaug.RandomOrderAug(
                [imgaug.BrightnessScale((0.6, 1.4), clip=False),
                 imgaug.Contrast((0.6, 1.4), rgb=False, clip=False),
                 imgaug.Saturation(0.4, rgb=False),
                 # fb.resnet.torch's PCA constants are for RGB: reversed for BGR
                 imgaug.Lighting(0.1,
                                 eigval=np.asarray([0.2175, 0.0188, 0.0045][::-1]) * 255.0,
                                 eigvec=np.array([[-0.5675, 0.7192, 0.4009],
                                                  [-0.5808, -0.0045, -0.8140],
                                                  [-0.5836, -0.6948, 0.4203]], dtype="float32")[::-1, ::-1])]),
            imgaug.Flip(horiz=True),
        ]
    else:
        augmentors = [
            imgaug.ResizeShortestEdge(256, interp=interpolation),
            imgaug.CenterCrop((224, 224)),
        ]
    return augmentors


def get_imagenet_dataflow(datadir, name, batch_size, augmentors=None, parallel=None):
    """A DataFlow of BGR image batches and labels."""
    assert name in ["train", "val", "test"]
    isTrain = name == "train"
    assert datadir is not None
    if augmentors is None:
        augmentors = fbresnet_augmentor(isTrain)
    assert isinstance(augmentors, list)
    if parallel is None:
        parallel = min(40, multiprocessing.cpu_count() // 2)  # assuming hyperthreading

    if isTrain:
        ds = dataset.ILSVRC12(datadir, name, shuffle=True)
        ds = AugmentImageComponent(ds, augmentors, copy=False)
        ds = MultiProcessRunnerZMQ(ds, parallel)
        ds = BatchData(ds, batch_size, remainder=False)
    else:
        ds = dataset.ILSVRC12Files(datadir, name, shuffle=False)
        aug = imgaug.AugmentorList(augmentors)

        def mapf(dp):
            fname, cls = dp
            im = cv2.imread(fname, cv2.IMREAD_COLOR)
            im = aug.augment(im)
            return im, cls

        ds = MultiThreadMapData(ds, parallel, mapf, buffer_size=2000, strict=True)
        ds = BatchData(ds, batch_size, remainder=True)
        ds = MultiProcessRunnerZMQ(ds, 1)
    return ds


# ====== the driver: generated data, checks, and tensorpack's evaluation loop ====================


def evaluate(df):
    """tensorpack's eval_on_ILSVRC12 loop shape: StagingInput(QueueInput(df)), one step per batch."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from bridgeflow.adapters.tensorflow import QueueInput, StagingInput

    si = StagingInput(QueueInput(df))

    @tf.function
    def pred():
        image, label = si.dequeue()
        # a stand-in "model": the mean colour; return the labels to check what was evaluated
        return tf.reduce_mean(tf.cast(image, tf.float32), axis=[1, 2]), label

    labels = []
    with si:
        for _ in range(df.size()):
            _, label = pred()
            labels += label.numpy().tolist()
    return labels


def main(root: str) -> None:
    datadir = os.path.join(root, "ilsvrc12")
    os.environ["TENSORPACK_DATASET"] = root  # where tensorpack (and bridgeflow) look for ilsvrc_metadata
    dataset.write_fake_ilsvrc12(datadir, classes=4, train_per_class=6, val=10,
                                meta_dir=os.path.join(root, "ilsvrc_metadata"))

    train = get_imagenet_dataflow(datadir, "train", batch_size=8)
    with train:
        train.reset_state()
        for epoch in range(2):
            n = 0
            for images, labels in train:
                assert images.shape == (8, 224, 224, 3) and images.dtype == np.uint8, images.shape
                assert labels.shape == (8,) and set(labels.tolist()) <= {0, 1, 2, 3}
                n += 1
            assert n == len(train) == 3, n
            log.info("train epoch %d: %d batches of 8 augmented 224x224 BGR images", epoch, n)
        rate = TestDataSpeed(train, size=6, warmup=1, progress=False).start()
        log.info("train pipeline: %.1f batches/s", rate)

    with open(os.path.join(root, "ilsvrc_metadata", "val.txt")) as f:
        expected = [int(line.split()[1]) for line in f if line.strip()]
    val = get_imagenet_dataflow(datadir, "val", batch_size=4)
    with val:
        val.reset_state()
        batches = list(val)
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert [int(v) for b in batches for v in b[1]] == expected, "val labels must keep the file order"
    assert all(b[0].shape[1:] == (224, 224, 3) for b in batches)

    labels = evaluate(get_imagenet_dataflow(datadir, "val", batch_size=4))
    assert labels == expected, (labels, expected)
    print(f"train: 2 epochs of {len(train)} batches; val: {len(expected)} images in {len(batches)} batches, "
          f"evaluated once each through StagingInput(QueueInput(df))")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        main(tmp)
