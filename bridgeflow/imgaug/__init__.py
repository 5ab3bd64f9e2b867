"""Image augmentors with tensorpack's names and arguments, on OpenCV and numpy.

``from bridgeflow import imgaug`` (or ``from bridgeflow.dataflow import imgaug``) gives what
``from tensorpack.dataflow import imgaug`` gives to the ImageNet, CIFAR and detection examples:
geometric augmentors (``Flip``, ``Resize``, ``ResizeShortestEdge``, ``RandomResize``, ``CenterCrop``,
``RandomCrop``, ``GoogleNetRandomCropAndResize``, ``CenterPaste``, ``Transpose``), photometric ones
(``Brightness``, ``BrightnessScale``, ``Contrast``, ``Saturation``, ``Lighting``, ``Hue``, ``Gamma``,
``GaussianBlur``, ``SaltPepperNoise``, ``Clip``, ``ColorSpace``, ``Grayscale``, ``ToUint8``, ``ToFloat32``,
``MinMaxNormalize``, ``MeanVarianceNormalize``), combinators (``AugmentorList``, ``RandomOrderAug``,
``RandomApplyAug``, ``RandomChooseAug``, ``MapImage``, ``Identity``), the base classes to subclass
(``ImageAugmentor``, ``PhotometricAugmentor``), the transforms they return, and wrappers for
albumentations and torchvision pipelines.

Importing this package does not import OpenCV; the augmentors import it when they first need it
(the "images" extra: ``pip install "opencv-python-headless>=4.5" "pillow>=9"``).

Example:
    >>> import numpy as np
    >>> from bridgeflow import imgaug
    >>> augs = imgaug.AugmentorList([imgaug.ResizeShortestEdge(256), imgaug.CenterCrop(224)])
    >>> augs.augment(np.zeros((300, 400, 3), np.uint8)).shape
    (224, 224, 3)
"""

from ._base import Augmentor, ImageAugmentor, MapImage, PhotometricAugmentor, check_dtype
from ._external import Albumentations, TorchvisionAugmentor, as_augmentor
from ._geometry import (
    BackgroundFiller,
    CenterCrop,
    CenterPaste,
    ConstantBackgroundFiller,
    Flip,
    GoogleNetRandomCropAndResize,
    RandomCrop,
    RandomResize,
    Resize,
    ResizeShortestEdge,
    Transpose,
)
from ._meta import AugmentorList, Identity, RandomApplyAug, RandomChooseAug, RandomOrderAug
from ._photometric import (
    Brightness,
    BrightnessScale,
    Clip,
    ColorSpace,
    Contrast,
    Gamma,
    GaussianBlur,
    Grayscale,
    Hue,
    Lighting,
    MeanVarianceNormalize,
    MinMaxNormalize,
    SaltPepperNoise,
    Saturation,
    ToFloat32,
    ToUint8,
)
from ._transform import (
    INTER_AREA,
    INTER_CUBIC,
    INTER_LANCZOS4,
    INTER_LINEAR,
    INTER_NEAREST,
    BaseTransform,
    CropTransform,
    FlipTransform,
    LazyTransform,
    NoOpTransform,
    PhotometricTransform,
    ResizeTransform,
    Transform,
    TransformFactory,
    TransformList,
    TransposeTransform,
)

__all__ = [
    "INTER_AREA",
    "INTER_CUBIC",
    "INTER_LANCZOS4",
    "INTER_LINEAR",
    "INTER_NEAREST",
    "Albumentations",
    "Augmentor",
    "AugmentorList",
    "BackgroundFiller",
    "BaseTransform",
    "Brightness",
    "BrightnessScale",
    "CenterCrop",
    "CenterPaste",
    "Clip",
    "ColorSpace",
    "ConstantBackgroundFiller",
    "Contrast",
    "CropTransform",
    "Flip",
    "FlipTransform",
    "Gamma",
    "GaussianBlur",
    "GoogleNetRandomCropAndResize",
    "Grayscale",
    "Hue",
    "Identity",
    "ImageAugmentor",
    "LazyTransform",
    "Lighting",
    "MapImage",
    "MeanVarianceNormalize",
    "MinMaxNormalize",
    "NoOpTransform",
    "PhotometricAugmentor",
    "PhotometricTransform",
    "RandomApplyAug",
    "RandomChooseAug",
    "RandomCrop",
    "RandomOrderAug",
    "RandomResize",
    "Resize",
    "ResizeShortestEdge",
    "ResizeTransform",
    "SaltPepperNoise",
    "Saturation",
    "ToFloat32",
    "ToUint8",
    "TorchvisionAugmentor",
    "Transform",
    "TransformFactory",
    "TransformList",
    "Transpose",
    "TransposeTransform",
    "as_augmentor",
    "check_dtype",
]
