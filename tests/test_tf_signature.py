"""Signature inference and datapoint conversion for the TensorFlow adapter."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from bridgeflow._errors import DatapointError
from conftest import need

need("tensorflow")

import tensorflow as tf

from bridgeflow.adapters.tensorflow import Signature, infer_signature


def test_infer_tuple_datapoint_dtypes_and_shapes():
    dp = [np.zeros((2, 3), np.float32), 7, 1.5, True, "text", np.arange(4, dtype=np.uint8)]
    sig = Signature.from_datapoint(dp)
    assert not sig.is_dict and sig.keys == tuple(range(6))
    assert sig.dtypes == [tf.float32, tf.int64, tf.float64, tf.bool, tf.string, tf.uint8]
    assert [s.as_list() for s in sig.shapes] == [[2, 3], [], [], [], [], [4]]
    assert isinstance(sig.structure, tuple) and sig.fully_defined()


def test_infer_dict_datapoint_keeps_key_order_and_names():
    sig = Signature.from_datapoint({"image": np.zeros((4, 4, 3), np.uint8), "label": np.int32(3)})
    assert list(sig.structure) == ["image", "label"]
    assert sig.structure["label"].dtype == tf.int32
    assert sig.specs[0].name == "image"


def test_dynamic_batch_leaves_first_dim_unknown_only_for_arrays():
    spec = infer_signature([np.zeros((8, 5), np.float32), 3], dynamic_batch=True)
    assert spec[0].shape.as_list() == [None, 5]
    assert spec[1].shape.rank == 0
    sig = Signature.from_datapoint([np.zeros((8, 5), np.float32)], dynamic_batch=True)
    assert sig.flatten([np.ones((3, 5), np.float32)])[0].shape == (3, 5)
    assert not sig.fully_defined()


def test_flatten_and_pack_round_trip_dict():
    sig = Signature.from_datapoint({"a": np.ones(2, np.float32), "b": 4})
    flat = sig.flatten({"b": 5, "a": np.full(2, 3, np.float32)})
    assert [f.tolist() for f in flat] == [[3.0, 3.0], 5]
    assert sig.pack(flat)["b"] == 5


def test_explicit_signature_casts_within_kind_and_refuses_across_kinds():
    sig = Signature.from_structure((tf.TensorSpec([2], tf.float32), tf.TensorSpec([], tf.int32)))
    x, y = sig.flatten([[0.5, 1.5], 3])
    assert x.dtype == np.float32 and y.dtype == np.int32
    with pytest.raises(DatapointError, match="component 1.*float64 does not fit.*int32"):
        sig.flatten([[0.5, 1.5], 3.5])


def test_flatten_names_the_bad_component():
    sig = Signature.from_datapoint({"x": np.zeros((2, 2), np.float32), "y": 1})
    with pytest.raises(DatapointError, match=r"component 'x': shape \(3, 2\) does not match"):
        sig.flatten({"x": np.zeros((3, 2), np.float32), "y": 1})
    with pytest.raises(DatapointError, match=r"lacks key\(s\) \['y'\]"):
        sig.flatten({"x": np.zeros((2, 2), np.float32)})
    with pytest.raises(DatapointError, match="expects a dict"):
        sig.flatten([np.zeros((2, 2), np.float32), 1])
    tup = Signature.from_datapoint([1, 2])
    with pytest.raises(DatapointError, match="has 3 components but the signature has 2"):
        tup.flatten([1, 2, 3])
    with pytest.raises(DatapointError, match="expected strings"):
        Signature.from_datapoint(["a"]).flatten([1])


def test_bad_datapoints_and_bad_signatures_are_refused_clearly():
    with pytest.raises(DatapointError, match="must be a list, tuple or dict"):
        Signature.from_datapoint(np.zeros(3))
    with pytest.raises(DatapointError, match="component 0"):
        Signature.from_datapoint([[object(), 1]])
    with pytest.raises(TypeError, match="component 'y' must be a tf.TensorSpec"):
        Signature.from_structure({"x": tf.TensorSpec([], tf.int32), "y": (3,)})
    with pytest.raises(TypeError, match="got int"):
        Signature.from_structure(3)
    with pytest.raises(DatapointError, match="at least one component"):
        Signature.from_datapoint([])


def test_from_structure_accepts_a_single_spec_and_lists():
    sig = Signature.from_structure(tf.TensorSpec([3], tf.float32))
    assert sig.keys == (0,) and sig.specs[0].name == "input0"
    assert Signature.from_structure([tf.TensorSpec([], tf.int64)]).structure[0].dtype == tf.int64
    assert Signature.from_structure(sig) is sig


def test_core_package_stays_free_of_tensorflow():
    code = "import sys, bridgeflow; assert 'tensorflow' not in sys.modules, 'bridgeflow imported tensorflow'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
