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
import re
import subprocess
import sys

import cv2
import numpy as np
import pytest
from tensorpack_reference import run_tensorpack, tensorpack_python

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


def _tensorpack_source(exe: str) -> str:
    out = run_tensorpack(["-c", "import importlib.util; print(importlib.util.find_spec('tensorpack')"
                                ".submodule_search_locations[0])"])
    return out.stdout.strip()


def test_tensorpacks_own_imgaug_test_passes_with_its_imports_changed(tmp_path):
    """tensorpack 0.11's dataflow/imgaug/imgaug_test.py, its relative imports made ``from bridgeflow.imgaug``:
    the new interface (get_transform) and the deprecated one (augment_return_params, augment_with_params,
    augment_coords), over bridgeflow's augmentors and the legacy ones it defines."""
    exe = tensorpack_python()
    if exe is None:
        pytest.skip("needs tensorpack 0.11's source: BRIDGEFLOW_TENSORPACK_PYTHON names a Python with it")
    with open(os.path.join(_tensorpack_source(exe), "dataflow", "imgaug", "imgaug_test.py")) as f:
        code = f.read()
    code, n = re.subn(r"^from \.\w+ import ", "from bridgeflow.imgaug import ", code, flags=re.M)
    assert n == 4 and "from ." not in code
    (tmp_path / "imgaug_test.py").write_text(code)
    out = subprocess.run([sys.executable, "-m", "unittest", "-v", "imgaug_test"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "Ran 4 tests" in out.stderr and "\nOK" in out.stderr, out.stdout + out.stderr


def test_salt_pepper_noise_draws_as_tensorpacks(tmp_path):
    exe = tensorpack_python()
    if exe is None:
        pytest.skip("needs tensorpack 0.11: BRIDGEFLOW_TENSORPACK_PYTHON names a Python with it")
    code = (
        "import numpy as np, sys\n"
        "from tensorpack.dataflow import imgaug\n"
        "img = (np.arange(6 * 5 * 3) % 256).astype(np.uint8).reshape(6, 5, 3)\n"
        "out = []\n"
        "for args in [(), (0.3, 0.2)]:\n"
        "    aug = imgaug.SaltPepperNoise(*args)\n"
        "    aug.rng = np.random.RandomState(7)\n"
        "    out.append(aug.augment(img.copy()))\n"
        "    out.append(aug.augment(img.astype(np.float32) / 255))\n"
        f"np.savez({str(tmp_path / 'tp.npz')!r}, *out)\n")
    run_tensorpack(["-c", code])
    want = np.load(tmp_path / "tp.npz")
    img = (np.arange(6 * 5 * 3) % 256).astype(np.uint8).reshape(6, 5, 3)
    got = []
    for args in [(), (0.3, 0.2)]:
        aug = imgaug.SaltPepperNoise(*args)
        aug.rng = np.random.RandomState(7)
        got.append(aug.augment(img))
        got.append(aug.augment(img.astype(np.float32) / 255))
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g, want[f"arr_{i}"])
    assert (got[2] == 255).any() and (got[2] == 0).any()
