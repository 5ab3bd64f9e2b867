"""Property: a damaged DataLoader state is refused at ``load_state_dict()``, or it resumes exactly (issue 24).

Real states are taken from real loaders (map-style shuffled with and without a generator, a stateful
iterable; 0 or 2 workers) after k batches, then one field is mutated (removed, retyped, set out of range,
its base64 damaged, nudged by one...). Loading the mutated state must either raise ``ResumeStateError``
(nothing else, and nothing started: no worker, no shared memory), or the loader must then yield a stretch
of the uninterrupted run: the rest of the saved epoch from the position the state names, or the next
epoch. Anything else is a silent wrong resume.

In the suite the example count is modest; ``python tests/test_torch_state_mutations.py N`` runs N examples
per set-up and prints one JSON line of counts (refused, resumed exactly, wrong, leaks).
"""

from __future__ import annotations

import copy
import json
import sys
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import need

need("torch")

import torch
import torch.utils.data as tud
from test_torch_state import _Cursor, plain

from bridgeflow.adapters.torch import DataLoader, ResumeStateError

N, BATCH = 10, 3


class Values(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class Stream(tud.IterableDataset):
    def __iter__(self):
        info = tud.get_worker_info()
        wid, n = (0, 1) if info is None else (info.id, info.num_workers)
        return _Cursor([i for i in range(N) if i % n == wid])


SETUPS = {
    "shuffled_generator": lambda w: DataLoader(Values(), batch_size=BATCH, shuffle=True, num_workers=w,
                                               generator=torch.Generator().manual_seed(3)),
    "shuffled_global": lambda w: DataLoader(Values(), batch_size=BATCH, shuffle=True, num_workers=w),
    "stateful_iterable": lambda w: DataLoader(Stream(), batch_size=BATCH, num_workers=w),
}


class Reference:
    """The uninterrupted run of a set-up, and its states after each k batches of epoch 0."""

    def __init__(self, setup: str, workers: int) -> None:
        self.setup, self.workers = setup, workers
        torch.manual_seed(0)
        loader = SETUPS[setup](workers)
        self.states, epoch0 = [], []
        it = iter(loader)
        while True:
            self.states.append(json.loads(json.dumps(loader.state_dict())))
            try:
                epoch0.append(plain(next(it)))
            except StopIteration:
                break
        self.rng = torch.get_rng_state()  # a new process's global RNG: see run()
        epoch1 = [plain(b) for b in loader]
        loader.close()
        self.epochs = (epoch0, epoch1)

    def acceptable(self, state: dict, got: list) -> bool:
        """A stretch of the uninterrupted run: epoch 0 from the position the state names, or epoch 1."""
        epoch0, epoch1 = self.epochs
        if got == epoch1:
            return True
        k = state.get("yielded")
        # map-style: the position is the count of batches (the sampler is replayed that far); an iterable's
        # is in its workers' dataset states, the count only counts
        if self.setup != "stateful_iterable" and state.get("started") is True and isinstance(k, int) \
                and not isinstance(k, bool):
            return got == epoch0[k:]
        return any(got == epoch0[j:] for j in range(len(epoch0) + 1))


# --- mutations ----------------------------------------------------------------------------------------------

def paths(obj, prefix=()):
    """Every (path, value) in a state: dict keys and list items, recursively."""
    yield prefix, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from paths(value, prefix + (i,))


def dataset_owned(path: tuple) -> bool:
    """A path inside the dataset's own state: the dataset's load_state_dict() checks it, not the loader."""
    return path[0] in ("dataset", "flow") or (path[0] == "workers" and len(path) > 2
                                              and path[2] in ("dataset", "iter"))


REPLACEMENTS = [None, -1, 0, 1, 2, True, False, 10**30, -(10**30), 1.5, float("nan"), "", "x", "!!!not base64",
                [], [None], [0, 0, 0], {}, {"x": 1}, 2**63, -(2**63) - 1, "AAAA"]


LAST_MUTATION: list = []


def mutate(state: dict, data) -> dict:
    state = copy.deepcopy(state)
    where = [p for p, _ in paths(state) if p and not dataset_owned(p)]
    path = data.draw(st.sampled_from(where), label="path")
    parent = state
    for part in path[:-1]:
        parent = parent[part]
    key, value = path[-1], parent[path[-1]]
    ops = ["replace", "replace", "delete"]
    if isinstance(value, int) and not isinstance(value, bool):
        ops += ["nudge", "nudge"]
    if isinstance(value, str):
        ops += ["truncate", "flip"]
    op = data.draw(st.sampled_from(ops), label="op")
    if op == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op == "nudge":
        parent[key] = value + data.draw(st.sampled_from([-1, 1, 2, -2]), label="by")
    elif op == "truncate":
        parent[key] = value[: data.draw(st.integers(0, max(0, len(value) - 1)), label="at")]
    elif op == "flip":
        i = data.draw(st.integers(0, max(0, len(value) - 1)), label="at")
        parent[key] = value[:i] + ("B" if value[i:i + 1] != "B" else "C") + value[i + 1:]
    else:
        parent[key] = data.draw(st.sampled_from(REPLACEMENTS), label="value")
    LAST_MUTATION[:] = [path, op, parent.get(key) if isinstance(parent, dict) else None]
    return state


def run(ref: Reference, state: dict) -> str:
    """'refused', 'exact' or a description of what went wrong."""
    torch.set_rng_state(ref.rng)
    loader = SETUPS[ref.setup](ref.workers)
    try:
        loader.load_state_dict(state)
    except ResumeStateError:
        if loader._iterator is not None:
            return "refused, but an iterator was started"
        return "refused"
    except Exception as exc:  # any other error is a failure to validate
        return f"load_state_dict raised {type(exc).__name__}: {exc}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [plain(b) for b in loader]
    except Exception as exc:
        return f"accepted, then iter() raised {type(exc).__name__}: {exc}"
    finally:
        loader.close()
    return "exact" if ref.acceptable(state, got) else f"accepted, resumed wrong: {got}"


_REFS: dict = {}


def reference(setup: str, workers: int) -> Reference:
    if (setup, workers) not in _REFS:
        _REFS[setup, workers] = Reference(setup, workers)
    return _REFS[setup, workers]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_mutated_states_are_refused_or_resume_exactly(setup, leak_check):
    ref = reference(setup, 0)

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.data())
    def check(data):
        k = data.draw(st.integers(0, len(ref.states) - 1), label="k")
        state = mutate(ref.states[k], data)
        outcome = run(ref, state)
        assert outcome in ("refused", "exact"), (state, outcome)

    check()


