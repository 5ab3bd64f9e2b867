"""One member of a zip file, read in pieces that never go past the size the member declares.

Python's :mod:`zipfile` hands a whole compressed chunk to bz2 and lzma without an output limit and cuts
the result to the declared size afterwards: a 1.4 KB bzip2 member that declares a few bytes but inflates
to 2 GB costs 2 GB (and passes its CRC, computed on the bytes kept). :class:`ZipMember` reads the member's
compressed bytes itself, with positioned reads of the reader's pinned file, and asks the decompressor
(deflate, bzip2 or LZMA) for at most one piece (:data:`PIECE`) at a time and never more than the
declared size still owed. Once the declared bytes are out, the stream must end: a single byte more is a
stream that runs past its declared size (crafted or damaged), and so is a stream that ends early. The
CRC-32 is checked on what was read. Memory is the caller's buffer plus one piece.

A member's declared size must also be one its compressed size can give: no more than the file holds for
a stored member, than deflate can expand (1,032x), than bzip2 (46 million x) or LZMA (8,000x) can. Those
two bounds are loose on purpose (valid files reach 1.3 million x and 7,075x on zeros); what bounds memory
is the declared size, allocated by the caller once it has checked it.

Example:
    >>> import zipfile
    >>> from bridgeflow.serialize._pinned import PinnedFile
    >>> with zipfile.ZipFile("m.zip", "w", zipfile.ZIP_BZIP2) as z:
    ...     z.writestr("a", b"abc" * 1000)
    >>> pin = PinnedFile("m.zip")
    >>> with zipfile.ZipFile(pin.fileobj()) as z:
    ...     m = ZipMember(pin, z.getinfo("a"))
    ...     buf = bytearray(3000)
    ...     m.readall_into(memoryview(buf)), m.finish()
    (3000, None)
    >>> pin.close()
"""

from __future__ import annotations

import bz2
import io
import lzma
import os
import struct
import zipfile
import zlib
from typing import Any

from ._pinned import PinnedFile

__all__ = ["MAX_RATIO", "PIECE", "MemberFile", "ZipMember"]

PIECE = 1 << 20
MAX_RATIO = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: 1032, zipfile.ZIP_BZIP2: 46_000_000,
             zipfile.ZIP_LZMA: 8000}
_NAMES = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2",
          zipfile.ZIP_LZMA: "LZMA"}


class _Inflate:
    """zlib's raw inflate with bz2's and lzma's interface (``needs_input``, ``eof``)."""

    def __init__(self) -> None:
        self._d = zlib.decompressobj(-15)
        self._tail = b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._d.decompress(self._tail + data if self._tail else data, max_length)
        self._tail = self._d.unconsumed_tail
        return out

    @property
    def needs_input(self) -> bool:
        return not self._tail

    @property
    def eof(self) -> bool:
        return self._d.eof


def _lzma(props: bytes) -> lzma.LZMADecompressor:
    """The raw LZMA1 decoder for a zip member's properties (one byte ``(pb * 5 + lp) * 9 + lc``, then the
    dictionary size)."""
    if len(props) != 5 or props[0] >= 9 * 5 * 5:
        raise ValueError(f"bad LZMA properties {props.hex()}")
    pb, rest = divmod(props[0], 45)
    lp, lc = divmod(rest, 9)
    filt = {"id": lzma.FILTER_LZMA1, "dict_size": struct.unpack_from("<I", props, 1)[0], "lc": lc, "lp": lp, "pb": pb}
    return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[filt])


