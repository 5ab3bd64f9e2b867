"""Progress bars on stderr that leave no thread behind.

tqdm starts a process-wide monitor thread with its first bar (even a disabled one) and keeps it until the
interpreter exits. bridgeflow promises that nothing it starts outlives the loop that started it, so its bars
come from a tqdm subclass with the monitor switched off; ``progress_bar(enabled=False)`` builds no bar at all.
"""

from __future__ import annotations

import sys
from typing import Any


class _NullBar:
    """Stands in for a disabled bar: every call is a no-op."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NullBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(*, enabled: bool = True, **kwargs: Any) -> Any:
    """A tqdm bar on stderr (``smoothing=0.1``, dynamic width) without tqdm's monitor thread."""
    if not enabled:
        return _NullBar()
    from tqdm import tqdm

    class _Bar(tqdm):  # a class attribute, so other tqdm users in the process keep their monitor
        monitor_interval = 0

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("smoothing", 0.1)
    return _Bar(**kwargs)
