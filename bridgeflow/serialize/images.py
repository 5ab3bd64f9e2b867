"""A folder of images in class subfolders as a flow: ``root/<class>/<image>`` -> ``[image, label]``.

Labels are indices into the sorted class folder names. Images are the file's encoded bytes (store them as
they are: smallest on disk, decode at training time), or, with ``decode=True``, a ``uint8`` array decoded
by Pillow (``HxWx3`` RGB by default; ``mode=`` picks another Pillow mode). The flow is a
:class:`~bridgeflow.MapData` over the list of ``[path, label]``, so the reading/decoding stage can be run
in parallel by replacing it with
``MultiProcessMapData(flow.ds, n, flow.func)`` (what ``bridgeflow serialize --workers N`` does).

Example:
    >>> df = image_folder("photos/", decode=False)  # doctest: +SKIP
    >>> df.classes                                  # doctest: +SKIP
    ['cat', 'dog']
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from ..errors import MissingDependencyError
from ..sources import DataFromList
from ..transforms import MapData
from .errors import CorruptDataError, DatasetNotFoundError

__all__ = ["IMAGE_EXTENSIONS", "ImageFolderData", "image_folder", "list_image_folder", "read_image"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


def list_image_folder(root: str | os.PathLike,
                      extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> tuple[list[str], list[list]]:
    """``(classes, [[path, label], ...])`` in a stable order (sorted classes, then sorted file names)."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise DatasetNotFoundError(f"image folder {root} does not exist or is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {root} has no class subfolders (expected {root}/<class>/<image>)")
    items: list[list] = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.lower().endswith(extensions) and not fn.startswith("."):
                    items.append([os.path.join(dirpath, fn), label])
    if not items:
        raise ValueError(f"image folder {root} has class folders {classes} but no image files "
                         f"(extensions {', '.join(extensions)})")
    return classes, items


def read_image(path: str, decode: bool = False, mode: str | None = "RGB") -> bytes | np.ndarray:
    """The file's bytes, or the decoded ``uint8`` array in Pillow ``mode`` (``HxWx3`` for the default
    ``"RGB"``, so one folder gives one rank; ``None`` keeps the file's own mode); errors name the file."""
    if not decode:
        with open(path, "rb") as f:
            return f.read()
    try:
        from PIL import Image
    except ImportError as exc:
        raise MissingDependencyError("decoding images needs Pillow; install it with: pip install pillow") from exc
    try:
        with Image.open(path) as img:
            if mode is not None and img.mode != mode:
                img = img.convert(mode)
            elif img.mode not in ("L", "RGB", "RGBA"):
                img = img.convert("RGBA" if "A" in img.mode or "transparency" in img.info else "RGB")
            return np.array(img, dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise CorruptDataError(f"{path}: cannot decode image ({exc})") from exc


def read_image_datapoint(dp: list, decode: bool = False, mode: str | None = "RGB") -> list:
    """``[path, label]`` -> ``[image, label]`` (module level, so process workers can pickle it)."""
    path, label = dp
    return [read_image(path, decode, mode), label]


class ImageFolderData(MapData):
    """``[image, label]`` datapoints of an image folder (see the module doc); ``.classes`` names the labels."""

    def __init__(self, root: str | os.PathLike, decode: bool = False, shuffle: bool = False,
                 seed: int | None = None, extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                 mode: str | None = "RGB") -> None:
        self.root = os.fspath(root)
        self.classes, self.files = list_image_folder(self.root, extensions)
        self.decode = decode
        super().__init__(DataFromList(self.files, shuffle=shuffle, seed=seed),
                         functools.partial(read_image_datapoint, decode=decode, mode=mode))

    def __getitem__(self, index: int) -> Any:
        return self.func(self.files[index])


image_folder = ImageFolderData  # a function-like alias for scripts
