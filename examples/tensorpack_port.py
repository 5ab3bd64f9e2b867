"""A tensorpack DataFlow pipeline, ported by changing one import line.

The code below is written the way tensorpack users write it (an ``RNGDataFlow`` subclass with only
``__iter__`` and ``__len__``, ``MapDataComponent``, ``LocallyShuffleData``, ``MultiProcessMapData``,
``BatchData``, ``RepeatedData``, ``TestDataSpeed``, ``reset_state()`` then ``for dp in df``). With
tensorpack the import would read ``from tensorpack.dataflow import ...``; here it reads
``from bridgeflow import ...`` and nothing else changes.

    python examples/tensorpack_port.py
"""

from __future__ import annotations

import numpy as np

from bridgeflow import (
    BatchData,
    DataFromList,
    JoinData,
    LocallyShuffleData,
    MapData,
    MapDataComponent,
    MultiProcessMapData,
    RepeatedData,
    RNGDataFlow,
    SelectComponent,
    TestDataSpeed,
)


class NoisyDigits(RNGDataFlow):
    """A toy MNIST: 28x28 float32 images whose label is the row holding the bright stripe."""

    def __init__(self, size, seed=None):
        self.size = size
        self.seed = seed

    def __len__(self):
        return self.size

    def __iter__(self):
        for _ in range(self.size):
            label = self.rng.randint(10)
            img = self.rng.uniform(0, 0.3, size=(28, 28)).astype("float32")
            img[2 + label * 2] += 0.7
            yield [img, label]


def add_channel(img):
    return img[None, :, :]  # HW -> CHW


def predict_label(dp):
    """What a 'model' on the other side would do: find the stripe again (runs in worker processes)."""
    img, label = dp
    row = int(np.argmax(img[0].mean(axis=1)))
    return [img, label, (row - 2) // 2]


def get_data(batch_size=32, epochs=2):
    ds = NoisyDigits(1024, seed=0)
    ds = MapDataComponent(ds, add_channel, 0)
    ds = LocallyShuffleData(ds, 200)
    ds = MultiProcessMapData(ds, 2, predict_label, buffer_size=128)
    ds = BatchData(ds, batch_size)
    ds = RepeatedData(ds, epochs)
    return ds


def main():
    ds = get_data()
    ds.reset_state()
    n_batches = n_images = n_right = 0
    labels = np.zeros(10, np.int64)
    for img, label, guess in ds:
        assert img.shape == (32, 1, 28, 28) and img.dtype == np.float32
        n_batches += 1
        n_images += len(label)
        n_right += int((label == guess).sum())
        labels += np.bincount(label, minlength=10)
    assert n_batches == len(ds) == 2 * (1024 // 32)
    print(f"{n_batches} batches of 32 over 2 epochs; {n_right}/{n_images} stripes found again "
          f"({n_right / n_images:.1%}); label counts {labels.tolist()}")

    # tensorpack's TestDataSpeed, on the same pipeline: datapoints (here batches) per second
    rate = TestDataSpeed(ds, size=40, warmup=4).start()
    print(f"TestDataSpeed: {rate * 32:,.0f} images/s")
    ds.close()  # bridgeflow addition: stops the worker processes at once

    # JoinData / SelectComponent / MapData, as in tensorpack
    names = DataFromList([[f"sample-{i}"] for i in range(3)], shuffle=False)
    joined = SelectComponent(JoinData([names, NoisyDigits(3, seed=1)]), [0, 2])
    joined = MapData(joined, lambda dp: [dp[0].upper(), int(dp[1])])
    joined.reset_state()
    print("JoinData + SelectComponent + MapData:", list(joined))


if __name__ == "__main__":
    main()
