"""bridgeflow.imgaug: every augmentor against a result computed by hand, and its random number handling.

Photometric augmentors are checked through tensorpack's ``_augment(img, params)`` with chosen
parameters (the pixel arithmetic), and through ``_get_augment_params`` for the range of the draws.
tests/test_imgaug_tensorpack.py compares the same augmentors with tensorpack's, draw for draw.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle

import cv2
import numpy as np
import pytest

from bridgeflow import imgaug, worker_seed_scope


def grid(h: int, w: int, c: int | None = None) -> np.ndarray:
    n = h * w * (c or 1)
    a = (np.arange(n) % 256).astype(np.uint8)
    return a.reshape((h, w, c) if c else (h, w))


def seeded(aug, seed: int = 0):
    with worker_seed_scope(seed):
        aug.reset_state()
    return aug


def bright_pixel(h: int, w: int, row: int, col: int) -> np.ndarray:
    img = np.zeros((h, w, 1), np.uint8)
    img[row, col] = 255
    return img


def where_bright(img: np.ndarray) -> tuple[int, int] | None:
    rows, cols = np.nonzero(img[..., 0] == 255)
    assert len(rows) <= 1, "expected at most one bright pixel"
    return (int(rows[0]), int(cols[0])) if len(rows) else None


def assert_coords_follow_pixel(aug, h: int = 7, w: int = 9, row: int = 2, col: int = 5, draws: int = 30):
    """A pixel marked in the image and a point at its centre end up at the same place."""
    for _ in range(draws):
        img = bright_pixel(h, w, row, col)
        t = aug.get_transform(img)
        out = t.apply_image(img)
        x, y = t.apply_coords(np.array([[col + 0.5, row + 0.5]], np.float32))[0]
        inside = 0 <= x < out.shape[1] and 0 <= y < out.shape[0]
        assert where_bright(out) == ((int(np.floor(y)), int(np.floor(x))) if inside else None)


# --- geometry ---------------------------------------------------------------------------------------

def test_flip_horizontal_and_vertical():
    img = grid(2, 3, 1)
    out = seeded(imgaug.Flip(horiz=True, prob=1.0)).augment(img)
    np.testing.assert_array_equal(out[..., 0], [[2, 1, 0], [5, 4, 3]])
    out = seeded(imgaug.Flip(vert=True, prob=1.0)).augment(img)
    np.testing.assert_array_equal(out[..., 0], [[3, 4, 5], [0, 1, 2]])
    np.testing.assert_array_equal(seeded(imgaug.Flip(horiz=True, prob=0.0)).augment(img), img)
    t = seeded(imgaug.Flip(horiz=True, prob=1.0)).get_transform(img)
    np.testing.assert_allclose(t.apply_coords(np.array([[0.5, 1.0], [3.0, 0.0]])), [[2.5, 1.0], [0.0, 0.0]])
    assert_coords_follow_pixel(seeded(imgaug.Flip(horiz=True)))
    assert_coords_follow_pixel(seeded(imgaug.Flip(vert=True)))


def test_flip_probability_and_arguments():
    aug = seeded(imgaug.Flip(horiz=True, prob=0.5))
    flips = sum(isinstance(aug.get_transform(grid(2, 2)), imgaug.FlipTransform) for _ in range(1000))
    assert 430 < flips < 570
    with pytest.raises(ValueError, match="exactly one"):
        imgaug.Flip()
    with pytest.raises(ValueError, match="exactly one"):
        imgaug.Flip(horiz=True, vert=True)


def test_transpose():
    img = grid(2, 3, 2)
    out = seeded(imgaug.Transpose(prob=1.0)).augment(img)
    np.testing.assert_array_equal(out, img.transpose(1, 0, 2))
    single = grid(2, 3, 1)
    assert seeded(imgaug.Transpose(prob=1.0)).augment(single).shape == (3, 2, 1)
    assert_coords_follow_pixel(seeded(imgaug.Transpose(prob=1.0)))


def test_resize_nearest_by_hand():
    img = np.array([[10, 20]], np.uint8)
    out = imgaug.Resize((2, 4), interp=cv2.INTER_NEAREST).augment(img)
    np.testing.assert_array_equal(out, [[10, 10, 20, 20], [10, 10, 20, 20]])
    t = imgaug.Resize((2, 4)).get_transform(img)
    np.testing.assert_allclose(t.apply_coords(np.array([[1.0, 0.5]])), [[2.0, 1.0]])
    assert imgaug.Resize(5).augment(grid(3, 4, 1)).shape == (5, 5, 1)  # OpenCV's dropped axis is restored
    assert imgaug.Resize((6, 2)).augment(grid(3, 4, 3).astype(np.float32)).dtype == np.float32
    with pytest.raises(ValueError, match="made for 1x2 images"):
        t.apply_image(grid(3, 3))
    with pytest.raises(ValueError, match="int or an"):
        imgaug.Resize((1, 2, 3))


def test_resize_shortest_edge_by_hand():
    aug = imgaug.ResizeShortestEdge(3)
    assert aug.augment(grid(5, 7, 3)).shape == (3, 4, 3)  # scale 0.6: 7 * 0.6 = 4.2 -> 4
    assert aug.augment(grid(7, 5, 3)).shape == (4, 3, 3)
    assert imgaug.ResizeShortestEdge(4).augment(grid(2, 3)).shape == (4, 6)
    assert imgaug.ResizeShortestEdge(4).augment(grid(4, 4)).shape == (4, 4)
    up = imgaug.ResizeShortestEdge(4, interp=cv2.INTER_NEAREST)
    np.testing.assert_array_equal(up.augment(np.array([[7, 9]], np.uint8)), [[7] * 4 + [9] * 4] * 4)


def test_random_resize_by_hand(caplog):
    img = grid(4, 8, 1)
    assert seeded(imgaug.RandomResize((2.0, 2.0), aspect_ratio_thres=0)).augment(img).shape == (8, 16, 1)
    # pixels: 8x4 -> 10 wide, 6 high changes the aspect ratio by 17%, under 0.5
    assert seeded(imgaug.RandomResize((10, 10), (6, 6), aspect_ratio_thres=0.5)).augment(img).shape == (6, 10, 1)
    assert seeded(imgaug.RandomResize((10, 10), (6, 6), minimum=(12, 0), aspect_ratio_thres=0.5)) \
        .augment(img).shape == (6, 12, 1)
    with caplog.at_level(logging.WARNING, logger="bridgeflow.imgaug._geometry"):
        out = seeded(imgaug.RandomResize((10, 10), (6, 6), aspect_ratio_thres=0.1)).augment(img)
    assert out.shape == img.shape and "keeping its size" in caplog.text
    sizes = {seeded(imgaug.RandomResize((0.5, 1.5), (0.5, 1.5)), s).augment(grid(20, 20)).shape
             for s in range(20)}
    assert len(sizes) > 5 and all(10 <= h <= 30 and 10 <= w <= 30 and abs(h / w - 1) < 0.16 for h, w in sizes)
    with pytest.raises(ValueError, match="yrange"):
        imgaug.RandomResize((0.5, 1.5))


def test_center_crop_by_hand():
    img = grid(5, 6, 1)
    out = imgaug.CenterCrop((2, 3)).augment(img)  # y0 = int(1.5) = 1, x0 = int(1.5) = 1
    np.testing.assert_array_equal(out, img[1:3, 1:4])
    t = imgaug.CenterCrop((2, 3)).get_transform(img)
    np.testing.assert_allclose(t.apply_coords(np.array([[1.0, 1.0]])), [[0.0, 0.0]])
    assert_coords_follow_pixel(imgaug.CenterCrop((5, 5)), draws=1)
    with pytest.raises(ValueError, match="cannot crop 6x6 out of a 5x6 image"):
        imgaug.CenterCrop(6).augment(img)


def test_random_crop_reaches_every_window():
    img = grid(3, 3, 1)
    aug = seeded(imgaug.RandomCrop(2))
    windows = {tuple(img[y:y + 2, x:x + 2].ravel()) for y in range(2) for x in range(2)}
    seen = {tuple(aug.augment(img).ravel()) for _ in range(200)}
    assert seen == windows
    assert_coords_follow_pixel(seeded(imgaug.RandomCrop((4, 6))))
    with pytest.raises(ValueError, match="cannot crop"):
        aug.augment(grid(1, 3))


def test_googlenet_crop_by_hand():
    img = grid(8, 8, 3)
    # the whole image with a square aspect: a plain resize
    whole = seeded(imgaug.GoogleNetRandomCropAndResize((1.0, 1.0), (1.0, 1.0), target_shape=4,
                                                       interp=cv2.INTER_NEAREST))
    np.testing.assert_array_equal(whole.augment(img), img[::2, ::2])
    # a quarter of the area, square: one of the 25 4x4 windows, resized 4 -> 4 (unchanged)
    quarter = seeded(imgaug.GoogleNetRandomCropAndResize((0.25, 0.25), (1.0, 1.0), target_shape=4))
    windows = {img[y:y + 4, x:x + 4].tobytes() for y in range(5) for x in range(5)}
    seen = {quarter.augment(img).tobytes() for _ in range(100)}
    assert seen <= windows and len(seen) > 10
    # no window with aspect 4 fits in 8x10: ResizeShortestEdge(4) to 4x5, then CenterCrop(4) at x0=0
    fallback = seeded(imgaug.GoogleNetRandomCropAndResize((1.0, 1.0), (4.0, 4.0), target_shape=4,
                                                          interp=cv2.INTER_NEAREST))
    wide = grid(8, 10, 1)
    np.testing.assert_array_equal(fallback.augment(wide), wide[0:8:2, 0:8:2])
    assert seeded(imgaug.GoogleNetRandomCropAndResize()).augment(grid(30, 40, 3)).shape == (224, 224, 3)


def test_center_paste_by_hand():
    img = np.full((2, 2, 3), 7, np.uint8)
    out = imgaug.CenterPaste((4, 5)).augment(img)  # y0 = int(1.0) = 1, x0 = int(1.5) = 1
    want = np.zeros((4, 5, 3), np.uint8)
    want[1:3, 1:3] = 7
    np.testing.assert_array_equal(out, want)
    filled = imgaug.CenterPaste((3, 3), imgaug.ConstantBackgroundFiller(9)).augment(np.zeros((1, 1), np.float32))
    np.testing.assert_array_equal(filled, [[9, 9, 9], [9, 0, 9], [9, 9, 9]])
    assert filled.dtype == np.float32
    assert_coords_follow_pixel(imgaug.CenterPaste((10, 12)), draws=1)
    with pytest.raises(ValueError, match="does not fit"):
        imgaug.CenterPaste((1, 5)).augment(img)


# --- photometric --------------------------------------------------------------------------------------

def test_brightness_by_hand():
    aug = imgaug.Brightness(10)
    np.testing.assert_array_equal(aug._augment(np.array([[250, 10]], np.uint8), 10.0), [[255, 20]])
    np.testing.assert_allclose(imgaug.Brightness(10, clip=False)._augment(np.array([250.5], np.float32), 10.0),
                               [260.5])
    draws = [float(seeded(aug, s)._get_augment_params(None)) for s in range(200)]
    assert -10 <= min(draws) < -8 and 8 < max(draws) < 10
    with pytest.raises(ValueError, match="delta"):
        imgaug.Brightness(0)


def test_brightness_scale_by_hand():
    aug = imgaug.BrightnessScale((0.5, 1.5))
    out = aug._augment(np.array([[100, 200]], np.uint8), 1.5)
    np.testing.assert_array_equal(out, [[150, 255]])
    assert out.dtype == np.uint8
    np.testing.assert_allclose(imgaug.BrightnessScale((1, 2), clip=False)._augment(np.array([200.0], np.float32),
                                                                                   1.5), [300.0])
    draws = [float(seeded(aug, s)._get_augment_params(None)) for s in range(200)]
    assert 0.5 <= min(draws) < 0.6 and 1.4 < max(draws) < 1.5


def test_contrast_by_hand():
    img = np.array([[[0], [100]]], np.uint8)  # per-channel mean 50
    np.testing.assert_array_equal(imgaug.Contrast((1, 2))._augment(img, 2.0), [[[0], [150]]])
    np.testing.assert_allclose(imgaug.Contrast((1, 2), clip=False)._augment(img.astype(np.float32), 2.0),
                               [[[-50], [150]]])
    np.testing.assert_array_equal(imgaug.Contrast((0, 1))._augment(np.array([[10, 30]], np.uint8), 0.5), [[15, 25]])
    grey_equal = np.array([[[40, 40, 40], [80, 80, 80]]], np.uint8)  # grey mean 60 whatever the weights
    np.testing.assert_array_equal(imgaug.Contrast((0, 1), rgb=False)._augment(grey_equal, 0.5),
                                  [[[50] * 3, [70] * 3]])


def test_saturation_by_hand():
    aug = imgaug.Saturation(0.4, rgb=False)
    grey = np.full((1, 2, 3), 90, np.uint8)
    np.testing.assert_array_equal(aug._augment(grey, 1.25), grey)  # grey pixels have nothing to saturate
    red_bgr = np.array([[[0, 0, 255]]], np.uint8)  # grey: 0.299 * 255 = 76.2 -> 76
    np.testing.assert_array_equal(aug._augment(red_bgr, 0.0), [[[76, 76, 76]]])
    np.testing.assert_array_equal(aug._augment(red_bgr, 2.0), [[[0, 0, 255]]])  # 2x - 76, clipped
    np.testing.assert_array_equal(imgaug.Saturation(0.4, rgb=True)._augment(red_bgr, 0.0), [[[29, 29, 29]]])
    draws = [float(seeded(aug, s)._get_augment_params(None)) for s in range(200)]
    assert 0.6 <= min(draws) < 0.7 and 1.3 < max(draws) < 1.4
    with pytest.raises(ValueError, match="alpha"):
        imgaug.Saturation(1.0)


def test_lighting_by_hand():
    aug = imgaug.Lighting(0.1, eigval=[1, 2, 3], eigvec=np.eye(3))
    img = np.full((1, 1, 3), 10, np.uint8)
    out = aug._augment(img, np.array([1.0, 0.5, -1.0], np.float32))  # increments (1, 1, -3)
    np.testing.assert_array_equal(out, [[[11, 11, 7]]])
    rotated = imgaug.Lighting(0.1, eigval=[1, 1, 1], eigvec=[[0, 1, 0], [1, 0, 0], [0, 0, 1]])
    np.testing.assert_array_equal(rotated._augment(img, np.array([5.0, 0.0, 0.0], np.float32)), [[[10, 15, 10]]])
    draws = np.array([seeded(aug, s)._get_augment_params(img) for s in range(300)])
    assert draws.shape == (300, 3) and 0.08 < draws.std() < 0.12
    with pytest.raises(ValueError, match="3-channel"):
        aug._get_augment_params(np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="eigval"):
        imgaug.Lighting(0.1, eigval=[1, 2], eigvec=np.eye(3))


def test_hue_by_hand():
    red = np.array([[[255, 0, 0]]], np.uint8)
    np.testing.assert_array_equal(imgaug.Hue(rgb=True)._augment(red, 60.0), [[[0, 255, 0]]])  # 120 degrees
    np.testing.assert_array_equal(imgaug.Hue(rgb=False)._augment(red, 60.0), [[[0, 0, 255]]])  # blue in BGR
    np.testing.assert_allclose(imgaug.Hue()._augment(red.astype(np.float32) / 255, 60.0), [[[0, 1, 0]]], atol=1e-6)


def test_gamma_gaussian_blur_clip_by_hand():
    lut = imgaug.Gamma()._augment(np.array([[0, 64, 255]], np.uint8), 1.0)  # sqrt(64 / 255) * 255 = 127.7
    np.testing.assert_array_equal(lut, [[0, 127, 255]])
    impulse = np.zeros((5, 5), np.float32)
    impulse[2, 2] = 16
    out = imgaug.GaussianBlur()._augment(impulse, ((3, 3), (0.0, 0.0)))  # OpenCV's 3-tap kernel: 1/4 1/2 1/4
    np.testing.assert_allclose(out[1:4, 1:4], [[1, 2, 1], [2, 4, 2], [1, 2, 1]], atol=1e-5)
    sizes = {seeded(imgaug.GaussianBlur(size_range=(0, 3)), s)._get_augment_params(None)[0] for s in range(50)}
    assert sizes == {(1, 1), (3, 3), (5, 5)}
    np.testing.assert_array_equal(imgaug.Clip(10, 200).augment(np.array([5.0, 50.0, 250.0], np.float32)),
                                  [10, 50, 200])


def test_color_conversions_by_hand():
    blue_bgr = np.array([[[255, 0, 0]]], np.uint8)  # grey = 0.114 * 255 = 29.07 -> 29
    grey = imgaug.Grayscale().augment(blue_bgr)
    assert grey.shape == (1, 1, 1) and grey[0, 0, 0] == 29
    assert imgaug.Grayscale(keepdims=False).augment(blue_bgr).shape == (1, 1)
    np.testing.assert_array_equal(imgaug.Grayscale(keepshape=True, rgb=True).augment(blue_bgr), [[[76, 76, 76]]])
    hsv = imgaug.ColorSpace(cv2.COLOR_BGR2HSV).augment(blue_bgr)
    np.testing.assert_array_equal(hsv, [[[120, 255, 255]]])  # blue: 240 degrees / 2
    with pytest.raises(ValueError, match="keepdims"):
        imgaug.Grayscale(keepdims=False, keepshape=True)


def test_dtype_and_normalization_by_hand():
    out = imgaug.ToUint8().augment(np.array([-5.0, 12.7, 300.0], np.float32))
    np.testing.assert_array_equal(out, [0, 12, 255])
    assert out.dtype == np.uint8
    assert imgaug.ToFloat32().augment(grid(2, 2)).dtype == np.float32
    np.testing.assert_allclose(imgaug.MinMaxNormalize().augment(np.array([0, 5, 10], np.uint8)), [0, 127.5, 255])
    per_channel = np.array([[[0, 10], [4, 30]]], np.float32)
    np.testing.assert_allclose(imgaug.MinMaxNormalize(-1, 1, all_channel=False).augment(per_channel),
                               [[[-1, -1], [1, 1]]])
    np.testing.assert_allclose(imgaug.MinMaxNormalize().augment(np.full((2, 2), 3.0, np.float32)), 0)
    norm = imgaug.MeanVarianceNormalize().augment(np.array([1, 3], np.uint8))
    np.testing.assert_allclose(norm, [-1, 1])
    assert norm.dtype == np.float32
    flat = imgaug.MeanVarianceNormalize().augment(np.full((1, 4), 5, np.uint8))
    np.testing.assert_allclose(flat, 0)  # the deviation floor avoids a division by zero


# --- combinators and subclasses ------------------------------------------------------------------------

class AddConstant(imgaug.PhotometricAugmentor):
    def __init__(self, value):
        self.value = value

    def _augment(self, img, _):
        return img + self.value


class Double(imgaug.PhotometricAugmentor):
    def _augment(self, img, _):
        return img * 2


def test_map_image_and_identity():
    img = np.array([[1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(imgaug.MapImage(lambda x: x * 3).augment(img), [[3, 6]])
    t = imgaug.MapImage(lambda x: x * 3).get_transform(img)
    with pytest.raises(NotImplementedError, match="apply_coords"):
        t.apply_coords(np.zeros((1, 2)))
    t = imgaug.MapImage(lambda x: x, coord_func=lambda c: c + 1).get_transform(img)
    np.testing.assert_array_equal(t.apply_coords(np.zeros((1, 2))), [[1, 1]])
    assert imgaug.Identity().augment(img) is img
    with pytest.raises(TypeError, match="function"):
        imgaug.MapImage(3)


def test_random_apply_choose_and_order():
    img = np.array([1.0], np.float32)
    assert seeded(imgaug.RandomApplyAug(AddConstant(5), 1.0)).augment(img)[0] == 6
    assert seeded(imgaug.RandomApplyAug(AddConstant(5), 0.0)).augment(img)[0] == 1
    applied = seeded(imgaug.RandomApplyAug(AddConstant(5), 0.3))
    n = sum(applied.augment(img)[0] == 6 for _ in range(1000))
    assert 240 < n < 360
    chooser = seeded(imgaug.RandomChooseAug([(AddConstant(5), 1.0), (Double(), 0.0)]))
    assert {float(chooser.augment(img)[0]) for _ in range(20)} == {6.0}
    assert {float(seeded(imgaug.RandomChooseAug([AddConstant(5), Double()]), s).augment(img)[0])
            for s in range(30)} == {6.0, 2.0}
    with pytest.raises(ValueError, match="sum to 1"):
        imgaug.RandomChooseAug([(Double(), 0.5)])
    order = seeded(imgaug.RandomOrderAug([AddConstant(10), Double()]))
    # (1 + 10) * 2 = 22 or 1 * 2 + 10 = 12: both orders happen
    assert {float(order.augment(img)[0]) for _ in range(50)} == {22.0, 12.0}


def test_augmentor_list_chains_and_lazy_transforms():
    augs = imgaug.AugmentorList([imgaug.ResizeShortestEdge(20), imgaug.CenterCrop((20, 20))])
    assert augs.augment(grid(40, 60, 3)).shape == (20, 20, 3)
    t = augs.get_transform(grid(40, 60, 3))
    with pytest.raises(RuntimeError, match="after apply_image"):
        t.apply_coords(np.zeros((1, 2), np.float32))
    out = t.apply_image(grid(40, 60, 3))
    assert out.shape == (20, 20, 3)
    # 60x40 -> 30x20, then the centre 20 columns start at x0 = 5
    np.testing.assert_allclose(t.apply_coords(np.array([[30.0, 20.0]], np.float32)), [[10.0, 10.0]])
    with pytest.raises(TypeError, match="list of augmentors"):
        imgaug.AugmentorList(imgaug.Flip(horiz=True))


class OldStyle(imgaug.ImageAugmentor):
    """tensorpack's older interface: _get_augment_params and _augment (and _augment_coords)."""

    def _get_augment_params(self, img):
        return int(self.rng.randint(1, 4))

    def _augment(self, img, shift):
        return np.roll(img, shift, axis=1)

    def _augment_coords(self, coords, shift):
        out = coords.copy()
        out[:, 0] += shift
        return out


