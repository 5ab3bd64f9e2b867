"""A worker's fused batch (``map_group``): the batch ``batch_datapoints`` makes of the same datapoints, exactly,
built row by row as they are mapped; and what a W1-like worker holds while it maps."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bridgeflow as bf
from bridgeflow.parallel._fused import BatchTask, Stacked, map_group


def _same(a, b) -> None:
    """Equal values, dtypes, shapes and container types, all the way down."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert repr(a) == repr(b)


class Arena:
    """A stand-in for the shared-memory writer: ``reserve`` returns an allocator that records its arrays."""

    def __init__(self) -> None:
        self.reserved: list[int] = []
        self.arrays: list[np.ndarray] = []

    def reserve(self, nbytes: int):
        self.reserved.append(nbytes)
        return self.alloc

    def alloc(self, shape, dtype):
        out = np.empty(shape, dtype)
        self.arrays.append(out)
        return out


def reference(outs: list, size: int, use_list, pad_value):
    """What the worker returned before rows: the mapped datapoints, stacked when none was dropped."""
    mapped = [o for o in outs if o is not None]
    if len(mapped) != size:
        return mapped
    return Stacked(bf.batch_datapoints(mapped, use_list, pad_value))


def run_both(outs: list, size: int, use_list=False, pad_value=None, reserve=None):
    task = BatchTask(list(range(len(outs))), size, use_list, pad_value)
    try:
        want = reference(outs, size, use_list, pad_value)
    except Exception as exc:  # the same error, from the same place
        with pytest.raises(type(exc)) as info:
            map_group(task, outs.__getitem__, reserve)
        assert str(info.value) == str(exc)
        return None
    got = map_group(task, outs.__getitem__, reserve)
    assert type(got) is type(want)
    _same(got.batch if isinstance(got, Stacked) else got, want.batch if isinstance(want, Stacked) else want)
    return got


# --- generated groups: structures, shapes, dtypes, numbers, strings, drops ---------------------------

_dtypes = st.sampled_from([np.uint8, np.int16, np.float32, np.float64, np.bool_])
_shapes = st.sampled_from([(), (3,), (2, 3), (1, 2, 2)])


@st.composite
def _value(draw, shape=None, dtype=None):
    kind = draw(st.sampled_from(["array", "array", "int", "float", "str", "list", "obj_array"]))
    if kind == "array":
        shape = draw(_shapes) if shape is None else shape
        dtype = draw(_dtypes) if dtype is None else dtype
        return np.asarray(draw(st.integers(0, 9)) * np.ones(shape)).astype(dtype)
    if kind == "int":
        return draw(st.integers(-5, 300))
    if kind == "float":
        return draw(st.floats(-1, 1, allow_nan=False))
    if kind == "str":
        return draw(st.text(max_size=3))
    if kind == "list":
        return [draw(st.integers(0, 3))]
    return np.array([None, 1], dtype=object)


@st.composite
def groups(draw):
    """A group whose datapoints mostly share a structure (so that stacking is what usually happens), with
    now and then one that differs: another container, shape, dtype, kind of value, key set, or a drop."""
    size = draw(st.integers(1, 6))
    container = draw(st.sampled_from(["list", "tuple", "dict"]))
    width = draw(st.integers(1, 3))
    template = [draw(_value()) for _ in range(width)]

    def like(v, i):
        if isinstance(v, np.ndarray) and v.dtype != object:
            return np.full(v.shape, i % 7, v.dtype)
        if isinstance(v, int):
            return v + i
        return v

    outs = []
    for i in range(draw(st.integers(max(1, size - 1), size))):
        values = [like(v, i) for v in template]
        if draw(st.integers(0, 9)) == 0:  # an odd one
            j = draw(st.integers(0, width - 1))
            values[j] = draw(_value())
        dp: object
        odd_container = draw(st.integers(0, 14)) == 0
        kind = draw(st.sampled_from(["list", "tuple", "dict"])) if odd_container else container
        if kind == "dict":
            keys = [f"k{j}" for j in range(width)]
            if draw(st.integers(0, 14)) == 0:
                keys[-1] = "other"
            dp = dict(zip(keys, values))
        elif kind == "tuple":
            dp = tuple(values)
        else:
            dp = values
        if draw(st.integers(0, 14)) == 0:
            dp = None  # dropped
        outs.append(dp)
    use_list = draw(st.sampled_from([False, True, {0}, {"k1"}]))
    pad_value = draw(st.sampled_from([None, 0]))
    return outs, size, use_list, pad_value


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_rows_make_the_batch_batch_datapoints_makes(group):
    outs, size, use_list, pad_value = group
    run_both(outs, size, use_list, pad_value)
    run_both(outs, size, use_list, pad_value, reserve=Arena().reserve)


