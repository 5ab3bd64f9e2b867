"""Mutated states of real pipelines: refused with a StateError naming the flow, or resumed exactly.

Hypothesis picks the field (anywhere in the state) and the value; ``tests/fuzz/fuzz_states.py`` is the
driver (and, run by hand, the large count). A modest number of examples per kind here.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import fuzz_states

FAILURES = ("silent", "hang")
CHEAP = ["DataFromList", "MapData", "LocallyShuffleData", "JoinData", "BatchData", "MultiThreadMapData", "ConcatData",
         "RandomMixData", "RepeatedData"]
PROCESSES = ["MultiProcessMapData", "MultiProcessRunner", "FusedBatch"]
VALUES = [fuzz_states.DELETE, None, True, -1, 10**12, 2**64, 1.5, "x", [], {"a": 1}]


def _fuzz(kind: str, examples: int) -> None:
    state, ref = fuzz_states.reference(kind)
    paths = fuzz_states.leaves(state)
    outcomes: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(path=st.sampled_from(paths), value=st.one_of(st.sampled_from(VALUES), st.integers(-3, 80),
                                                         st.builds(fuzz_states.Live)))
    def check(path, value):
        outcome = fuzz_states.run_one(kind, state, ref, path, value, limit=30.0)
        outcomes.append(outcome)
        assert outcome not in FAILURES and not outcome.startswith("foreign"), (path, value, outcome)

    reduced = len(fuzz_states.REDUCED)
    check()
    assert len(fuzz_states.REDUCED) == reduced, "a live object in a state was pickled before it was refused"
    assert outcomes.count("refused") > len(outcomes) // 3, outcomes  # most mutations are damage


@pytest.mark.parametrize("kind", CHEAP)
def test_mutated_states_of_flows_are_refused_or_resume_exactly(leak_check, kind):
    _fuzz(kind, 80)


@pytest.mark.parametrize("kind", PROCESSES)
def test_mutated_states_of_process_stages_are_refused_or_resume_exactly(leak_check, kind):
    _fuzz(kind, 25)


@pytest.mark.parametrize("kind", ["MultiProcessMapData", "LocallyShuffleData", "MultiThreadMapData"])
def test_a_replay_or_taken_past_what_the_flow_can_save_is_refused_naming_the_field(leak_check, kind):
    state, _ = fuzz_states.reference(kind)
    for key, value in (("replay", 10**9), ("taken", 10**12)):
        df = fuzz_states.KINDS[kind]()
        with pytest.raises(fuzz_states.StateError, match=rf"^{kind}: field '{key}' of the state is {value}, above"):
            df.load_state_dict(fuzz_states.mutate(state, (key,), value))
        df.close()


def test_a_negative_base_is_refused_naming_the_flow():
    state, _ = fuzz_states.reference("MapData")
    df = fuzz_states.KINDS["MapData"]()
    with pytest.raises(fuzz_states.StateError, match=r"^MapData/DataFromList: field 'base' of the state is negative"):
        df.load_state_dict(fuzz_states.mutate(state, ("child", "base"), -5))


def test_a_runner_refuses_a_damaged_worker_state_in_the_parent_before_any_worker_starts(leak_check):
    state, _ = fuzz_states.reference("MultiProcessRunner")
    w = next(i for i, s in enumerate(state["workers"]) if s["state"] is not None)  # one that reported its state
    reduced = len(fuzz_states.REDUCED)
    df = fuzz_states.KINDS["MultiProcessRunner"]()
    with pytest.raises(fuzz_states.StateError, match=rf"^MultiProcessRunner: the state of worker {w}\['state'\]"):
        df.load_state_dict(fuzz_states.mutate(state, ("workers", w, "state", "child", "rng"), fuzz_states.Live()))
    damaged = fuzz_states.mutate(state, ("workers", w, "state", "child", "pos"), 10**6)
    with pytest.raises(fuzz_states.StateError, match=rf"^MultiProcessRunner/workers\[{w}\]/MapData/DataFromList: "):
        df.load_state_dict(damaged)
    assert df._pool is None  # nothing started
    assert len(fuzz_states.REDUCED) == reduced
    df.close()