class CropTopLeft(imgaug.ImageAugmentor):
    """tensorpack's current interface: get_transform returning a transform."""

    def __init__(self, size):
        super().__init__()
        self._init(locals())

    def get_transform(self, img):
        return imgaug.CropTransform(0, 0, self.size, self.size)


def test_tensorpack_style_subclasses():
    img = grid(3, 6, 1)
    aug = seeded(OldStyle())
    t = aug.get_transform(img)
    out = t.apply_image(img)
    shift = int(np.argmax(out[0, :, 0] == 0))
    assert 1 <= shift <= 3 and np.array_equal(out, np.roll(img, shift, axis=1))
    np.testing.assert_array_equal(t.apply_coords(np.zeros((1, 2), np.float32)), [[shift, 0]])
    assert CropTopLeft(2).size == 2
    np.testing.assert_array_equal(imgaug.AugmentorList([CropTopLeft(2)]).augment(img), img[:2, :2])
    with pytest.raises(NotImplementedError, match="get_transform"):
        imgaug.ImageAugmentor().augment(img)


def test_bad_images_are_refused():
    with pytest.raises(TypeError, match="numpy array"):
        imgaug.Flip(horiz=True).augment([[1, 2]])
    with pytest.raises(TypeError, match="int16"):
        imgaug.Flip(horiz=True).augment(np.zeros((2, 2), np.int16))