# --- the cases by name ---------------------------------------------------------------------------

def image(i, shape=(3, 8, 8)):
    return np.full(shape, i, np.uint8)


def test_a_stacked_batch_is_built_in_the_reserved_memory_once():
    arena = Arena()
    outs = [[image(i), i, f"n{i}"] for i in range(4)]
    got = run_both(outs, 4, reserve=arena.reserve)
    assert len(arena.reserved) == 1 and arena.reserved[0] >= 4 * 3 * 8 * 8
    assert got.batch[0] is arena.arrays[0]  # the rows were written where the batch travels


def test_a_datapoint_that_does_not_fit_the_rows_takes_the_general_path():
    # another shape half-way: padded, as batch_datapoints pads
    outs = [[image(i)] for i in range(3)] + [[image(3, (3, 9, 8))]]
    got = run_both(outs, 4, pad_value=0)
    assert got.batch[0].shape == (4, 3, 9, 8)
    # and without pad_value, the same BatchError
    run_both(outs, 4)
    # another dtype, another container, a number where an array was
    run_both([[image(0)], [image(1).astype(np.int16)]], 2)
    run_both([[image(0), 1], (image(1), 2)], 2)
    run_both([[image(0)], [5]], 2)


def test_a_dropped_datapoint_returns_the_others_unstacked():
    outs = [{"img": image(i), "label": i} for i in range(5)]
    outs[3] = None
    got = run_both(outs, 5, reserve=Arena().reserve)
    assert isinstance(got, list) and len(got) == 4
    outs = [None, [image(1)], [image(2)]]  # the first mapped datapoint is not the first of the group
    run_both(outs, 3)
    run_both([None, None], 2)


def test_a_short_group_at_an_epochs_end_is_returned_unstacked():
    got = run_both([[image(i), i] for i in range(3)], 4)
    assert isinstance(got, list) and len(got) == 3


def test_a_map_error_in_the_middle_of_a_group_propagates():
    def map_one(i):
        if i == 2:
            raise KeyError("sample 2")
        return [image(i)]

    with pytest.raises(KeyError, match="sample 2"):
        map_group(BatchTask([0, 1, 2, 3], 4, False, None), map_one, Arena().reserve)


_FAULTS_SCRIPT = """
import resource, sys
import numpy as np
import bridgeflow as bf
from bridgeflow.parallel import MultiProcessMapData

def image_and_faults(i):  # a new 150 KB image per sample, as a decoder makes, and the worker's faults so far
    return [np.full((3, 224, 224), i % 251, np.uint8), resource.getrusage(resource.RUSAGE_SELF).ru_minflt]

if __name__ == "__main__":
    with bf.BatchData(MultiProcessMapData(bf.DataFromList(list(range(64 * 24)), shuffle=False), 1,
                                          image_and_faults, start_method="fork"), 64) as df:
        df.reset_state()
        counts = [int(b[1][-1]) for b in df]
    # the median batch: a batch whose rows go to a new shared-memory segment faults that segment's pages in
    # (2,400 for 9.6 MB), which happens whenever the consumer holds every segment, more often on a busy machine
    steady = sorted(b - a for a, b in zip(counts[4:], counts[5:]))
    print(steady[len(steady) // 2])
"""


def test_workers_do_not_fault_their_heap_back_in_every_batch(tmp_path):
    """A worker holds one mapped datapoint at a time, so glibc does not give its heap back to the system
    after every batch only to fault it back in (37 page faults per 150 KB sample, 2,400 per batch of 64,
    when a worker held the batch's datapoints until the stack). A fresh interpreter: the allocator's state
    of a process that has run other tests would hide the difference. The median batch, not the mean: on CI's
    busy machine new segments brought the mean to 327 faults a batch; here the median is 78, quiet or loaded."""
    script = tmp_path / "faults.py"
    script.write_text(_FAULTS_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    per_batch = float(out.stdout.split()[-1])
    assert per_batch < 64 * 37 / 8, f"{per_batch:.0f} page faults per batch of 64 150 KB samples"
