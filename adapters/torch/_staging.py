"""Host-to-host copies of large batches split across a few threads (the staging copy into pinned memory).

:class:`ParallelCopier` splits a large contiguous copy into byte ranges and copies them at the same time:
the calling thread takes one range, a small pool of helper threads the others. Each range is a
``memmove`` that releases the GIL (numpy's ``copyto`` on byte views), so the helpers run truly in
parallel, whatever thread calls, without going through torch's intra-op thread pool. Copies that are
small, strided, or between different dtypes go to torch's ``copy_`` unchanged.

Which is faster, the split or torch's own ``copy_`` (itself parallel where torch's intra-op pool is), depends
on the host: its cores, its memory channels, what else runs. So by default (``threads=None``) the copier
times both on its first large copies and keeps the faster; ``threads=N`` fixes the split at N threads,
``threads=1`` always uses ``copy_``.

Example:
    >>> import torch
    >>> from bridgeflow.adapters.torch._staging import ParallelCopier
    >>> src, dst = torch.arange(10, dtype=torch.float32), torch.empty(10)
    >>> with ParallelCopier(threads=2, min_bytes=0) as copier:
    ...     _ = copier.copy(dst, src)
    >>> torch.equal(dst, src)
    True
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ._compat import torch

__all__ = ["ParallelCopier", "default_copy_threads"]

log = logging.getLogger(__name__)

MIN_PARALLEL_BYTES = 4 << 20  # below this one thread is as fast: splitting costs more than it saves
MIN_CHUNK_BYTES = 1 << 20  # never hand a thread less than this
ALIGN = 64  # ranges start on cache-line boundaries (relative to the buffers' starts)
TRIALS = 3  # timed copies of each way before the automatic choice


def default_copy_threads() -> int:
    """Threads for one split copy: memory bandwidth saturates at a handful, and the cores are shared with
    the data workers and the training loop (half the cores, at most 8)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _byte_view(t: Any) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _torch_copy(dst: Any, src: Any) -> Any:
    return dst.copy_(src)


class ParallelCopier:
    """Copy tensors, large ones split across ``threads`` threads (the caller's included).

    Args:
        threads: threads for one large copy (>= 1; 1: torch's ``copy_`` only). ``None``: choose between
            a split across :func:`default_copy_threads` threads and ``copy_`` by timing both (``choice``).
        min_bytes: copies smaller than this are never split.
        chunk: the least bytes one thread copies (a copy is split in at most ``nbytes // chunk`` ranges).

    Thread-safe; :meth:`close` (or ``with``) stops the helper threads, which start at the first split copy.
    """

    def __init__(self, threads: int | None = None, min_bytes: int = MIN_PARALLEL_BYTES,
                 chunk: int = MIN_CHUNK_BYTES) -> None:
        self.auto = threads is None
        threads = default_copy_threads() if threads is None else threads
        for name, value, least in (("threads", threads, 1), ("min_bytes", min_bytes, 0), ("chunk", chunk, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ParallelCopier: {name} should be an integer >= {least}, got {value!r}")
        self.threads = threads
        self.min_bytes = min_bytes
        self.chunk = chunk
        #: "split" or "torch" once decided (at once unless ``threads`` is None)
        self.choice: str | None = None if self.auto and threads > 1 else ("split" if threads > 1 else "torch")
        self._trials: dict[str, list[float]] = {"split": [], "torch": []}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _helpers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("ParallelCopier is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="bf-copy")
            return self._pool

    def parallel(self, dst: Any, src: Any) -> bool:
        """Whether this copy is one that can be split across threads (large, contiguous, same dtype)."""
        nbytes = src.numel() * src.element_size()
        return (self.threads > 1 and nbytes >= max(self.min_bytes, 2 * self.chunk)
                and dst.dtype == src.dtype and dst.shape == src.shape
                and dst.is_contiguous() and src.is_contiguous()
                and not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg())
                and dst.device.type == "cpu" and src.device.type == "cpu")

    def copy(self, dst: Any, src: Any) -> Any:
        """``dst.copy_(src)``, split across threads when large (and faster); returns ``dst``."""
        if not self.parallel(dst, src):
            return _torch_copy(dst, src)
        way = self.choice
        if way is None:
            return self._trial(dst, src)
        return self._split(dst, src) if way == "split" else _torch_copy(dst, src)

    def _trial(self, dst: Any, src: Any) -> Any:
        """Time one way of copying (the one with fewer trials); decide once both have ``TRIALS``."""
        with self._lock:
            way = "split" if len(self._trials["split"]) <= len(self._trials["torch"]) else "torch"
        start = time.perf_counter()
        if way == "split":
            self._split(dst, src)
        else:
            _torch_copy(dst, src)
        per_byte = (time.perf_counter() - start) / max(1, src.numel() * src.element_size())
        with self._lock:
            self._trials[way].append(per_byte)
            if self.choice is None and min(len(t) for t in self._trials.values()) >= TRIALS:
                medians = {k: statistics.median(v) for k, v in self._trials.items()}
                self.choice = min(medians, key=medians.__getitem__)
                log.debug("ParallelCopier: %s (split over %d threads: %.1f GB/s, copy_: %.1f GB/s)", self.choice,
                          self.threads, 1e-9 / medians["split"], 1e-9 / medians["torch"])
        return dst

    def _split(self, dst: Any, src: Any) -> Any:
        d, s = _byte_view(dst), _byte_view(src)
        n = s.nbytes
        parts = max(1, min(self.threads, n // self.chunk))
        align = min(ALIGN, self.chunk)
        per_part = -(-n // parts)
        step = -(-per_part // align) * align  # rounded up to the alignment
        bounds = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
        if len(bounds) == 1:
            np.copyto(d, s)
            return dst
        pool = self._helpers()
        futures: list[Future] = [pool.submit(np.copyto, d[lo:hi], s[lo:hi]) for lo, hi in bounds[1:]]
        error: BaseException | None = None
        try:
            lo, hi = bounds[0]
            np.copyto(d[lo:hi], s[lo:hi])
        except BaseException as exc:  # still wait for the helpers: they write into dst
            error = exc
        for f in futures:
            try:
                f.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return dst

    def close(self) -> None:
        """Stop the helper threads (waits for copies under way). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> ParallelCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
