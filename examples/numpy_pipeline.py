"""A numpy-only input pipeline: source -> shuffle -> augment -> filter -> batch, measured stage by stage.

Nothing here needs a framework: the batches are plain numpy arrays, ready for any training loop.
Runs in a few seconds:

    python examples/numpy_pipeline.py
"""

from __future__ import annotations

import io
import time

import numpy as np

from bridgeflow import (
    BatchData,
    DataFromList,
    FilterData,
    LocallyShuffleData,
    MapData,
    MultiThreadMapData,
    TestDataSpeed,
    get_rng,
)

NUM_IMAGES = 4096
BATCH = 64


def make_records(n: int, seed: int = 0) -> list[dict]:
    """A small in-memory 'dataset': 40x40 RGB uint8 images with a label and an id."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 40, 40, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n)
    return [{"image": images[i], "label": int(labels[i]), "id": f"img{i:05d}"} for i in range(n)]


class Augment:
    """Random 32x32 crop, random horizontal flip, HWC -> CHW float32 normalised to [-1, 1]."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = get_rng(self, seed)

    def __call__(self, dp: dict) -> dict:
        img = dp["image"]
        y, x = self.rng.randint(0, img.shape[0] - 32 + 1, size=2)
        img = img[y:y + 32, x:x + 32]
        if self.rng.randint(2):
            img = img[:, ::-1]
        chw = np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.float32)
        chw *= 2 / 255.0
        chw -= 1.0
        return {**dp, "image": chw}


def keep(dp: dict) -> bool:
    return dp["label"] != 9  # drop one class, as a stand-in for any data cleaning rule


def pipeline(records: list[dict], threads: int = 0) -> BatchData:
    df = DataFromList(records, shuffle=True, seed=0)
    df = LocallyShuffleData(df, buffer_size=256, seed=0, one_pass=True)  # every image once per epoch
    df = MultiThreadMapData(df, threads, Augment()) if threads else MapData(df, Augment())
    df = FilterData(df, keep)
    return BatchData(df, BATCH, remainder=True)


def main() -> None:
    records = make_records(NUM_IMAGES)
    with pipeline(records) as df:
        df.reset_state()
        first = next(iter(df))
        print("one batch:", {k: (v.shape, str(v.dtype)) if isinstance(v, np.ndarray) else f"list of {len(v)}"
                             for k, v in first.items()})
        assert first["image"].shape == (BATCH, 3, 32, 32) and first["image"].dtype == np.float32
        assert 9 not in first["label"] and first["label"].dtype == np.int64

        t0 = time.perf_counter()
        batches = list(df)
        seen = sum(len(b["label"]) for b in batches)
        elapsed = time.perf_counter() - t0
        kept = sum(r["label"] != 9 for r in records)
        assert seen == kept, (seen, kept)
        print(f"one epoch: {len(batches)} batches, {seen} of {NUM_IMAGES} images kept, "
              f"{seen / elapsed:,.0f} images/s in this process")

    with pipeline(records, threads=2) as df:
        summary = io.StringIO()
        rate = TestDataSpeed(df, size=40, warmup=5, progress=False, file=summary).start()
        print(f"with 2 map threads: {rate * BATCH:,.0f} images/s ({rate:,.1f} batches/s)")
        print(summary.getvalue().rstrip())


if __name__ == "__main__":
    main()
