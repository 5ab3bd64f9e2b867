"""Differential property test: generated samples through torch's DataLoader and bridgeflow's give the same batches.

Hypothesis builds a sample *template* (dicts, lists, tuples, namedtuples, dataclasses over ints, floats, bools,
None, strings, bytes, numpy scalars, numpy arrays of many dtypes and shapes, 0-d and non-contiguous ones, and
tensors likewise), a dataset of samples following it (values from a seeded generator), and the loader's
settings; both loaders read it with 0 and 2 workers under each collation: torch's default, none
(``batch_size=None``), a list of the samples, a padding ``collate_fn`` and one returning a dict of tensors. The
batches must match leaf for leaf: container types, dtypes, shapes, bytes (NaNs included), and an error where
torch raises one, of the same type. Derandomized, with modest example counts.

Known, documented difference (docs/torch.md): a tensor or array that a worker returns without collation
arrives contiguous (torch keeps a view's strides); strides are compared only where torch's are its collation's.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from collections import namedtuple
from typing import Any

import numpy as np
import pytest

from conftest import need

need("torch")

import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridgeflow.adapters.torch import DataLoader

Pair = namedtuple("Pair", ["a", "b"])
Triple = namedtuple("Triple", ["a", "b", "c"])


@dataclasses.dataclass
class Record:
    a: Any
    b: Any


NP_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
             "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64, torch.complex64]
SHAPES = st.lists(st.sampled_from([1, 2, 3, 0]), min_size=0, max_size=3).map(tuple)


# --- templates and the samples made from them -------------------------------------------------------------

def _leaves() -> st.SearchStrategy:
    return st.one_of(
        st.sampled_from([("int",), ("float",), ("bool",), ("none",), ("str",), ("bytes",)]),
        st.tuples(st.just("npscalar"), st.sampled_from(NP_DTYPES)),
        st.tuples(st.just("np"), st.sampled_from(NP_DTYPES), SHAPES, st.booleans()),
        st.tuples(st.just("tensor"), st.sampled_from(TORCH_DTYPES), SHAPES, st.booleans()),
    )


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    keys = st.sampled_from(["x", "y", "label", "meta", "ids"])
    return st.one_of(
        st.dictionaries(keys, children, min_size=1, max_size=3).map(lambda d: ("dict", d)),
        st.lists(children, min_size=1, max_size=3).map(lambda items: ("list", items)),
        st.lists(children, min_size=1, max_size=3).map(lambda items: ("tuple", items)),
        st.tuples(st.just("namedtuple"), st.lists(children, min_size=2, max_size=3)),
        st.tuples(st.just("dataclass"), st.lists(children, min_size=2, max_size=2)),
    )


TEMPLATES = st.recursive(_leaves(), _containers, max_leaves=6)


def _array(rng: np.random.Generator, dtype: str, shape: tuple, strided: bool) -> np.ndarray:
    """Values of ``dtype`` (NaNs among floats); ``strided``: a transposed view (2-d and more) or every other
    element of a longer array (1-d)."""
    sliced = strided and len(shape) == 1
    full = (shape[0] * 2,) if sliced else shape
    raw = rng.standard_normal(full) * 50
    if dtype == "bool":
        a = raw > 0
    elif dtype.startswith("complex"):
        a = (raw + 1j * rng.standard_normal(full)).astype(dtype)
    elif dtype.startswith("uint"):
        a = np.abs(raw).astype(dtype)
    elif dtype.startswith("int"):
        a = raw.astype(dtype)
    else:
        a = raw.astype(dtype)
        if a.size and rng.random() < 0.3:
            a.flat[0] = np.nan
    if sliced:
        return a[::2]
    return a.T if strided and len(shape) >= 2 else a


def _tensor(rng: np.random.Generator, dtype: Any, shape: tuple, strided: bool) -> torch.Tensor:
    if dtype == torch.bool:
        base = torch.from_numpy(np.ascontiguousarray(_array(rng, "bool", shape, False)))
    elif dtype == torch.complex64:
        base = torch.from_numpy(np.ascontiguousarray(_array(rng, "complex64", shape, False)))
    else:
        base = torch.from_numpy(np.ascontiguousarray(_array(rng, "float64", shape, False))).to(dtype)
    if strided and len(shape) >= 2:
        return base.transpose(0, 1)
    if strided and shape:
        return torch.cat([base, base], dim=-1)[..., ::2]
    return base


def make(template: tuple, rng: np.random.Generator) -> Any:
    kind = template[0]
    if kind == "int":
        return int(rng.integers(-1000, 1000))
    if kind == "float":
        return float(rng.standard_normal())
    if kind == "bool":
        return bool(rng.integers(0, 2))
    if kind == "none":
        return None
    if kind == "str":
        return "s" * int(rng.integers(0, 5))
    if kind == "bytes":
        return bytes(rng.integers(0, 256, int(rng.integers(0, 5)), dtype=np.uint8))
    if kind == "npscalar":
        return _array(rng, template[1], (), False)[()]
    if kind == "np":
        return _array(rng, *template[1:])
    if kind == "tensor":
        return _tensor(rng, *template[1:])
    if kind == "dict":
        return {k: make(t, rng) for k, t in template[1].items()}
    items = [make(t, rng) for t in template[1]]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "namedtuple":
        return (Pair if len(items) == 2 else Triple)(*items)
    return Record(*items)


class Samples(tud.Dataset):
    def __init__(self, samples: list) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


# --- the collate functions a user writes ------------------------------------------------------------------

def identity(samples: list) -> list:
    return samples


def pad_collate(samples: list) -> dict:
    """Pads each sample's ``ids`` (a list of ints, an int64 array or tensor of its own length) to the longest;
    the rest by torch's default collation."""
    ids = [torch.as_tensor(s["ids"]) for s in samples]
    return {"ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=0),
            "lengths": torch.tensor([len(i) for i in ids]),
            "rest": tud.default_collate([s["rest"] for s in samples])}