# --- random numbers -------------------------------------------------------------------------------------

def crops(aug, n: int = 12) -> list:
    img = grid(20, 20)
    return [aug.augment(img).tobytes() for _ in range(n)]


def test_seeding_is_reproducible_and_distinct_per_worker():
    make = lambda: imgaug.AugmentorList([imgaug.RandomCrop(5), imgaug.Flip(horiz=True)])
    assert crops(seeded(make(), 1)) == crops(seeded(make(), 1))
    assert crops(seeded(make(), 1)) != crops(seeded(make(), 2))
    aug = make()
    aug.seed = 7
    aug.reset_state()
    first = crops(aug)
    aug.reset_state()
    assert crops(aug) == first
    unseeded_a, unseeded_b = make(), make()  # no seed, no worker: OS entropy
    unseeded_a.reset_state()
    unseeded_b.reset_state()
    assert crops(unseeded_a) != crops(unseeded_b)


def test_children_draw_distinct_streams():
    # two identical augmentors in one list must not mirror each other's draws
    pair = seeded(imgaug.AugmentorList([imgaug.RandomCrop(10), imgaug.RandomCrop(10)]))
    a, b = pair.augmentors
    assert [a.rng.randint(1000) for _ in range(10)] != [b.rng.randint(1000) for _ in range(10)]
    order = seeded(imgaug.RandomOrderAug([imgaug.Brightness(5), imgaug.Brightness(5)]))
    x, y = order.aug_lists
    assert x.rng.uniform() != y.rng.uniform()


