"""A pipeline as a whole: walk its flows, collect every stage's counters, say where the time goes.

A pipeline is a tree of flows, each listing the flows it reads in ``children()``. :func:`iter_flows` walks
it depth-first and names each flow by its path (``BatchData/MultiProcessMapData/DataFromList``);
:func:`pipeline_stats` (what ``df.stats()`` returns) gathers the counters of every flow that keeps them;
:func:`bottleneck` reads them and names the slow side, as ``TestDataSpeed`` prints it.

A parallel stage keeps these counters:

- ``buffer_fill``: how full its output buffer was, on average, when the consumer asked (0 to 1);
- ``consumer_wait_frac``: the share of the time the consumer spent waiting for the stage;
- ``workers_busy``: the share of the workers' time spent in the work (``map_func``, a runner's flow).

Example:
    >>> print(bottleneck({"BatchData/MultiProcessMapData": {"buffer_fill": 0.02, "consumer_wait_frac": 0.9,
    ...                                                     "workers_busy": 0.97}}))
    the workers of BatchData/MultiProcessMapData: busy 97% of the time while the consumer waited 90% of it; \
add workers or make their work cheaper
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["bottleneck", "format_stats", "iter_flows", "pipeline_stats"]

# Thresholds of the verdict: a consumer that waits less than this share of the time is not held up; workers
# busier than this share of the time have no slack.
WAITS = 0.10
BUSY = 0.80
# An output buffer filled less than this share on average is "near 0": each result was made just as it was
# asked for, so the workers are the slow side even when the consumer seldom had to wait for them.
EMPTY = 0.10


def iter_flows(df: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Walk a pipeline depth-first, yielding ``(path, flow)``; the path reads like ``Batch/Map/List``, and
    the children of a flow that reads several are numbered, as in states: ``Join/List[0]``, ``Join/List[1]``.

    A flow that appears twice (``ConcatData([a, a])``) is yielded once.
    """
    seen: set[int] = set()

    def walk(node: Any, name: str) -> Iterator[tuple[str, Any]]:
        if id(node) in seen:
            return
        seen.add(id(node))
        yield name, node
        children = getattr(node, "children", None)  # a duck-typed (tensorpack) flow has none
        children = list(children()) if callable(children) else []
        for i, child in enumerate(children):
            yield from walk(child, f"{name}/{type(child).__name__}" + (f"[{i}]" if len(children) > 1 else ""))

    yield from walk(df, f"{prefix}/{type(df).__name__}" if prefix else type(df).__name__)


def pipeline_stats(df: Any) -> dict[str, dict[str, float]]:
    """``{path: counters}`` for every flow in the pipeline whose counters are not empty."""
    out = {}
    for path, flow in iter_flows(df):
        own = getattr(flow, "_own_stats", None)
        stats = own() if callable(own) else {}
        if stats:
            out[path] = dict(stats)
    return out


def format_stats(stats: dict[str, dict[str, float]]) -> str:
    """One indented line per stage: ``  path: key=value ...``."""
    lines = []
    for path, values in stats.items():
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()]
        lines.append(f"  {path}: " + " ".join(parts))
    return "\n".join(lines)


def bottleneck(stats: dict[str, dict[str, float]]) -> str | None:
    """Where a pipeline's time goes, in one sentence, from :func:`pipeline_stats`; None without a stage
    that measures its consumer's waits.

    The stage nearest the consumer decides: if the consumer seldom waits for it and its buffer holds
    results ready, what reads the pipeline is the slow side; if the buffer is nearly empty (a fill under
    ``EMPTY``), the workers are, if only just, as they are when the consumer waits and they are busy; if
    it waits and they idle, what feeds them is (the source the stage reads, or the transfer of the data),
    and the stage below it, if any, is looked at in turn.
    """
    stages = [(path, s) for path, s in stats.items() if "consumer_wait_frac" in s]
    if not stages:
        return None
    stages.sort(key=lambda item: item[0].count("/"))
    verdict = None
    for path, s in stages:
        wait, fill = s["consumer_wait_frac"], s.get("buffer_fill", 0.0)
        busy = s.get("workers_busy")
        if wait < WAITS:
            if verdict is not None:
                return verdict
            if fill < EMPTY:
                return (f"the workers of {path}, by a narrow margin: its buffer was {fill:.1%} full on average, "
                        f"so each result was made just as it was asked for (the consumer waited {wait:.0%} of "
                        "the time); a faster consumer would wait for them")
            return (f"the consumer: {path} had its results ready ({fill:.0%} of its buffer full on "
                    f"average) and was waited for {wait:.0%} of the time; the pipeline keeps up with what "
                    "reads it")
        if busy is None or busy >= BUSY:
            busy_text = "" if busy is None else f"busy {busy:.0%} of the time "
            return (f"the workers of {path}: {busy_text}while the consumer waited {wait:.0%} of it; add workers "
                    "or make their work cheaper")
        verdict = (f"what feeds the workers of {path}: they were busy only {busy:.0%} of the time while the "
                   f"consumer waited {wait:.0%} of it, so {_outside_the_work(path)} limits it")
    return verdict


def _outside_the_work(path: str) -> str:
    """What else a stage's results wait on: a map stage's workers get their input from the consumer's process,
    a runner's (and a DataLoader's) read their own source, which counts as their work."""
    name = path.rsplit("/", 1)[-1]
    if "MapData" in name:
        return "reading the source (in the consumer's process) or moving the data"
    if any(kind in name for kind in ("Runner", "PrefetchData", "DataLoader")):
        return "moving the data from the workers (they read their own source, which counts as busy)"
    return "reading the source or moving the data"
