"""The regression check's case names (benchmarks/compare.py) against the benchmark that runs them: ``--cases
torch`` once expanded to nothing, silently, after bench_torch's default list stopped being string literals."""

from __future__ import annotations

import importlib.util
import os
import sys

from conftest import need

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_torch_expands_to_every_sample_shape_bench_torch_runs():
    need("torch")  # bench_torch imports it
    compare, bench_torch = load("compare"), load("bench_torch")
    names = compare.torch_cases()
    assert names and names == [f"torch:{name}" for name in bench_torch.CASES]
