"""Canary tests for the private torch internals used in bridgeflow.adapters.torch._compat.

If a torch release moves them, these fail first and point at the one module to fix.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import need

need("torch")

import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import _compat


@pytest.fixture
def clean_worker_info():
    yield
    _compat.clear_worker_info()


def test_worker_info_global_and_class_exist(clean_worker_info):
    """What set_worker_info relies on: the module global, and a WorkerInfo built from these keywords that
    gives them back (torch 2.13 makes it a dataclass, 2.11 does not: only the behaviour counts)."""
    assert hasattr(_compat.WORKER_MODULE, "_worker_info")
    assert tud.get_worker_info() is None  # the test process is not a worker
    dataset = object()
    info = _compat.WORKER_MODULE.WorkerInfo(id=2, num_workers=3, seed=77, dataset=dataset)
    assert (info.id, info.num_workers, info.seed, info.dataset) == (2, 3, 77, dataset)
    _compat.WORKER_MODULE._worker_info = info
    assert tud.get_worker_info() is info


def test_loader_internals_the_adapter_subclasses_or_reads_exist():
    """The iterator base class bridgeflow's iterators derive from (Lightning recognises iterators by it),
    the placeholder sampler of iterable datasets and the dataset-kind enum torch's loader sets."""
    assert isinstance(_compat.BaseLoaderIter, type)
    loader = tud.DataLoader(tud.TensorDataset(torch.zeros(2)))
    assert isinstance(iter(loader), _compat.BaseLoaderIter)
    assert loader._dataset_kind == _compat.DatasetKind.Map

    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter([1, 2])

    stream_loader = tud.DataLoader(Stream())
    assert isinstance(stream_loader.sampler, _compat.InfiniteConstantSampler)
    assert stream_loader._dataset_kind == _compat.DatasetKind.Iterable
    assert stream_loader._index_sampler is stream_loader.batch_sampler and stream_loader._auto_collation


def test_loader_attributes_read_through_compat_are_torchs():
    """The private attributes of torch's DataLoader the adapter reads (and two it sets), through _compat only:
    the index sampler, whether it collates, the length len() reported for an iterable, the dataset kind, and
    the iterator held for persistent workers."""
    loader = tud.DataLoader(list(range(6)), batch_size=4)
    assert _compat.index_sampler(loader) is loader.batch_sampler and _compat.auto_collation(loader)
    unbatched = tud.DataLoader(list(range(6)), batch_size=None)
    assert _compat.index_sampler(unbatched) is unbatched.sampler and not _compat.auto_collation(unbatched)
    assert not _compat.read_as_iterable(loader) and _compat.iterable_length_seen(loader) is None

    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter([1, 2])

        def __len__(self):
            return 2

    stream_loader = tud.DataLoader(Stream())
    assert _compat.read_as_iterable(stream_loader)
    assert len(stream_loader) == 2 and _compat.iterable_length_seen(stream_loader) == 2
    _compat.read_as_iterable(loader, True)  # what the adapter does for a DataFlow read as a stream
    assert loader._dataset_kind == _compat.DatasetKind.Iterable
    persistent = tud.DataLoader(list(range(4)), num_workers=1, persistent_workers=True)
    assert _compat.held_iterator(persistent) is None
    it = iter(persistent)
    assert _compat.held_iterator(persistent) is it
    _compat.set_held_iterator(persistent, None)
    assert persistent._iterator is None
    it._shutdown_workers()


def test_datapipe_settings_functions_shard_and_seed():
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(6)).sharding_filter()
    _compat.apply_sharding(pipe, 2, 1)
    assert list(pipe) == [1, 3, 5]
    shuffled = IterableWrapper(range(20)).shuffle().set_shuffle(True)
    orders = [list(_compat.apply_random_seed(shuffled, torch.Generator().manual_seed(4))) for _ in range(2)]
    assert orders[0] == orders[1] != list(range(20))
    assert _compat.distributed_settings() == (1, 0) and _compat.seed_group() is None


def test_the_datapipe_wrapper_torchs_loader_sends_to_workers_round_trips():
    import pickle

    from torch.utils.data.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.map import SequenceWrapper

    assert isinstance(tud.DataLoader(IterableWrapper(range(2))).dataset, _compat.IterDataPipe)
    for pipe in (IterableWrapper(range(3)), SequenceWrapper([0, 1, 2])):
        sent = pickle.loads(pickle.dumps(_compat.pipe_for_workers(pipe)))
        assert type(sent).__name__.endswith("SerializationWrapper")  # torch's: pickle, else dill
        back = _compat.pipe_from_parent(sent)
        assert type(back) is type(pipe) and list(back) == [0, 1, 2]
    assert _compat.pipe_for_workers([1]) == [1] and _compat.pipe_from_parent([1]) == [1]


