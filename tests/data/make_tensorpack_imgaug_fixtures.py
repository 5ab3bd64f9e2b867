"""Write tests/data/tensorpack_imgaug.npz: what tensorpack 0.11's own augmentors output for fixed inputs.

tests/test_imgaug_tensorpack.py applies bridgeflow's augmentors of the same names, with the same
arguments and the same random generators, to the same inputs and compares. The cases are defined here
(``CASES``, plain data the test imports); only ``main()`` needs tensorpack. Regenerate with a Python
that has tensorpack 0.11, numpy < 2 and OpenCV::

    python -m venv /tmp/tpvenv && /tmp/tpvenv/bin/pip install tensorpack==0.11 "numpy<2" \\
        "opencv-python-headless<4.11"
    /tmp/tpvenv/bin/python tests/data/make_tensorpack_imgaug_fixtures.py

Every random augmentor in a case gets ``numpy.random.RandomState(seed + k)`` as its generator, ``k``
counting augmentors depth-first (see ``seed_all``), so both libraries draw the same numbers.
"""

from __future__ import annotations

import os
import sys

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensorpack_imgaug.npz")

# fb.resnet.torch's PCA lighting constants, in BGR order (as tensorpack's ImageNet example uses them)
EIGVAL = "np.asarray([0.2175, 0.0188, 0.0045][::-1]) * 255.0"
EIGVEC = ("np.array([[-0.5675, 0.7192, 0.4009], [-0.5808, -0.0045, -0.8140], [-0.5836, -0.6948, 0.4203]], "
          "dtype='float32')[::-1, ::-1]")

# (case name, augmentor expression over `imgaug`, `np` and `cv2`, input image name, seeds, with coordinates)
CASES = [
    ("flip_h", "imgaug.Flip(horiz=True)", "u8", range(6), True),
    ("flip_v", "imgaug.Flip(vert=True, prob=1.0)", "u8", [0], True),
    ("resize", "imgaug.Resize((20, 30))", "u8", [0], True),
    ("resize_cubic_square", "imgaug.Resize(16, interp=cv2.INTER_CUBIC)", "f32", [0], True),
    ("resize_shortest_wide", "imgaug.ResizeShortestEdge(24)", "u8", [0], True),
    ("resize_shortest_tall", "imgaug.ResizeShortestEdge(24, cv2.INTER_CUBIC)", "u8_tall", [0], True),
    ("random_resize_scale", "imgaug.RandomResize((0.8, 1.3), (0.8, 1.3))", "u8", range(4), True),
    ("random_resize_pixels", "imgaug.RandomResize((30, 60), (20, 40), aspect_ratio_thres=0.3)", "u8", range(4),
     True),
    ("random_resize_keep_ratio", "imgaug.RandomResize((0.5, 1.5), aspect_ratio_thres=0)", "u8", range(3), True),
    ("center_crop", "imgaug.CenterCrop((20, 30))", "u8", [0], True),
    ("center_crop_int", "imgaug.CenterCrop(17)", "gray", [0], True),
    ("random_crop", "imgaug.RandomCrop((20, 30))", "u8", range(5), True),
    ("googlenet", "imgaug.GoogleNetRandomCropAndResize(target_shape=24)", "u8_big", range(6), True),
    ("googlenet_cubic", "imgaug.GoogleNetRandomCropAndResize(target_shape=24, interp=cv2.INTER_CUBIC)",
     "u8_big", range(3), True),
    ("googlenet_fallback", "imgaug.GoogleNetRandomCropAndResize((0.9, 1.0), (3.0, 4.0), target_shape=24)",
     "u8_big", range(2), True),
    ("center_paste", "imgaug.CenterPaste((40, 60))", "u8", [0], False),
    ("transpose", "imgaug.Transpose(prob=1.0)", "u8", [0], True),
    ("brightness_scale", "imgaug.BrightnessScale((0.6, 1.4), clip=False)", "u8", range(3), False),
    ("brightness_scale_float", "imgaug.BrightnessScale((0.6, 1.4), clip=False)", "f32", range(3), False),
    ("brightness", "imgaug.Brightness(30)", "u8", range(3), False),
    ("brightness_float_noclip", "imgaug.Brightness(30, clip=False)", "f32", range(3), False),
    ("contrast_gray_mean", "imgaug.Contrast((0.6, 1.4), rgb=False, clip=False)", "u8", range(3), False),
    ("contrast_channel_mean", "imgaug.Contrast((0.5, 1.5))", "f32", range(3), False),
    ("contrast_2d", "imgaug.Contrast((0.5, 1.5))", "gray", range(2), False),
    ("saturation", "imgaug.Saturation(0.4, rgb=False)", "u8", range(3), False),
    ("saturation_float", "imgaug.Saturation(0.4)", "f32", range(3), False),
    ("lighting", f"imgaug.Lighting(0.1, eigval={EIGVAL}, eigvec={EIGVEC})", "u8", range(3), False),
    ("lighting_float", f"imgaug.Lighting(0.1, eigval={EIGVAL}, eigvec={EIGVEC}, clip=False)", "f32", range(3),
     False),
    ("hue", "imgaug.Hue((-30, 30))", "u8", range(3), False),
    ("gamma", "imgaug.Gamma()", "u8", range(3), False),
    ("gaussian_blur", "imgaug.GaussianBlur(size_range=(1, 4), sigma_range=(0.5, 2.0))", "u8", range(3), False),
    ("clip", "imgaug.Clip(10, 200)", "f32", [0], False),
    ("color_space", "imgaug.ColorSpace(cv2.COLOR_BGR2HSV)", "u8", [0], False),
    ("grayscale", "imgaug.Grayscale()", "u8", [0], False),
    ("grayscale_keepshape", "imgaug.Grayscale(keepshape=True, rgb=True)", "u8", [0], False),
    ("to_uint8", "imgaug.ToUint8()", "f32_wide", [0], False),
    ("to_float32", "imgaug.ToFloat32()", "u8", [0], False),
    ("minmax", "imgaug.MinMaxNormalize()", "u8", [0], False),
    ("minmax_channel", "imgaug.MinMaxNormalize(-1, 1, all_channel=False)", "f32", [0], False),
    ("meanvar", "imgaug.MeanVarianceNormalize()", "u8", [0], False),
    ("meanvar_channel", "imgaug.MeanVarianceNormalize(all_channel=False)", "f32", [0], False),
    ("map_image", "imgaug.MapImage(lambda x: 255 - x)", "u8", [0], False),
    ("random_apply", "imgaug.RandomApplyAug(imgaug.Flip(vert=True, prob=1.0), 0.5)", "u8", range(6), True),
    ("random_choose", "imgaug.RandomChooseAug([(imgaug.Flip(horiz=True, prob=1.0), 0.3), "
                      "(imgaug.Transpose(prob=1.0), 0.7)])", "u8", range(6), True),
    ("random_order", "imgaug.RandomOrderAug([imgaug.BrightnessScale((0.6, 1.4), clip=False), "
                     "imgaug.Contrast((0.6, 1.4), rgb=False, clip=False), imgaug.Saturation(0.4, rgb=False)])",
     "u8", range(4), False),
    # tensorpack's ImageNet augmentors (fbresnet_augmentor), on a small scale
    ("imagenet_train", "imgaug.AugmentorList([imgaug.GoogleNetRandomCropAndResize(target_shape=32, "
                       "interp=cv2.INTER_CUBIC), imgaug.RandomOrderAug([imgaug.BrightnessScale((0.6, 1.4), "
                       "clip=False), imgaug.Contrast((0.6, 1.4), rgb=False, clip=False), "
                       "imgaug.Saturation(0.4, rgb=False), "
                       f"imgaug.Lighting(0.1, eigval={EIGVAL}, eigvec={EIGVEC})]), "
                       "imgaug.Flip(horiz=True)])", "u8_big", range(4), False),
    ("imagenet_val", "imgaug.AugmentorList([imgaug.ResizeShortestEdge(36, interp=cv2.INTER_CUBIC), "
                     "imgaug.CenterCrop((32, 32))])", "u8_big", [0], True),
    # tensorpack's CIFAR augmentors (cifar10-resnet.py), with a mean image of zeros
    ("cifar_train", "imgaug.AugmentorList([imgaug.CenterPaste((40, 40)), imgaug.RandomCrop((32, 32)), "
                    "imgaug.Flip(horiz=True), imgaug.MapImage(lambda x: x - np.zeros((32, 32, 3), 'float32'))])",
     "u8_cifar", range(4), False),
]


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.RandomState(0)
    u8 = rng.randint(0, 256, size=(29, 41, 3)).astype(np.uint8)
    return {
        "u8": u8,
        "u8_tall": rng.randint(0, 256, size=(41, 23, 3)).astype(np.uint8),
        "u8_big": rng.randint(0, 256, size=(64, 80, 3)).astype(np.uint8),
        "u8_cifar": rng.randint(0, 256, size=(32, 32, 3)).astype(np.uint8),
        "f32": (rng.rand(17, 23, 3) * 255).astype(np.float32),
        "f32_wide": (rng.rand(17, 23, 3) * 400 - 70).astype(np.float32),
        "gray": rng.randint(0, 256, size=(29, 41)).astype(np.uint8),
        "coords": np.array([[0.0, 0.0], [10.5, 3.25], [40.0, 28.0], [20.0, 30.0]], np.float32),
    }