def _numeric_leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _numeric_leaves(v, f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _numeric_leaves(v, f"{path}/{i}")]
    if dataclasses.is_dataclass(obj):
        return [x for f in dataclasses.fields(obj) for x in _numeric_leaves(getattr(obj, f.name), f"{path}/{f.name}")]
    if isinstance(obj, (bool, int, float, np.number, np.bool_, torch.Tensor)) or (
            isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc"):
        return [(path, obj)]
    return []


def dict_of_tensors(samples: list) -> dict:
    """A user's collate returning a dict of tensors: each numeric leaf, stacked, under its path."""
    columns: dict[str, list] = {}
    for s in samples:
        for path, leaf in _numeric_leaves(s):
            columns.setdefault(path, []).append(leaf if isinstance(leaf, torch.Tensor) else torch.as_tensor(leaf))
    return {path: torch.stack(col) for path, col in columns.items()}


# --- comparing outcomes -----------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_identical(a: Any, b: Any, strides: bool, path: str = "batch") -> None:
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert _bits(a) == _bits(b), f"{path}: values differ\n{a}\n{b}"
        assert a.requires_grad == b.requires_grad, path
        if strides and a.numel():  # an empty tensor's strides say nothing
            assert a.stride() == b.stride(), f"{path}: strides {a.stride()} != {b.stride()}"
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: values differ"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], strides, f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, strides, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_identical(getattr(a, f.name), getattr(b, f.name), strides, f"{path}.{f.name}")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), f"{path}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def outcome(loader: Any) -> list:
    """Every batch of one epoch, or ("raised", type) where it raised (the epoch goes on, as torch's does)."""
    out = []
    it = iter(loader)
    for _ in range(100):
        try:
            out.append(next(it))
        except StopIteration:
            break
        except Exception as exc:
            out.append(("raised", type(exc)))
            if isinstance(exc, RuntimeError) and "worker" in str(exc) and "exited" in str(exc):
                break
    del it
    return out


def check(samples: list, num_workers: int, strides: bool, **options: Any) -> None:
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. torch's note on non-writable numpy arrays
        for cls in (tud.DataLoader, DataLoader):
            loader = cls(Samples(samples), num_workers=num_workers, **options)
            results.append(outcome(loader))
            if hasattr(loader, "close"):
                loader.close()
    want, got = results
    assert len(want) == len(got), f"{len(want)} batches from torch's loader, {len(got)} from bridgeflow's"
    for i, (a, b) in enumerate(zip(want, got)):
        if isinstance(a, tuple) and a[:1] == ("raised",) or isinstance(b, tuple) and b[:1] == ("raised",):
            assert a == b, f"batch {i}: torch gave {a if a[:1] == ('raised',) else 'a batch'}, bridgeflow {b}"
            continue
        assert_identical(a, b, strides, f"batch {i}")


def examples(n: int) -> settings:
    return settings(derandomize=True, deadline=None, database=None, max_examples=n,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SIZES = st.tuples(st.integers(1, 7), st.integers(1, 3), st.booleans(), st.integers(0, 2**32 - 1))


def _samples(template: tuple, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [make(template, rng) for _ in range(n)]


@pytest.mark.parametrize("num_workers,n", [(0, 40), (2, 12)])
def test_default_collation_matches_torch(num_workers, n, leak_check):
    @examples(n)
    @given(template=TEMPLATES, sizes=SIZES)
    def run(template, sizes):
        n, batch_size, drop_last, seed = sizes
        check(_samples(template, n, seed), num_workers, True, batch_size=batch_size, drop_last=drop_last)

    run()


@pytest.mark.parametrize("num_workers,n", [(0, 30), (2, 10)])
def test_without_collation_matches_torch(num_workers, n, leak_check):
    """``batch_size=None``: each sample through torch's ``default_convert``, one task per sample."""
    @examples(n)
    @given(template=TEMPLATES, sizes=SIZES)
    def run(template, sizes):
        n, _, _, seed = sizes
        check(_samples(template, n, seed), num_workers, False, batch_size=None)

    run()


@pytest.mark.parametrize("num_workers,n", [(0, 25), (2, 8)])
@pytest.mark.parametrize("collate", [identity, dict_of_tensors])
def test_user_collate_functions_match_torch(collate, num_workers, n, leak_check):
    @examples(n)
    @given(template=TEMPLATES, sizes=SIZES)
    def run(template, sizes):
        n, batch_size, drop_last, seed = sizes
        check(_samples(template, n, seed), num_workers, collate is dict_of_tensors, batch_size=batch_size,
              drop_last=drop_last, collate_fn=collate)

    run()


@pytest.mark.parametrize("num_workers,n", [(0, 25), (2, 8)])
def test_a_padding_collate_matches_torch(num_workers, n, leak_check):
    ids_kinds = st.sampled_from(["list", "array", "tensor"])

    @examples(n)
    @given(rest=TEMPLATES, ids=ids_kinds, sizes=SIZES)
    def run(rest, ids, sizes):
        n, batch_size, drop_last, seed = sizes
        rng = np.random.default_rng(seed)
        samples = []
        for _ in range(n):
            tokens = rng.integers(1, 30_000, int(rng.integers(1, 7)))
            value = tokens.tolist() if ids == "list" else tokens if ids == "array" else torch.from_numpy(tokens)
            samples.append({"ids": value, "rest": make(rest, rng)})
        check(samples, num_workers, True, batch_size=batch_size, drop_last=drop_last, collate_fn=pad_collate)

    run()
