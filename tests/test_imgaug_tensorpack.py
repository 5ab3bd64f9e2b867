"""Differential check: bridgeflow.imgaug against tensorpack 0.11's own augmentors, draw for draw.

tests/data/tensorpack_imgaug.npz holds what tensorpack's augmentors made of fixed inputs with fixed
random generators (tests/data/make_tensorpack_imgaug_fixtures.py wrote it, with OpenCV 4.10 and numpy
1.26). bridgeflow's augmentors of the same names get the same arguments and generators here.

Tolerances: geometry and dtype conversions must match exactly. Photometric results on uint8 images may
differ by 1 on a few pixels (by 2 after a chain of four): tensorpack's expressions mix float32 and
float64 (numpy 1.x promotes ``uint8_array * (1 - float32_scalar)`` to float64), bridgeflow stays in
float32, and a value on either side of an integer truncates differently. Float results match to
float32 rounding.
"""

from __future__ import annotations

import importlib.util
import os

import cv2
import numpy as np
import pytest

from bridgeflow import imgaug

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "data", "make_tensorpack_imgaug_fixtures.py")
FIXTURES = os.path.join(HERE, "data", "tensorpack_imgaug.npz")


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tensorpack_imgaug_fixtures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fixtures = _load_script()
EXPECTED = np.load(FIXTURES)
# photometric cases on uint8 images, where float64 and float32 arithmetic may truncate differently
ROUNDING = {"brightness_scale": 1, "contrast_gray_mean": 1, "saturation": 1, "lighting": 1, "hue": 1,
            "random_order": 2, "imagenet_train": 2}

PARAMS = [(name, expr, key, seed, coords) for name, expr, key, seeds, coords in fixtures.CASES for seed in seeds]


def test_fixture_covers_every_case():
    names = {k.split("/")[0] for k in EXPECTED.files} - {"input", "meta"}
    assert names == {c[0] for c in fixtures.CASES}
    assert str(EXPECTED["meta/versions"][0]) == "0.11"


def test_inputs_are_the_ones_tensorpack_saw():
    for key, value in fixtures.inputs().items():
        np.testing.assert_array_equal(value, EXPECTED[f"input/{key}"])


@pytest.mark.parametrize(("name", "expr", "key", "seed", "with_coords"), PARAMS,
                         ids=[f"{p[0]}-{p[3]}" for p in PARAMS])
def test_same_output_as_tensorpack(name, expr, key, seed, with_coords):
    data = fixtures.inputs()
    img = data[key]
    before = img.copy()
    got = fixtures.run_case(imgaug, cv2, expr, img, data["coords"] if with_coords else None, seed)
    np.testing.assert_array_equal(img, before)  # the input is never changed
    want = EXPECTED[f"{name}/{seed}/image"]
    out = got["image"]
    assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, out.dtype, want.shape, want.dtype)
    if out.dtype == np.uint8 and name in ROUNDING:
        diff = np.abs(out.astype(np.int16) - want.astype(np.int16))
        assert diff.max() <= ROUNDING[name], f"max difference {diff.max()}"
        assert (diff > 0).mean() < 0.05, f"{(diff > 0).mean():.1%} of the pixels differ"
    elif out.dtype.kind == "f":
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-3)
    else:
        np.testing.assert_array_equal(out, want)
    if with_coords:
        np.testing.assert_allclose(got["coords"], EXPECTED[f"{name}/{seed}/coords"], rtol=1e-6, atol=1e-5)


def test_random_cases_are_not_all_identical():
    # the seeds of a random case must lead to different outputs, or the comparison above proves little
    for name, _expr, _key, seeds, _coords in fixtures.CASES:
        seeds = list(seeds)
        if len(seeds) < 3:
            continue
        outs = {EXPECTED[f"{name}/{s}/image"].tobytes() for s in seeds}
        assert len(outs) > 1, name