def test_set_worker_info_is_what_get_worker_info_returns(clean_worker_info):
    dataset = object()
    _compat.set_worker_info(1, 4, 12345, dataset)
    info = tud.get_worker_info()
    assert (info.id, info.num_workers, info.seed) == (1, 4, 12345) and info.dataset is dataset
    with _compat.worker_info_suspended():
        assert tud.get_worker_info() is None
    assert tud.get_worker_info() is info
    _compat.clear_worker_info()
    assert tud.get_worker_info() is None


def test_default_collate_uses_torch_shared_memory_only_inside_a_worker(clean_worker_info):
    """Why fetch.py hides the worker info around the default collate: inside a worker, torch's collate
    allocates a fresh torch shared-memory segment per batch."""
    batch = [torch.zeros(4), torch.ones(4)]
    assert not _compat.default_collate(batch).is_shared()
    _compat.set_worker_info(0, 1, 0, None)
    assert _compat.default_collate(batch).is_shared()
    with _compat.worker_info_suspended():
        assert not _compat.default_collate(batch).is_shared()


@pytest.mark.parametrize("base_seed", [0, 1, 2**31 + 7, 2**32, 12345678901234567, 2**63 - 1, -5])
@pytest.mark.parametrize("worker_id", [0, 1, 7])
def test_numpy_seed_equals_torchs_private_derivation(base_seed, worker_id):
    reference = _compat.torch_generate_state(base_seed, worker_id)
    assert reference is not None, "torch.utils.data._utils.worker._generate_state is gone"
    assert _compat.numpy_seed(base_seed, worker_id).tolist() == reference


def test_numpy_seed_words_seed_numpy():
    np.random.seed(_compat.numpy_seed(3, 1))
    a = np.random.randint(1 << 30, size=4)
    np.random.seed(_compat.torch_generate_state(3, 1))
    assert np.array_equal(a, np.random.randint(1 << 30, size=4))


def test_accelerator_probe_agrees_with_torch():
    assert _compat.accelerator_available() == torch.accelerator.is_available()
    assert _compat.cpu_count() >= 1


def _same_or_same_error(batch):
    def run(fn):
        try:
            return fn(batch)
        except Exception as exc:
            return type(exc), str(exc)
    return run(tud.default_collate), run(_compat.fast_default_collate)


@pytest.mark.parametrize("batch", [
    [np.full((2, 3), i, dtype=np.uint8) for i in range(4)],
    [np.arange(3, dtype=np.float16), np.arange(3, dtype=np.float16)],
    [np.arange(3, dtype=">i4"), np.arange(3, dtype=">i4")],  # non-native byte order: torch decides
    [np.arange(3), np.arange(4)],  # ragged: torch's error
    [np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)],  # mixed dtypes: torch's promotion rules
    [np.array(["a", "b"]), np.array(["c", "d"])],  # strings: torch's TypeError
    [torch.arange(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)],
    [torch.arange(6).reshape(2, 3).t(), torch.zeros(3, 2, dtype=torch.int64)],  # non-contiguous
    [{"img": np.ones((2, 2), np.float32), "y": 1}, {"img": np.zeros((2, 2), np.float32), "y": 2}],
    [(torch.ones(2), "a"), (torch.zeros(2), "b")],
])
def test_fast_default_collate_equals_default_collate(batch):
    ref, got = _same_or_same_error(batch)
    if isinstance(ref, tuple) and len(ref) == 2 and isinstance(ref[0], type):
        assert got == ref
        return
    flat_ref, flat_got = [ref], [got]
    while flat_ref:
        a, b = flat_ref.pop(), flat_got.pop()
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            flat_ref.extend(a.values())
            flat_got.extend(b.values())
        elif isinstance(a, (list, tuple)):
            flat_ref.extend(a)
            flat_got.extend(b)
        else:
            assert a == b


def test_fast_default_collate_respects_a_users_handler(monkeypatch):
    table = _compat.COLLATE_MODULE.default_collate_fn_map
    monkeypatch.setitem(table, np.ndarray, lambda batch, *, collate_fn_map=None: "mine")
    assert _compat.fast_default_collate([np.zeros(2), np.ones(2)]) == "mine"


def test_no_module_but_compat_touches_torchs_private_names():
    """Every private name of torch's data loading is reached through _compat (these canaries cover them)."""
    import pathlib
    import re

    private = re.compile(r"\._(index_sampler|auto_collation|IterableDataset_len_called|dataset_kind|iterator|utils|"
                         r"worker_info|DatasetKind|BaseDataLoaderIter|InfiniteConstantSampler|get_iterator\(|"
                         r"generate_state|share_dist_seed)\b")
    package = pathlib.Path(_compat.__file__).parent
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted(package.glob("*.py")) if path.name != "_compat.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert not found, "\n".join(found)
