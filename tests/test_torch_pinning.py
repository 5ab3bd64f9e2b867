"""SlabPinner: the registration bookkeeping of shared-memory slabs, checked with a fake registrar over
real /dev/shm mappings; CudaHostRegistrar on a GPU (skipped without CUDA)."""

from __future__ import annotations

import gc
import os
import warnings

import numpy as np
import pytest

import bridgeflow
from bridgeflow.parallel._transport import shm
from conftest import need

need("torch")

import torch

from bridgeflow.adapters.torch._pinning import PinningError, SlabPinner, attach_pinner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (read from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


class FakeRegistrar:
    """Records register/unregister calls; checks that a range is still mapped when it is unregistered;
    fails (as a full locked-memory limit would) once ``fail_after`` registrations have succeeded."""

    def __init__(self, fail_after: int | None = None):
        self.calls: list[tuple[str, int]] = []
        self.live: dict[int, int] = {}
        self.unmapped_at_unregister: list[int] = []
        self.fail_after = fail_after

    def register(self, address, nbytes):
        if self.fail_after is not None and sum(op == "register" for op, _ in self.calls) >= self.fail_after:
            raise PinningError("cudaHostRegister of 262144 bytes failed: out of memory (ulimit -l: 8192 KiB)")
        assert address not in self.live, "registered twice without an unregister"
        self.calls.append(("register", address))
        self.live[address] = nbytes

    def unregister(self, address):
        assert address in self.live, "unregistered something not registered"
        if not _mapped(address):
            self.unmapped_at_unregister.append(address)
        self.calls.append(("unregister", address))
        del self.live[address]


class Slabs:
    """Real shared-memory segments mapped the way the core maps slabs; ``unmap`` calls ``closing`` first
    (the hook's contract) and then unmaps."""

    def __init__(self, hooks):
        self.hooks = hooks
        self.maps = {}
        self.n = 0

    def open(self, size=shm.MIN_SLAB):
        name = f"bf{os.getpid()}_pintest{self.n}"
        self.n += 1
        mm = shm.create_segment(name, size)  # a SharedMapping: unmapped when the last reference goes
        shm.unlink_segment(name)  # no /dev/shm entry behind, whatever the test does
        address = mm.address
        self.maps[address] = mm
        self.hooks.opened(mm.name, address, size)
        return address

    def unmap(self, address, call_hook=True):
        mm = self.maps.pop(address)
        if call_hook:
            self.hooks.closing(mm.name, address, mm.nbytes)
        del mm  # the only reference: unmapped here

    def close(self):
        for address in list(self.maps):
            self.unmap(address)


def test_each_mapping_is_registered_once_and_unregistered_once_before_unmap(leak_check):
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    slabs = Slabs(pinner)
    addresses = [slabs.open() for _ in range(3)]
    assert [op for op, _ in registrar.calls] == ["register"] * 3
    assert pinner.registered == {a: shm.MIN_SLAB for a in addresses} and pinner.registrations == 3
    slabs.unmap(addresses[1])  # a slab retired by its worker
    addresses.append(slabs.open(2 * shm.MIN_SLAB))  # a bigger one replaces it
    slabs.close()  # the pool closes
    registers = [a for op, a in registrar.calls if op == "register"]
    unregisters = [a for op, a in registrar.calls if op == "unregister"]
    assert sorted(registers) == sorted(unregisters) == sorted(addresses)
    assert registrar.unmapped_at_unregister == [] and registrar.live == {} and pinner.registered == {}


def test_contains_answers_for_addresses_inside_registered_ranges_only():
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    slabs = Slabs(pinner)
    a = slabs.open()
    assert pinner.contains(a) and pinner.contains(a + 100) and pinner.contains(a + shm.MIN_SLAB - 1)
    assert not pinner.contains(a + shm.MIN_SLAB) and not pinner.contains(a - 1)
    slabs.close()
    assert not pinner.contains(a)


def test_registration_failing_warns_once_and_falls_back(leak_check):
    registrar = FakeRegistrar(fail_after=2)
    pinner = SlabPinner(registrar)
    slabs = Slabs(pinner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        addresses = [slabs.open() for _ in range(5)]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "cannot page-lock" in messages[0] and "ulimit -l" in messages[0]
    assert "copied" in messages[0]
    assert list(pinner.registered) == addresses[:2] and "out of memory" in pinner.failure
    # after the failure no more registrations are tried; the registered ones stay usable
    assert sum(op == "register" for op, _ in registrar.calls) == 2
    assert pinner.contains(addresses[0]) and not pinner.contains(addresses[3])
    slabs.close()
    assert registrar.live == {} and sum(op == "unregister" for op, _ in registrar.calls) == 2


def test_a_registrar_raising_anything_never_reaches_the_reader(leak_check):
    class Broken:
        def register(self, address, nbytes):
            raise OSError("driver gone")

        def unregister(self, address):
            raise AssertionError("never registered")

    pinner = SlabPinner(Broken())
    slabs = Slabs(pinner)
    with pytest.warns(RuntimeWarning, match="driver gone"):
        slabs.open()
    slabs.close()  # closing a mapping that was never registered does nothing
    assert pinner.registered == {}


def test_unregister_failing_is_logged_and_forgotten(caplog):
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    slabs = Slabs(pinner)
    a = slabs.open()

    def failing(address):
        raise PinningError("cudaHostUnregister failed: invalid argument")

    registrar.unregister = failing
    slabs.unmap(a)
    assert pinner.registered == {} and "unregistering" in caplog.text and "invalid argument" in caplog.text


def test_a_stale_registration_is_dropped_before_a_new_mapping_over_it(caplog):
    """A mapping unmapped without ``closing`` (a bug elsewhere) leaves its pages pinned; a new mapping at
    the same address would then be read from the old pages. The pinner unregisters the stale range first."""
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    slabs = Slabs(pinner)
    a = slabs.open()
    slabs.unmap(a, call_hook=False)
    pinner.opened(None, a + 4096, 8192)  # overlaps the stale range
    assert "still registered" in caplog.text
    assert [op for op, _ in registrar.calls] == ["register", "unregister", "register"]
    assert pinner.registered == {a + 4096: 8192}
    pinner.close()
    assert registrar.live == {} and registrar.unmapped_at_unregister[0] == a  # the stale one, unmapped


def test_close_and_garbage_collection_unregister_what_is_left(leak_check):
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    slabs = Slabs(pinner)
    slabs.open(), slabs.open()
    pinner.close()
    assert registrar.live == {}
    slabs.open()  # closed: registers nothing any more
    assert registrar.live == {} and sum(op == "register" for op, _ in registrar.calls) == 2
    slabs.close()

    registrar2 = FakeRegistrar()
    pinner2 = SlabPinner(registrar2)
    slabs2 = Slabs(pinner2)
    slabs2.open()
    assert len(registrar2.live) == 1
    slabs2.hooks = None
    del pinner2
    gc.collect()
    assert registrar2.live == {}  # the pinner's finalizer unregistered it
    slabs2.maps.clear()  # unmapped without telling the hooks


def test_zero_bytes_and_reopened_mappings():
    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    pinner.opened(None, 4096, 0)
    assert registrar.calls == []
    slabs = Slabs(pinner)
    a = slabs.open()
    pinner.opened(slabs.maps[a], a, shm.MIN_SLAB)  # told twice about one mapping: one registration left
    assert list(registrar.live) == [a]
    slabs.close()
    assert registrar.live == {}


def test_attach_pinner_finds_the_hook_points_of_a_flow_and_a_loader():
    class Stage(bridgeflow.ProxyDataFlow):
        def __init__(self, ds):
            super().__init__(ds)
            self.hooks = []

        def set_mapping_hooks(self, hooks):
            self.hooks.append(hooks)

    inner = Stage(bridgeflow.DataFromList([[1], [2]], shuffle=False))
    outer = Stage(bridgeflow.BatchData(inner, 2))
    pinner = SlabPinner(FakeRegistrar())
    assert attach_pinner(outer, pinner) == 2 and inner.hooks == [pinner] and outer.hooks == [pinner]

    class Loader:  # a loader over a DataFlow, without a hook point: its dataset is walked
        def __init__(self, dataset):
            self.dataset = dataset

        def __iter__(self):
            return iter([])

    loader = Loader(Stage(bridgeflow.DataFromList([[1]], shuffle=False)))
    assert attach_pinner(loader, pinner) == 1 and loader.dataset.hooks == [pinner]

    class HookedLoader(Loader):  # with one, it passes the hooks on to its dataset itself: told once only
        def set_mapping_hooks(self, hooks):
            self.hooks = hooks
            self.dataset.set_mapping_hooks(hooks)

    loader = HookedLoader(Stage(bridgeflow.DataFromList([[1]], shuffle=False)))
    assert attach_pinner(loader, pinner) == 1 and loader.hooks is pinner and loader.dataset.hooks == [pinner]
    assert attach_pinner([np.zeros(3)], pinner) == 0
    assert attach_pinner(bridgeflow.DataFromList([[1]]), pinner) == 0


_HOOKS = hasattr(bridgeflow.MultiProcessMapData, "set_mapping_hooks")
needs_hook = pytest.mark.skipif(not _HOOKS, reason="the core's slab-mapping hook (set_mapping_hooks) has not "
                                "landed yet (issue 14): these run as soon as it has")


def _dying_load(i):
    if i == 40:
        os._exit(3)
    return [np.full((64, 1024), i, np.float32)]  # 256 KiB: travels in a slab


@needs_hook
def test_a_dying_worker_leaves_no_registration_and_no_shared_memory(leak_check):
    from bridgeflow._errors import WorkerError

    registrar = FakeRegistrar()
    pinner = SlabPinner(registrar)
    df = bridgeflow.MultiProcessMapData(bridgeflow.DataFromList(list(range(100)), shuffle=False), 2, _dying_load)
    df.set_mapping_hooks(pinner)
    def drain():  # its locals, the last batch among them, go with its frame
        with df:
            for _dp in df:
                pass

    with pytest.raises(WorkerError):
        drain()
    gc.collect()  # a slab stays mapped, and registered, while an array from it is held (the core's guarantee)
    assert pinner.registrations > 0
    assert registrar.live == {} and registrar.unmapped_at_unregister == []


@needs_hook
@pytest.mark.parametrize("how", ["worker_death", "ctrl_c"])
def test_prefetching_from_registered_slabs_ends_clean(how, leak_check):
    """Through CUDAPrefetcher (a host backend whose copies complete later, as DMA does): a worker dying
    or Ctrl-C in the training step while copies are in flight leaves every registration undone, no
    slab reused while a copy read it, and (leak_check) no /dev/shm entry."""
    from torch_backends import DmaBackend

    from bridgeflow._errors import WorkerError
    from bridgeflow.adapters.torch import CUDAPrefetcher

    backend = DmaBackend()
    unregister = backend.reg.unregister

    def checked_unregister(address):
        assert not backend.reads_pending(address, address + backend.reg.ranges[address]), \
            "unregistered while a copy still reads the slab"
        unregister(address)

    backend.reg.unregister = checked_unregister
    load = _dying_load if how == "worker_death" else (lambda i: [np.full((64, 1024), i, np.float32)])
    df = bridgeflow.MultiProcessMapData(bridgeflow.DataFromList(list(range(100)), shuffle=False), 2, load)
    prefetcher = CUDAPrefetcher(df, num_stages=2, _backend=backend)
    expected = WorkerError if how == "worker_death" else KeyboardInterrupt
    seen = 0
    with pytest.raises(expected):
        with df:
            for (_x,) in prefetcher:
                seen += 1
                if how == "ctrl_c" and seen == 10:
                    raise KeyboardInterrupt
    if seen:
        del _x  # the last batch handed out: its slab stays mapped while it is held
    gc.collect()
    assert prefetcher.pinner is not None and prefetcher.pinner.registrations > 0
    assert prefetcher.stats()["zero_copy"] > 0
    assert backend.reg.ranges == {} and prefetcher.pinner.registered == {}


@needs_hook
@pytest.mark.parametrize("num_stages", [1, 3])
def test_batches_read_in_place_from_real_slabs_keep_their_values(num_stages, leak_check):
    """Real workers, real slabs, copies that run late (at the stager's waits): if a slab went back to its
    worker before the copy that reads it ran, the worker's next batch would show in the copied values."""
    from torch_backends import DmaBackend

    from bridgeflow.adapters.torch import CUDAPrefetcher

    backend = DmaBackend()
    df = bridgeflow.MultiProcessMapData(bridgeflow.DataFromList(list(range(60)), shuffle=False), 2,
                                        lambda i: [np.full((64, 1024), i, np.float32)])
    with df:
        prefetcher = CUDAPrefetcher(df, num_stages=num_stages, _backend=backend)
        got = [x for (x,) in prefetcher]
    backend.run_dma()
    assert [(x.min().item(), x.max().item()) for x in got] == [(float(i), float(i)) for i in range(60)]
    assert prefetcher.stats()["zero_copy"] == 60 and prefetcher.stats()["staged"] == 0
    assert backend.reg.ranges == {}


# --- on a GPU ----------------------------------------------------------------------------------------

@needs_cuda
def test_gpu_registered_shared_memory_is_pinned_and_unregisters_cleanly():
    from bridgeflow.adapters.torch._pinning import CudaHostRegistrar

    pinner = SlabPinner(CudaHostRegistrar("cuda"))
    slabs = Slabs(pinner)
    a = slabs.open(1 << 22)
    assert pinner.failure is None, pinner.failure
    view = torch.frombuffer(slabs.maps[a], dtype=torch.uint8)
    assert view.is_pinned()
    view.fill_(7)
    dev = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(dev.sum().item()) == 7 * (1 << 22)
    del view
    slabs.close()
    assert pinner.registered == {}


@needs_cuda
def test_gpu_a_failed_registration_raises_pinning_error_and_leaves_cuda_usable():
    from bridgeflow.adapters.torch._pinning import CudaHostRegistrar

    registrar = CudaHostRegistrar("cuda")
    with pytest.raises(PinningError, match="cudaHostRegister"):
        registrar.register(0, 4096)  # not host memory of this process
    x = torch.ones(1024, device="cuda") * 2  # a kernel launch: no stale error is reported here
    torch.cuda.synchronize()
    assert x.sum().item() == 2048
