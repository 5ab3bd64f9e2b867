"""The machine's processes as the tests see them, read from ``/proc`` (Linux): one reader of
``/proc/PID/stat`` for the leak checks, the hang reports and the orphan tests, which ask it different questions
(whose child, which group, which session, still running)."""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["Proc", "alive", "children", "processes"]


class Proc(NamedTuple):
    pid: int
    state: str  # "R", "S", "Z" (a zombie: ended, not reaped yet)...
    ppid: int
    pgrp: int
    session: int


def _stat(pid: int | str) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:  # gone meanwhile
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    return Proc(int(pid), fields[0], int(fields[1]), int(fields[2]), int(fields[3]))


def processes() -> list[Proc]:
    """Every live process (zombies left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = _stat(entry)
            if proc is not None and proc.state != "Z":
                out.append(proc)
    return out


def children(pid: int | None = None) -> set[int]:
    """The live children of ``pid`` (this process by default)."""
    parent = os.getpid() if pid is None else pid
    return {p.pid for p in processes() if p.ppid == parent}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    proc = _stat(pid)
    return proc is not None and proc.state != "Z"
