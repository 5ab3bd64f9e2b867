"""A folder of images in class subfolders as a flow: ``root/<class>/<image>`` -> ``[image, label]``.

Labels are indices into the sorted class folder names (``.classes``; the serializers store them in the
file). Images are the file's encoded bytes as a 1-D ``uint8`` array (store them as they are: smallest on
disk, decode at training time with ``cv2.imdecode(img, cv2.IMREAD_COLOR)``, the tensorpack idiom, which
needs an array; ``encoded="bytes"`` gives ``bytes`` instead, as bridgeflow did before), or, with
``decode=True``, a ``uint8`` array decoded by Pillow (``HxWx3`` RGB by default; ``mode=`` picks another
Pillow mode). Files without an image extension are skipped and counted (``.skipped``), or refused with
``non_images="error"``. A file named like an image may still not decode (a truncated JPEG, or no image at
all): ``bad_images="error"`` checks that every image decodes (with Pillow; JPEGs at 1/8 scale, which reads
the whole stream but costs about 2/3 of a full decode) and refuses the first that does not, naming it;
``bad_images="skip"`` leaves such images out, each logged as a warning naming the file (from the worker
that read it). The default, ``None``, stores the file's bytes unchecked, after a look at their first bytes
(JPEG, PNG, GIF, BMP, TIFF, WebP, PPM/PGM): a file named like an image that does not start like one is
skipped as a non-image (``decode=True`` always decodes, so an image that does not decode raises, or with
``"skip"`` is left out). ``bridgeflow serialize`` checks by default. A root holding only
``train``/``val``/``test`` folders is refused: those are splits, not classes (pass ``split="train"``, or the
split's folder). The flow is a :class:`~bridgeflow.MapData` over the list of ``[path, label]``, so the
reading/decoding stage can be run in parallel by replacing it with ``MultiProcessMapData(flow.ds, n,
flow.func)`` (what ``bridgeflow serialize --workers N`` does).

Example:
    >>> from PIL import Image
    >>> for label in ("cat", "dog"):
    ...     os.makedirs(f"photos/{label}")
    ...     Image.new("RGB", (4, 3)).save(f"photos/{label}/1.png")
    >>> df = image_folder("photos/", decode=False)
    >>> df.classes, len(df)
    (['cat', 'dog'], 2)
    >>> df.reset_state(); img, label = next(iter(df))
    >>> img.dtype, label  # the PNG file's bytes
    (dtype('uint8'), 0)
"""

from __future__ import annotations

import functools
import io
import logging
import os
from typing import Any

import numpy as np

from .._deps import require
from .._errors import MissingDependencyError
from .._serialize_errors import CorruptDataError, DatasetNotFoundError
from .._sources import DataFromList
from .._transforms import MapData

__all__ = ["IMAGE_EXTENSIONS", "ImageFolderData", "check_decodes", "image_folder", "is_image_file",
           "list_image_folder", "read_image"]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing"})
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")


