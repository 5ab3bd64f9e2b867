"""The regression check's case names (benchmarks/compare.py) against the benchmark that runs them: ``--cases
torch`` once expanded to nothing, silently, after bench_torch's default list stopped being string literals."""

from __future__ import annotations

import os

from conftest import need, source_tree

BENCHMARKS = os.path.join(source_tree(), "benchmarks")


def test_torch_expands_to_every_sample_shape_bench_torch_runs(monkeypatch):
    need("torch")  # bench_torch imports it
    monkeypatch.syspath_prepend(BENCHMARKS)
    import compare

    names = compare.torch_cases()
    assert names and names == [f"torch:{name}" for name in compare.bench_torch_module().CASES]