def children(aug: object) -> list:
    """The augmentors an augmentor holds, under the attribute names both libraries use."""
    for attr in ("augmentors", "aug_lists"):
        if isinstance(getattr(aug, attr, None), (list, tuple)):
            return list(getattr(aug, attr))
    inner = getattr(aug, "aug", None)
    return [inner] if inner is not None else []


def seed_all(aug: object, seed: int) -> int:
    """Give ``aug`` and every augmentor inside it ``RandomState(seed + k)``, depth-first; returns the next k."""
    aug.rng = np.random.RandomState(seed)
    seed += 1
    for child in children(aug):
        seed = seed_all(child, seed)
    return seed


def run_case(imgaug, cv2, expr: str, img: np.ndarray, coords: np.ndarray | None, seed: int) -> dict:
    aug = eval(expr, {"imgaug": imgaug, "np": np, "cv2": cv2})
    seed_all(aug, 9973 * seed + 5)
    tfm = aug.get_transform(img)
    out = {"image": tfm.apply_image(img.copy())}
    if coords is not None:
        out["coords"] = tfm.apply_coords(coords.copy())
    return out


def main() -> None:
    import cv2
    import tensorpack
    from tensorpack.dataflow import imgaug

    if tensorpack.__version__ != "0.11" or np.__version__.split(".")[0] != "1":
        sys.exit(f"needs tensorpack 0.11 and numpy 1.x, got {tensorpack.__version__} and {np.__version__}")
    data = inputs()
    arrays = {f"input/{k}": v for k, v in data.items()}
    for name, expr, key, seeds, with_coords in CASES:
        for seed in seeds:
            out = run_case(imgaug, cv2, expr, data[key], data["coords"] if with_coords else None, seed)
            for part, value in out.items():
                arrays[f"{name}/{seed}/{part}"] = np.asarray(value)
    arrays["meta/versions"] = np.array([tensorpack.__version__, np.__version__, cv2.__version__])
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {len(arrays)} arrays to {OUT}")


if __name__ == "__main__":
    main()
