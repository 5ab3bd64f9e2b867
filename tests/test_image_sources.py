"""ImageFromFile on real image files written with OpenCV and PIL."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from PIL import Image

from bridgeflow import ImageFromFile
from bridgeflow.testing import check_dataflow


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(5):
        rgb = np.zeros((4, 6, 3), np.uint8)
        rgb[..., 0] = 200  # red
        rgb[..., 2] = 10 * i  # blue tells the files apart
        path = tmp_path / f"img{i}.png"  # lossless, so values can be compared exactly
        Image.fromarray(rgb).save(path)
        paths.append(str(path))
    return paths


def test_rgb_gray_and_resize(files):
    got = check_dataflow(ImageFromFile(files))
    assert len(got) == 5
    for i, (img,) in enumerate(got):
        assert img.shape == (4, 6, 3) and img.dtype == np.uint8
        np.testing.assert_array_equal(img[0, 0], [200, 0, 10 * i])  # RGB order, as tensorpack gives it
    gray = list(ImageFromFile(files, channel=1))
    assert gray[0][0].shape == (4, 6, 1)
    expected = cv2.imread(files[3], cv2.IMREAD_GRAYSCALE)
    np.testing.assert_array_equal(gray[3][0][:, :, 0], expected)
    resized = list(ImageFromFile(files, resize=(2, 3)))
    assert resized[0][0].shape == (2, 3, 3)
    np.testing.assert_array_equal(resized[1][0][0, 0], [200, 0, 10])
    assert list(ImageFromFile(files, channel=1, resize=8))[0][0].shape == (8, 8, 1)


def test_shuffle_every_epoch(files):
    df = ImageFromFile(files * 4, shuffle=True, seed=1)
    df.reset_state()
    first = [int(dp[0][0, 0, 2]) for dp in df]
    second = [int(dp[0][0, 0, 2]) for dp in df]
    assert sorted(first) == sorted(second) == sorted([10 * i for i in range(5)] * 4)
    assert first != second


def test_bad_files_are_named(files, tmp_path):
    missing = str(tmp_path / "nope.jpg")
    with pytest.raises(FileNotFoundError, match="nope.jpg does not exist"):
        list(ImageFromFile([files[0], missing]))
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="could not decode the image file .*junk.jpg"):
        list(ImageFromFile([str(junk)]))
    with pytest.raises(ValueError, match="non-empty list"):
        ImageFromFile([])
    with pytest.raises(ValueError, match="channel must be 1 or 3"):
        ImageFromFile(files, channel=4)
