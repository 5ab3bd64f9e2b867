"""AugmentImageComponent(s) and AugmentImageCoordinates, with bridgeflow, albumentations, torchvision-style
and plain-function augmentors; seeding in parallel workers."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import bridgeflow as bf
from bridgeflow import (
    AugmentImageComponent,
    AugmentImageComponents,
    AugmentImageCoordinates,
    DataFromList,
    MultiProcessRunner,
    imgaug,
    worker_seed_scope,
)
from bridgeflow._errors import DatapointError
from bridgeflow.testing import check_dataflow
from conftest import need


def images(n: int = 6, h: int = 6, w: int = 8) -> list:
    rng = np.random.RandomState(0)
    return [[rng.randint(0, 256, (h, w, 3)).astype(np.uint8), i] for i in range(n)]


def run(df, seed: int | None = 0) -> list:
    with worker_seed_scope(seed) if seed is not None else _nothing():
        df.reset_state()
    return list(df)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class InPlaceInvert(imgaug.PhotometricAugmentor):
    def _augment(self, img, _):
        np.subtract(255, img, out=img)
        return img


class FailOn(imgaug.PhotometricAugmentor):
    """Raises for images whose first pixel is ``bad``."""

    def __init__(self, bad):
        self.bad = bad

    def _augment(self, img, _):
        if img.flat[0] == self.bad:
            raise ValueError(f"cannot augment an image starting with {self.bad}")
        return img


# --- AugmentImageComponent ------------------------------------------------------------------------------

def test_component_by_position_key_and_tuple():
    src = images()
    got = run(AugmentImageComponent(DataFromList(src, shuffle=False), [imgaug.Flip(horiz=True, prob=1.0)]))
    assert [dp[1] for dp in got] == list(range(6))
    for (img, _), (orig, _) in zip(got, src):
        np.testing.assert_array_equal(img, orig[:, ::-1])
    dicts = [{"label": i, "img": img} for img, i in src]
    got = run(AugmentImageComponent(DataFromList(dicts, shuffle=False), imgaug.CenterCrop(4), index="img"))
    assert all(set(dp) == {"label", "img"} and dp["img"].shape == (4, 4, 3) for dp in got)
    tuples = [tuple(dp) for dp in src]
    got = run(AugmentImageComponent(DataFromList(tuples, shuffle=False), [imgaug.CenterCrop(4)]))
    assert all(isinstance(dp, tuple) for dp in got)


def test_copy_protects_the_source():
    src = images(2)
    before = [img.copy() for img, _ in src]
    got = run(AugmentImageComponent(DataFromList(src, shuffle=False), [InPlaceInvert()]))
    for (img, _), orig in zip(got, before):
        np.testing.assert_array_equal(img, 255 - orig)
    for (img, _), orig in zip(src, before):
        np.testing.assert_array_equal(img, orig)  # untouched
    run(AugmentImageComponent(DataFromList(src, shuffle=False), [InPlaceInvert()], copy=False))
    np.testing.assert_array_equal(src[0][0], 255 - before[0])  # copy=False: the augmentor wrote into it


def test_catch_exceptions_drops_and_logs(caplog):
    src = images(5)
    bad = int(src[2][0].flat[0])
    with pytest.raises(ValueError, match=f"starting with {bad}"):
        run(AugmentImageComponent(DataFromList(src, shuffle=False), [FailOn(bad)]))
    df = AugmentImageComponent(DataFromList(src, shuffle=False), [FailOn(bad)], catch_exceptions=True)
    with caplog.at_level(logging.ERROR, logger="bridgeflow._augment"):
        got = run(df)
    assert [dp[1] for dp in got] == [0, 1, 3, 4]
    assert df.stats() == {"AugmentImageComponent": {"augment_errors": 1.0}}  # by path: the stage itself
    assert "augmentation failed" in caplog.text and f"starting with {bad}" in caplog.text


def test_bad_components_are_named():
    with pytest.raises(TypeError, match="component 0 must be a numpy array"):
        run(AugmentImageComponent(DataFromList([[[1, 2], 0]], shuffle=False), [imgaug.Flip(horiz=True)]))
    with pytest.raises(TypeError, match="component 1 has dtype int32"):
        run(AugmentImageComponent(DataFromList([[0, np.zeros((2, 2), np.int32)]], shuffle=False),
                                  [imgaug.Flip(horiz=True)], index=1))
    with pytest.raises(DatapointError, match="component 'img' is missing"):
        run(AugmentImageComponent(DataFromList([{"image": np.zeros((2, 2), np.uint8)}], shuffle=False),
                                  [imgaug.Flip(horiz=True)], index="img"))
    with pytest.raises(TypeError, match="augmentor 1: 42 is not an augmentor"):
        AugmentImageComponent(DataFromList([[0]]), [imgaug.Flip(horiz=True), 42])


def test_contract_and_reproducibility():
    make = lambda: AugmentImageComponent(DataFromList(images(8), shuffle=False),
                                         [imgaug.RandomCrop(4), imgaug.Flip(horiz=True)])
    first = check_dataflow(make(), deterministic=False)
    assert len(first) == 8 and first[0][0].shape == (4, 4, 3)
    a, b, c = run(make(), 5), run(make(), 5), run(make(), 6)
    assert [x[0].tobytes() for x in a] == [x[0].tobytes() for x in b]
    assert [x[0].tobytes() for x in a] != [x[0].tobytes() for x in c]


def test_workers_augment_differently_and_reproducibly(leak_check):
    same = [[np.arange(100, dtype=np.uint8).reshape(10, 10, 1), 0]] * 8
    make = lambda: AugmentImageComponent(DataFromList(same, shuffle=False), [imgaug.RandomCrop(3)])

    def stream(worker_seed):  # what a worker with this seed yields: its copy is reset inside its seed scope
        df = make()
        with worker_seed_scope(worker_seed):
            df.reset_state()
        return [int(dp[0][0, 0, 0]) for _ in range(3) for dp in df]

    expected = [stream(11), stream(12)]  # the stage's seed 11 gives workers 0 and 1 the seeds 11 and 12
    assert expected[0] == stream(11), "the same worker seed must give the same augmentations"
    assert expected[0] != expected[1], "two workers cropped the same windows"

    def per_worker(seed):
        tagged = bf.MapData(make(), lambda dp: [int(dp[0][0, 0, 0]), os.getpid()])
        with MultiProcessRunner(tagged, num_proc=2, num_prefetch=4, seed=seed) as df:
            df.reset_state()
            out: dict = {}
            for crop, pid in (dp for _ in range(2) for dp in df):
                out.setdefault(pid, []).append(crop)
            return list(out.values())

    # Which worker delivers how many depends on timing, but each worker's own sequence is its stream's prefix.
    got = per_worker(11)
    assert sum(map(len, got)) == 16
    matched = [next(k for k, e in enumerate(expected) if e[:len(seq)] == seq) for seq in got]
    assert len(set(matched)) == len(got), f"two workers gave the same stream: {got}"


# --- several components, coordinates ------------------------------------------------------------------

def test_components_share_the_transform_and_coords_follow():
    rng = np.random.RandomState(1)
    pts = []
    for i in range(30):
        img = rng.randint(0, 200, (12, 16, 3)).astype(np.uint8)
        row, col = rng.randint(12), rng.randint(16)
        img[row, col] = 255  # the only 255: a marker the coordinates point at
        pts.append([img, img[:, :, 0].copy(), np.array([[col + 0.5, row + 0.5]], np.float32), i])
    augs = [imgaug.RandomCrop((10, 12)), imgaug.Flip(horiz=True), imgaug.Transpose()]
    got = run(AugmentImageComponents(DataFromList(pts, shuffle=False), augs, index=(0, 1), coords_index=(2,)))
    shapes, inside = set(), 0
    for img, mask, coords, _ in got:
        assert mask.ndim == 2
        np.testing.assert_array_equal(img[:, :, 0], mask)  # the mask got the same crop, flip and transpose
        x, y = coords[0]
        marker = np.argwhere(img[:, :, 0] == 255)
        if 0 <= x < img.shape[1] and 0 <= y < img.shape[0]:
            inside += 1
            assert marker.tolist() == [[int(y), int(x)]]
        else:
            assert len(marker) == 0
        shapes.add(img.shape)
    assert shapes == {(10, 12, 3), (12, 10, 3)} and inside > 15


def test_components_mask_matches_image_geometry():
    img = np.arange(48, dtype=np.uint8).reshape(6, 8, 1)
    mask = np.arange(48, dtype=np.uint8).reshape(6, 8)
    augs = [imgaug.RandomCrop((4, 5)), imgaug.Flip(horiz=True), imgaug.Transpose()]
    got = run(AugmentImageComponents(DataFromList([[img, mask]] * 30, shuffle=False), augs))
    for out_img, out_mask in got:
        np.testing.assert_array_equal(out_img[:, :, 0], out_mask)
    assert len({dp[0].tobytes() for dp in got}) > 5


def test_coordinates_flow_and_validation():
    img = np.zeros((6, 8, 3), np.uint8)
    coords = np.array([[1.0, 2.0], [7.5, 5.5]], np.float32)
    got = run(AugmentImageCoordinates(DataFromList([[img, coords]], shuffle=False),
                                      [imgaug.Flip(horiz=True, prob=1.0), imgaug.CenterCrop((4, 8))]))
    np.testing.assert_allclose(got[0][1], [[7.0, 1.0], [0.5, 4.5]])
    np.testing.assert_array_equal(coords, [[1.0, 2.0], [7.5, 5.5]])  # the source's array is unchanged
    with pytest.raises(ValueError, match=r"\(N, 2\)"):
        run(AugmentImageCoordinates(DataFromList([[img, np.zeros((3, 3), np.float32)]]), [imgaug.Identity()]))
    with pytest.raises(TypeError, match="floating point"):
        run(AugmentImageCoordinates(DataFromList([[img, np.zeros((3, 2), np.int64)]]), [imgaug.Identity()]))
    with pytest.raises(ValueError, match="non-empty sequence"):
        AugmentImageComponents(DataFromList([[img]]), [imgaug.Identity()], index=0)


# --- other libraries and plain functions ----------------------------------------------------------------

def test_plain_function():
    got = run(AugmentImageComponent(DataFromList(images(2), shuffle=False), lambda im: im // 2))
    np.testing.assert_array_equal(got[0][0], images(2)[0][0] // 2)


def test_albumentations_pipeline_shared_and_seeded():
    A = need("albumentations")  # here, not at the top: seconds of import in every test process otherwise
    pipeline = A.Compose([A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=1.0)])
    src = [[img, img.copy(), i] for img, i in images(12)]

    def aug(seed):
        return run(AugmentImageComponents(DataFromList(src, shuffle=False), pipeline, index=(0, 1)), seed)

    got = aug(3)
    for a, b, _ in got:
        np.testing.assert_array_equal(a, b)  # one random draw for both images
    assert [dp[0].tobytes() for dp in got] == [dp[0].tobytes() for dp in aug(3)]
    assert [dp[0].tobytes() for dp in got] != [dp[0].tobytes() for dp in aug(4)]
    flips = run(AugmentImageComponent(DataFromList(images(12), shuffle=False), A.HorizontalFlip(p=0.5)))
    flipped = [np.array_equal(out, orig[:, ::-1]) for (out, _), (orig, _) in zip(flips, images(12))]
    for (out, _), (orig, _), f in zip(flips, images(12), flipped):
        np.testing.assert_array_equal(out, orig[:, ::-1] if f else orig)
    assert 0 < sum(flipped) < 12
    with pytest.raises(NotImplementedError, match="cannot move coordinates"):
        run(AugmentImageCoordinates(DataFromList([[images(1)[0][0], np.zeros((1, 2), np.float32)]]),
                                    A.HorizontalFlip(p=1.0)))


class StandInRandomHorizontalFlip:
    """What a torchvision v2 transform does that matters here, without torchvision (not installable beside
    torch 2.13 on this machine): it flips CHW tensors with torch's generator and passes anything else through
    unchanged, as v2 does with numpy arrays."""

    __module__ = "torchvision.transforms.v2._geometry"

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, x):
        import torch

        if not isinstance(x, torch.Tensor):
            return x
        return x.flip(-1) if torch.rand(1).item() < self.p else x


def test_torchvision_style_transform():
    torch = need("torch")
    src = [[img, img.copy(), i] for img, i in images(16, 5, 7)]
    before = torch.random.get_rng_state()
    got = run(AugmentImageComponents(DataFromList(src, shuffle=False), [StandInRandomHorizontalFlip()], index=(0, 1)))
    assert torch.equal(before, torch.random.get_rng_state())  # torch's global generator is left as it was
    n_flipped = 0
    for (a, b, _), (orig, _, _) in zip(got, src):
        assert a.shape == (5, 7, 3) and a.dtype == np.uint8
        np.testing.assert_array_equal(a, b)
        if np.array_equal(a, orig[:, ::-1]):
            n_flipped += 1
        else:
            np.testing.assert_array_equal(a, orig)
    assert 0 < n_flipped < 16  # HWC went in as CHW: the flip acted on the width, randomly
    gray = run(AugmentImageComponent(DataFromList([[np.arange(6, dtype=np.uint8).reshape(2, 3)]]),
                                     [StandInRandomHorizontalFlip(p=1.0)]))
    np.testing.assert_array_equal(gray[0][0], [[2, 1, 0], [5, 4, 3]])
    assert isinstance(imgaug.as_augmentor(StandInRandomHorizontalFlip()), imgaug.TorchvisionAugmentor)


def test_augmented_flows_resume_with_the_same_random_draws():
    from bridgeflow.testing import check_resumable

    def make():
        src = DataFromList(images(9), shuffle=True, seed=3)
        augs = imgaug.AugmentorList([imgaug.RandomCrop(4), imgaug.RandomApplyAug(imgaug.Flip(horiz=True), 0.5),
                                     imgaug.Brightness(20)])
        augs.seed = 7  # the children are seeded from the list's generator
        return AugmentImageComponent(src, augs)

    first = check_resumable(make, positions=[0, 1, 4, 9])
    assert len(first) == 9
    def two():
        augs = imgaug.AugmentorList([imgaug.RandomCrop(3)])
        augs.seed = 1
        return AugmentImageComponents(DataFromList([[im, im.copy(), i] for im, i in images(5)], shuffle=False),
                                      augs, index=(0, 1))

    check_resumable(two)


def test_augmented_state_names_a_different_pipeline():
    from bridgeflow._state import StateMismatchError

    a = AugmentImageComponent(DataFromList(images(3), shuffle=False), [imgaug.RandomCrop(4)])
    a.reset_state()
    state = a.state_dict()
    b = AugmentImageComponent(DataFromList(images(3), shuffle=False), [imgaug.RandomCrop(4), imgaug.Flip(horiz=True)])
    with pytest.raises(StateMismatchError, match="AugmentImageComponent.*2 augmentors' generators, this flow has 3"):
        b.load_state_dict(state)
