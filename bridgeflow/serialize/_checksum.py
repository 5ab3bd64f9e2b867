"""CRC-32 of stored values, computed by the fastest implementation installed.

All give zlib's CRC-32 (the same numbers): ``zlib-ng``'s (the ``lmdb`` extra installs it; about
70 GB/s on x86-64 with PCLMULQDQ, fast enough to check every value read) when importable, else the
standard library's ``zlib.crc32`` (about 4 GB/s). Files written with one read back with the other.

Example:
    >>> crc32()(b"bridgeflow") == __import__("zlib").crc32(b"bridgeflow")
    True
"""

from __future__ import annotations

import functools
import logging
import zlib
from typing import Any, Protocol

from .._deps import install_hint

__all__ = ["crc32", "crc32_implementation"]

log = logging.getLogger(__name__)


class Crc32(Protocol):
    """``zlib.crc32``'s signature: ``f(buffer, start=0) -> int`` (``start``: the CRC so far, to continue it)."""

    def __call__(self, data: Any, value: int = 0, /) -> int: ...


@functools.cache
def _pick() -> tuple[str, Crc32]:
    try:
        from zlib_ng import zlib_ng
    except ImportError:
        log.info("zlib-ng is not installed: checksums use zlib.crc32 (slower reads of large values; %s)",
                 install_hint("zlib_ng"))
        return "zlib", zlib.crc32
    return "zlib-ng", zlib_ng.crc32


def crc32() -> Crc32:
    """The CRC-32 function: ``f(buffer, start=0) -> int``, equal to ``zlib.crc32``."""
    return _pick()[1]


def crc32_implementation() -> str:
    """``"zlib-ng"`` or ``"zlib"``: which library computes :func:`crc32`."""
    return _pick()[0]