def is_image_file(path: str) -> bool:
    """Whether the file starts like an image of one of :data:`IMAGE_EXTENSIONS`' formats."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError:
        return False
    if head.startswith(_MAGIC):
        return True
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    return len(head) >= 3 and head[0:1] == b"P" and head[1:2] in b"123456" and head[2:3].isspace()


def list_image_folder(root: str | os.PathLike, extensions: tuple[str, ...] = IMAGE_EXTENSIONS, *,
                      non_images: str = "skip", split: str | None = None,
                      skipped: list[str] | None = None, by_content: bool = True) -> tuple[list[str], list[list]]:
    """``(classes, [[path, label], ...])`` in a stable order (sorted classes, then sorted file names).

    Files that are not images (by extension, then, with ``by_content``, by their first bytes) are left out and
    appended to ``skipped``, or raise ``ValueError`` naming the first with ``non_images="error"``. ``split``
    reads ``root/split``. A caller that checks that every image decodes passes ``by_content=False``, so that
    a file named like an image is judged by that check, whether it is damaged or no image at all.
    """
    if non_images not in ("skip", "error"):
        raise ValueError(f"non_images must be 'skip' or 'error', got {non_images!r}")
    root = os.fspath(root)
    if split is not None:
        root = os.path.join(root, split)
    if not os.path.isdir(root):
        raise DatasetNotFoundError(f"image folder {root} does not exist or is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {root} has no class subfolders (expected {root}/<class>/<image>)")
    if set(classes) <= SPLIT_NAMES:
        raise ValueError(f"image folder {root} holds only {', '.join(classes)}: dataset splits, not classes; "
                         f"serialize one split at a time: give {os.path.join(root, classes[0])} as the "
                         f"folder, or pass --split {classes[0]} (split={classes[0]!r})")
    skipped = [] if skipped is None else skipped
    items: list[list] = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.startswith("."):
                    continue
                path = os.path.join(dirpath, fn)
                if fn.lower().endswith(extensions) and (not by_content or is_image_file(path)):
                    items.append([path, label])
                elif non_images == "error":
                    by = "content" if fn.lower().endswith(extensions) else "extension"
                    raise ValueError(f"{path} is not an image file (by its {by}); remove it, or skip such "
                                     "files (--non-images skip)")
                else:
                    skipped.append(path)
    if skipped:
        log.warning("image folder %s: skipped %d files that are not images (first: %s)", root, len(skipped),
                    skipped[0])
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
    Image = require("PIL.Image", "decoding images")
    try:
        with Image.open(path) as img:
            if mode is not None and img.mode != mode:
                img = img.convert(mode)
            elif img.mode not in ("L", "RGB", "RGBA"):
                img = img.convert("RGBA" if "A" in img.mode or "transparency" in img.info else "RGB")
            return np.array(img, dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise CorruptDataError(f"{path}: cannot decode image ({exc})") from exc


def check_decodes(data: Any, path: str) -> None:
    """Raise :class:`CorruptDataError` naming ``path`` unless ``data`` (an image file's bytes) decodes."""
    try:
        Image = require("PIL.Image", "checking that images decode")
    except MissingDependencyError as exc:
        raise MissingDependencyError(f"{exc} (or pass --bad-images keep / bad_images=None to store them "
                                     "unchecked)") from exc.__cause__
    try:
        with Image.open(io.BytesIO(memoryview(data))) as img:
            if img.format == "JPEG":  # decoded at 1/8 scale: the whole stream is read, a third faster
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise CorruptDataError(f"{path}: cannot decode image ({exc})") from exc


def read_image_datapoint(dp: list, decode: bool = False, mode: str | None = "RGB", encoded: str = "array",
                         bad_images: str | None = None) -> list | None:
    """``[path, label]`` -> ``[image, label]`` (module level, so process workers can pickle it); ``None``
    (the datapoint is dropped) for an image that does not decode, with ``bad_images="skip"``."""
    path, label = dp
    try:
        if decode:
            return [read_image(path, True, mode), label]
        image = np.fromfile(path, np.uint8) if encoded == "array" else read_image(path)  # one read
        if bad_images is not None:
            check_decodes(image, path)
        return [image, label]
    except CorruptDataError as exc:
        if bad_images != "skip":
            raise
        log.warning("skipped %s: it does not decode (%s)", path, exc.__cause__ or exc)
        return None


class ImageFolderData(MapData):
    """``[image, label]`` datapoints of an image folder (see the module doc); ``.classes`` names the labels.

    ``encoded``: how undecoded images come: ``"array"`` (a 1-D ``uint8`` array of the file's bytes, the
    default) or ``"bytes"``. ``bad_images``: ``None``, ``"error"`` or ``"skip"`` (see the module doc).
    """

    def __init__(self, root: str | os.PathLike, decode: bool = False, shuffle: bool = False,
                 seed: int | None = None, extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                 mode: str | None = "RGB", *, non_images: str = "skip", split: str | None = None,
                 encoded: str = "array", bad_images: str | None = None) -> None:
        if encoded not in ("array", "bytes"):
            raise ValueError(f"ImageFolderData: encoded must be 'array' or 'bytes', got {encoded!r}")
        if bad_images not in (None, "error", "skip"):
            raise ValueError(f"ImageFolderData: bad_images must be None, 'error' or 'skip', got {bad_images!r}")
        self.root = os.fspath(root) if split is None else os.path.join(os.fspath(root), split)
        self.skipped: list[str] = []
        self.classes, self.files = list_image_folder(self.root, extensions, non_images=non_images,
                                                     skipped=self.skipped, by_content=bad_images is None)
        self.decode = decode
        super().__init__(DataFromList(self.files, shuffle=shuffle, seed=seed),
                         functools.partial(read_image_datapoint, decode=decode, mode=mode, encoded=encoded,
                                           bad_images=bad_images))

    def __getitem__(self, index: int) -> Any:
        return self.func(self.files[index])


image_folder = ImageFolderData  # a function-like alias for scripts
