"""bridgeflow.serialize._pinned: the one descriptor a reader holds, across fork."""

from __future__ import annotations

import os

from bridgeflow.serialize._pinned import PinnedFile
from conftest import results_of_forked_children


def _close_in_child(pin: PinnedFile, q) -> None:
    """In a forked child: close() must leave the inherited descriptor alone (the parent's), and ensure()
    must give a descriptor on the same file."""
    fd = pin.fd
    pin.close()
    try:
        os.fstat(fd)
        kept = True
    except OSError:
        kept = False
    again = pin.ensure()
    q.put((kept, os.pread(again, 5, 0)))


def test_a_forked_child_knows_the_descriptor_is_its_parents(tmp_path):
    """The process id is kept by a fork hook, not asked for at every read: a child must still see the
    descriptor as inherited, not close it as its own."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"hello world")
    pin = PinnedFile(str(path))
    try:
        fd = pin.ensure()
        assert os.pread(fd, 5, 6) == b"world"
        assert results_of_forked_children(_close_in_child, (pin,), n=2) == [(True, b"hello")] * 2
        assert pin.ensure() == fd and os.pread(fd, 5, 0) == b"hello"  # the parent's is untouched
    finally:
        pin.close()
    assert pin.fd is None
