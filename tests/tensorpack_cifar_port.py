"""tensorpack's CIFAR-10 input pipeline (examples/ResNet/cifar10-resnet.py, get_data), ported.

With tensorpack the imports read ``from tensorpack import *`` and ``from tensorpack.dataflow import
dataset``. One line differs besides the imports, marked PORT: CIFAR's python batches are pickles, which
bridgeflow reads only when told: ``allow_pickle=True``. ``MultiProcessRunner(ds, 3, 2)`` is tensorpack's
line as it is (two processes, three datapoints prefetched).

tests/test_tensorpack_examples.py runs it on a generated copy of CIFAR-10 found through
``$TENSORPACK_DATASET``, as tensorpack finds it.
"""

from bridgeflow.dataflow import *  # noqa: F403
from bridgeflow.dataflow import dataset

BATCH_SIZE = 128


def get_data(train_or_test):
    isTrain = train_or_test == "train"
    ds = dataset.Cifar10(train_or_test, allow_pickle=True)  # PORT: allow_pickle=True
    pp_mean = ds.get_per_pixel_mean(("train",))
    if isTrain:
        augmentors = [
            imgaug.CenterPaste((40, 40)),  # noqa: F405
            imgaug.RandomCrop((32, 32)),  # noqa: F405
            imgaug.Flip(horiz=True),  # noqa: F405
            imgaug.MapImage(lambda x: x - pp_mean),  # noqa: F405
        ]
    else:
        augmentors = [
            imgaug.MapImage(lambda x: x - pp_mean)  # noqa: F405
        ]
    ds = AugmentImageComponent(ds, augmentors)  # noqa: F405
    ds = BatchData(ds, BATCH_SIZE, remainder=not isTrain)  # noqa: F405
    if isTrain:
        ds = MultiProcessRunner(ds, 3, 2)  # noqa: F405
    return ds