@pytest.mark.slow
def test_mutated_states_with_workers(leak_check):
    ref = reference("shuffled_global", 2)

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.data())
    def check(data):
        k = data.draw(st.integers(0, len(ref.states) - 1), label="k")
        outcome = run(ref, mutate(ref.states[k], data))
        assert outcome in ("refused", "exact"), outcome

    check()


def test_the_damaged_fields_of_issue_24_are_named():
    ref = reference("shuffled_generator", 0)
    state = ref.states[2]
    cases = {"yielded": -1, "started": 1, "base_seed": 2**64, "last_worker": 5, "config": None}
    for field, value in cases.items():
        bad = dict(state, **{field: value})
        with pytest.raises(ResumeStateError, match=rf"field '{field}' of the state"):
            SETUPS["shuffled_generator"](0).load_state_dict(bad)
    bad = dict(state, yielded=True)
    with pytest.raises(ResumeStateError, match="yielded.*a bool.*expected int"):
        SETUPS["shuffled_generator"](0).load_state_dict(bad)
    bad = dict(state, surprise=3)  # a key that is not a field, with optional fields absent
    del bad["check"]
    with pytest.raises(ResumeStateError, match="field 'surprise' \\(3\\) that this flow does not save"):
        SETUPS["shuffled_generator"](0).load_state_dict(bad)
    bad = dict(state, rng_now={"generator": "!!!"})
    with pytest.raises(ResumeStateError, match="rng_now.generator.*base64"):
        SETUPS["shuffled_generator"](0).load_state_dict(bad)


def fuzz_setup(setup: str, workers: int, n: int) -> dict:
    """``n`` mutated states of one set-up, outside pytest: counts, a few wrong outcomes, leaks."""
    import collections
    import time

    from conftest import child_pids, shm_entries

    ref = reference(setup, workers)
    tally: collections.Counter = collections.Counter()
    wrong: list = []
    procs0, shm0 = child_pids(), shm_entries()

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        k = data.draw(st.integers(0, len(ref.states) - 1))
        outcome = run(ref, mutate(ref.states[k], data))
        tally[outcome if outcome in ("refused", "exact") else "wrong"] += 1
        if outcome not in ("refused", "exact") and len(wrong) < 5:
            wrong.append(f"{LAST_MUTATION!r:.200}: {outcome[:200]}")

    fuzz()
    time.sleep(1.0)
    leaks = {"processes": sorted(child_pids() - procs0), "shm": sorted(set(shm_entries()) - set(shm0))}
    return {"setup": setup, "workers": workers, "examples": sum(tally.values()), **tally, "leaks": leaks,
            "wrong_examples": wrong}


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    for setup, workers in [(s, 0) for s in SETUPS] + [("shuffled_global", 2), ("stateful_iterable", 2)]:
        print(json.dumps(fuzz_setup(setup, workers, count if workers == 0 else max(1, count // 10))), flush=True)
