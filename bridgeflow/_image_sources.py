"""ImageFromFile: images decoded from a list of files, as tensorpack's flow of that name.

Decoding is OpenCV's (``cv2.imread``; the "images" extra: ``pip install "opencv-python-headless>=4.5"
"pillow>=9"``). A file that is missing or that OpenCV cannot decode raises an error naming it: no datapoint is
skipped silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._order import IndexedSource
from .imgaug._geometry import shape2d
from .imgaug._transform import cv2

__all__ = ["ImageFromFile", "read_image"]


def read_image(path: str, flags: int | None = None) -> np.ndarray:
    """``cv2.imread(path, flags)`` (colour BGR by default), or an error naming the file and the cause."""
    c = cv2()
    img = c.imread(os.fspath(path), c.IMREAD_COLOR if flags is None else flags)
    if img is None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"image file {path} does not exist")
        raise ValueError(f"OpenCV could not decode the image file {path} (not an image, or truncated)")
    return img


class ImageFromFile(IndexedSource):
    """Yield ``[image]`` for each file: ``(h, w, 3)`` RGB uint8 with ``channel=3``, ``(h, w, 1)`` grey with
    ``channel=1``; resized to ``resize`` (an int or ``(h, w)``) when given; in a new random order every
    epoch with ``shuffle=True``. ``shard=(rank, world)`` or ``"auto"`` reads this rank's part of every
    epoch (see :mod:`bridgeflow._shard`); its state is the epoch and the position in it.

    Example:
        >>> import cv2
        >>> cv2.imwrite("photo.png", np.zeros((480, 640, 3), np.uint8))
        True
        >>> df = ImageFromFile(["photo.png"], resize=(224, 224))
        >>> df.reset_state(); next(iter(df))[0].shape
        (224, 224, 3)
    """

    def __init__(self, files: Sequence[str], channel: int = 3, resize: Any = None, shuffle: bool = False,
                 seed: int | None = None, *, shard: tuple[int, int] | str | None = None,
                 drop_last: bool = False) -> None:
        if isinstance(files, (str, bytes)) or not len(files):
            raise ValueError(f"ImageFromFile needs a non-empty list of image files, got {files!r}")
        if int(channel) not in (1, 3):
            raise ValueError(f"ImageFromFile channel must be 1 or 3, got {channel!r}")
        self.files = list(files)
        self.channel = int(channel)
        self.resize = None if resize is None else shape2d(resize, "ImageFromFile resize")
        self.shuffle = shuffle
        self.seed = seed
        self._init_order(len(self.files), shuffle, shard, drop_last)

    def _identity(self) -> dict:
        return {"files": len(self.files)}

    def _read(self, runs: list, pos: int) -> Iterator[list]:
        c = cv2()
        flags = c.IMREAD_GRAYSCALE if self.channel == 1 else c.IMREAD_COLOR
        for it, _, _ in self._order.iters(runs, pos):
            for i in it:
                img = read_image(self.files[i], flags)
                if self.resize is not None:
                    img = c.resize(img, (self.resize[1], self.resize[0]))
                if self.channel == 3:
                    img = img[:, :, ::-1]  # OpenCV decodes BGR
                else:
                    img = img.reshape(img.shape[0], img.shape[1], 1)
                yield [np.ascontiguousarray(img)]