def test_unreset_augmentor_seeds_itself_and_forked_copies_differ():
    aug = imgaug.RandomCrop(3)  # never reset: seeds itself on first use
    parent = crops(aug, 3)
    assert len(parent) == 3
    ctx = mp.get_context("fork")
    queue = ctx.Queue()

    def child():
        queue.put(crops(aug, 8))

    procs = [ctx.Process(target=child) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len({tuple(r) for r in results}) == 3, "forked copies repeated one another's augmentations"
    copy = pickle.loads(pickle.dumps(aug))
    assert crops(copy, 8) != crops(aug, 8)


def test_tensorpacks_deprecated_calls_give_the_transform_and_reuse_it():
    augs = imgaug.AugmentorList([imgaug.Flip(horiz=True, prob=1.0), imgaug.Resize((4, 6)),
                                 imgaug.SaltPepperNoise(0.2, 0.2)])
    img = np.arange(5 * 8, dtype=np.float32).reshape(5, 8) / 40
    with pytest.warns(DeprecationWarning, match=r"augment_return_params\(img\) is deprecated .*get_transform"):
        out, t = augs.augment_return_params(img)
    assert isinstance(t, imgaug.BaseTransform) and out.shape == (4, 6)
    with pytest.warns(DeprecationWarning, match="augment_with_params"):
        again = augs.augment_with_params(img, t)
    np.testing.assert_array_equal(out, again)  # the same draws: salt and pepper on the same elements
    with pytest.warns(DeprecationWarning, match="augment_coords"):
        coords = augs.augment_coords(np.array([[1.0, 2.0]]), t)
    np.testing.assert_allclose(coords, [[(8 - 1.0) * 6 / 8, 2.0 * 4 / 5]])  # flipped, then resized


def test_salt_pepper_noise_leaves_its_input_and_refuses_bad_probabilities():
    img = np.full((20, 20, 3), 128, np.uint8)
    out = imgaug.SaltPepperNoise(0.1, 0.1).augment(img)
    assert (img == 128).all() and {0, 128, 255} == set(np.unique(out))
    with pytest.raises(ValueError, match="sum to at most 1"):
        imgaug.SaltPepperNoise(0.6, 0.6)