class ZipMember:
    """The decompressed bytes of one member (see the module doc); ``ValueError`` names the member for a
    stream that is damaged, runs past its declared size or ends before it."""

    def __init__(self, pin: PinnedFile, info: zipfile.ZipInfo) -> None:
        self.pin, self.name = pin, info.filename
        self.left, self.declared, self.crc, self.want_crc = info.file_size, info.file_size, 0, info.CRC
        method = info.compress_type
        if method not in MAX_RATIO:
            raise ValueError(f"member {self.name!r} is compressed with zip method {method}, which bridgeflow does "
                             f"not read (it reads {', '.join(_NAMES.values())})")
        if info.flag_bits & 1:
            raise ValueError(f"member {self.name!r} is encrypted")
        size = pin.size()
        head = pin.pread(30, info.header_offset)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise ValueError(f"member {self.name!r}: no local header at byte {info.header_offset}")
        n, m = struct.unpack_from("<HH", head, 26)
        self.at = info.header_offset + 30 + n + m
        self.end = self.at + info.compress_size
        if self.end > size:
            raise ValueError(f"member {self.name!r} runs past the end of the file ({info.compress_size} bytes "
                             f"at byte {self.at}, the file holds {size})")
        most = info.compress_size * MAX_RATIO[method]
        if info.file_size > most or (method == zipfile.ZIP_STORED and info.file_size != info.compress_size):
            raise ValueError(f"member {self.name!r} declares {info.file_size} bytes, more than its "
                             f"{info.compress_size} {_NAMES[method]} bytes can hold")
        self.stored = method == zipfile.ZIP_STORED
        self.decoder: Any = None
        if method == zipfile.ZIP_DEFLATED:
            self.decoder = _Inflate()
        elif method == zipfile.ZIP_BZIP2:
            self.decoder = bz2.BZ2Decompressor()
        elif method == zipfile.ZIP_LZMA:
            head = self._input(4)
            if len(head) < 4:
                raise ValueError(f"member {self.name!r}: LZMA header cut short")
            psize = struct.unpack_from("<H", head, 2)[0]
            self.decoder = _lzma(self._input(psize))

    def _input(self, most: int = PIECE) -> bytes:
        data = self.pin.pread(min(most, self.end - self.at), self.at)
        self.at += len(data)
        return data

    def readinto(self, b: memoryview) -> int:
        """Up to ``len(b)`` of the member's next bytes into ``b`` (one piece at most when they are
        decompressed); 0 once all it declares was read."""
        want = min(len(b), self.left) if self.stored else min(len(b), self.left, PIECE)
        if want <= 0:
            return 0
        if self.stored:
            got = os.preadv(self.pin.ensure(), [b[:want]], self.at)
            if got == 0:
                raise ValueError(f"member {self.name!r} ends after {self.declared - self.left} of {self.declared} "
                                 "bytes (the file was cut short)")
            self.at += got
            out: Any = b[:got]
        else:
            d = self.decoder
            while True:
                if not d.eof:  # (bz2 and lzma raise EOFError when asked for more after their end)
                    feed = self._input() if d.needs_input else b""
                    out = d.decompress(feed, want)
                    if out:
                        break
                if d.eof or (not feed and d.needs_input and self.at >= self.end):
                    raise ValueError(f"member {self.name!r}: its compressed data ends after "
                                     f"{self.declared - self.left} of the {self.declared} bytes it declares")
            got = len(out)
            b[:got] = out
        self.crc = zlib.crc32(out, self.crc)
        self.left -= got
        return got

    def readall_into(self, b: memoryview) -> int:
        """Fill ``b`` (its length is what the caller expects to read); the count read."""
        got = 0
        while got < len(b):
            n = self.readinto(b[got:])
            if not n:
                break
            got += n
        return got

    def finish(self) -> None:
        """Check that the member ends where it declares (no byte more, no byte less) and its CRC-32."""
        if self.left:
            raise ValueError(f"member {self.name!r} is {self.left} bytes longer than the data read from it")
        if self.stored:
            if self.at != self.end:
                raise ValueError(f"member {self.name!r}: stored size differs from its declared size")
        else:
            d = self.decoder
            while not d.eof:
                feed = self._input() if d.needs_input else b""
                if d.decompress(feed, 1):
                    raise ValueError(f"member {self.name!r}: its compressed data runs past the {self.declared} bytes "
                                     "it declares (damaged, or crafted to exhaust memory); not read further")
                if not feed and d.needs_input and self.at >= self.end and not d.eof:
                    raise ValueError(f"member {self.name!r}: its compressed data is cut short (the stream does "
                                     "not end)")
        if self.crc != self.want_crc:
            raise ValueError(f"member {self.name!r}: CRC-32 mismatch (the file is damaged)")


class MemberFile(io.RawIOBase):
    """A :class:`ZipMember` as a readable binary file (what ``numpy.lib.format``'s header readers take)."""

    def __init__(self, member: ZipMember) -> None:
        super().__init__()
        self.member = member

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        return self.member.readinto(memoryview(b).cast("B"))
