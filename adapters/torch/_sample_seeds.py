"""Per-sample seeds: ``DataLoader(seed_per_sample=True)``.

torch seeds each worker once (``base_seed + worker_id``) and a sample's random augmentation is drawn from
its worker's stream: it depends on which worker read the sample and on how many that worker read before.
After a resume the workers' streams start again from their seeds, so the batches hold the same samples
with other augmentations; with another ``num_workers`` the augmentations differ too.

With ``seed_per_sample=True`` every sample is read with Python's ``random``, numpy's global generator and
torch's CPU generator seeded from (the epoch's base seed, the number of epochs the workers ran on it, the
task's number in the epoch, the sample's place in the task), and inside a :class:`bridgeflow.sample_scope`
of that seed (bridgeflow's augmentors draw from it). A sample's randomness is then a function of where it
is in the epoch: the same bytes at any ``num_workers`` (0 included), after a resume at any point, as in the
uninterrupted run. The base seed is the one torch draws (from the loader's ``generator``, else torch's
global generator), kept in the loader's state.

The seeds are set around ``dataset[i]`` (around ``__getitems__`` once per batch; around each ``next()``
of an iterable dataset's iterator), not around ``collate_fn``. In a worker they are left as the sample
left them (the worker's streams are the loader's); with ``num_workers=0`` the three generators are put
back after each sample, so the training loop's own draws (dropout...) go on as without the loader.

Example:
    >>> from bridgeflow.adapters.torch._sample_seeds import task_seed, sample_seed
    >>> sample_seed(task_seed(12345, 0, 3), 1) == sample_seed(task_seed(12345, 0, 3), 1)
    True
"""

from __future__ import annotations

import ctypes
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from bridgeflow import sample_scope

from ._compat import torch

__all__ = ["SeededTask", "Seeder", "sample_seed", "task_seed"]

MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """A 64-bit bijective mix (splitmix64's): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def task_seed(base_seed: int, reuse: int, seq: int) -> int:
    """The seed of task ``seq`` of an epoch: from the workers' base seed and the epochs run on it before."""
    return _mix(_mix(_mix(base_seed & MASK) ^ reuse) ^ seq)


def sample_seed(task: int, place: int) -> int:
    """The seed of the sample at ``place`` in a task of seed ``task``."""
    return _mix(task ^ _mix(place))


class SeededTask:
    """A task sent with its seed (``seed_per_sample=True``)."""

    __slots__ = ("seed", "task")

    def __init__(self, seed: int, task: Any) -> None:
        self.seed = seed
        self.task = task

    def __reduce__(self) -> tuple:
        return (SeededTask, (self.seed, self.task))


_MT_BYTES = 624 * 4 + 4  # numpy's MT19937 state: uint32 key[624], int pos


class _NumpyGlobal:
    """Saves numpy's global generator before a sample and puts it back after (``num_workers=0``).

    ``get_state()``/``set_state()`` cost about 170 µs together. Where numpy's global generator is an MT19937
    whose state reads as expected at its ctypes address (checked once), the state is the 2,500 bytes there
    (a copy in and out, about 3 µs) plus a pending Gaussian of the legacy normal draws: the full state is
    read only when that may be pending (the generator moved since it was last put back), and restored with
    ``set_state`` only when one was."""

    def __init__(self) -> None:
        self.addr = self._address()
        self.kept: tuple[bytes, Any] | None = None  # the raw state last put back, and the full one if needed

    @staticmethod
    def _address() -> int | None:
        try:
            bits = np.random.mtrand._rand._bit_generator
            if type(bits).__name__ != "MT19937":
                return None
            addr = int(bits.ctypes.state_address)
            _, key, pos, _, _ = np.random.get_state()
            want = np.asarray(key, np.uint32).tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True)
            return addr if ctypes.string_at(addr, _MT_BYTES) == want else None
        except Exception:  # another numpy: the full state every time
            return None

    def save(self) -> tuple[bytes | None, Any]:
        if self.addr is None:
            return None, np.random.get_state()
        raw = ctypes.string_at(self.addr, _MT_BYTES)
        if self.kept is not None and self.kept == (raw, None):  # as put back, nothing drawn since
            return raw, None
        full: Any = np.random.get_state()  # the legacy tuple: ("MT19937", key, pos, has_gauss, gauss)
        return raw, full if full[3] else None  # the full state only with a Gaussian pending

    def restore(self, saved: tuple[bytes | None, Any]) -> None:
        raw, full = saved
        if raw is None or full is not None:
            np.random.set_state(full)
        else:
            assert self.addr is not None  # raw is read only with an address
            np.random.seed(0)  # drops a Gaussian the sample left pending; the key is written back below
            ctypes.memmove(self.addr, raw, _MT_BYTES)
        self.kept = None if raw is None else (raw, full)


_numpy_global: _NumpyGlobal | None = None


class Seeder:
    """Reads a sample with the global generators seeded for its place (see the module doc); ``restore`` puts
    them back after it (the consumer's process, ``num_workers=0``)."""

    __slots__ = ("task", "restore")

    def __init__(self, task: int, restore: bool) -> None:
        self.task = task
        self.restore = restore

    def __call__(self, place: int, read: Callable[..., Any], *args: Any) -> Any:
        global _numpy_global
        seed = sample_seed(self.task, place)
        torch_rng = torch.default_generator
        numpy_global = _numpy_global
        if self.restore:
            if numpy_global is None:
                numpy_global = _numpy_global = _NumpyGlobal()
            saved = (random.getstate(), numpy_global.save(), torch_rng.get_state())
        random.seed(seed)
        np.random.seed(_mix(seed ^ 1) & 0xFFFFFFFF)
        torch_rng.manual_seed(_mix(seed ^ 2))
        try:
            with sample_scope(_mix(seed ^ 3)):
                return read(*args)
        finally:
            if self.restore:
                random.setstate(saved[0])
                assert numpy_global is not None
                numpy_global.restore(saved[1])
                torch_rng.set_state(saved[2])
