"""The declared fields of every flow's state, applied by the base: each state holds exactly its declared
fields, unknown and missing fields are refused naming the flow's path, the field and the value, a checksum
refuses a field changed into another valid value, and one error family covers damaged states (the torch
DataLoader's included)."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
from test_state import FLOWS

import bridgeflow as bf
from bridgeflow import DataFlow
from bridgeflow._state import RESERVED, NotResumableError, StateError, StateMismatchError, checksum
from bridgeflow._state_schema import Child, Count, Flag, Same, check_fields
from conftest import need


def _levels(state, path=()):
    """(path, state) of every flow state nested in ``state``, itself included."""
    if isinstance(state, dict):
        if "class" in state and "version" in state:
            yield path, state
        for k, v in state.items():
            yield from _levels(v, (*path, k))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from _levels(v, (*path, i))


def _classes():
    out, stack = {}, [DataFlow]
    while stack:
        cls = stack.pop()
        out.setdefault(cls.__name__, cls)
        stack.extend(cls.__subclasses__())
    return out


def _state_mid_epoch(make):
    df = make()
    df.reset_state()
    it = iter(df)
    next(it)
    state = df.state_dict()
    it.close()
    df.close()
    return state


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_every_state_holds_exactly_its_declared_fields(name):
    """The declaration is the state: what ``_own_state`` returns is what ``state_fields`` declares; the
    outermost level carries the tree's checksum."""
    state = _state_mid_epoch(FLOWS[name])
    assert state["check"] == checksum(state)
    for path, level in _levels(state):
        cls = _classes().get(level["class"])
        if cls is None or cls.state_fields is None:
            continue  # a custom flow of the test that checks its own state
        declared = {f.name for f in cls.state_fields}
        optional = {f.name for f in cls.state_fields if f.optional}
        have = set(level) - set(RESERVED)
        assert declared - optional <= have <= declared, (path, level["class"], have ^ declared)


def test_every_exported_flow_with_a_state_of_its_own_declares_it():
    for name in bf.__all__:
        cls = getattr(bf, name)
        if isinstance(cls, type) and issubclass(cls, DataFlow) and cls._resumable \
                and cls._own_state is not DataFlow._own_state and cls._why_not_resumable is DataFlow._why_not_resumable:
            assert cls.state_fields is not None, f"{name} saves a state without declaring its fields"


def test_unknown_and_missing_fields_are_refused_by_name():
    state = _state_mid_epoch(FLOWS["a pipeline"])
    extra = copy.deepcopy(state)
    extra["child"]["surprise"] = 3
    with pytest.raises(StateMismatchError, match=r"^BatchData/LocallyShuffleData: the state has a field "
                                                 r"'surprise' \(3\) that this flow does not save"):
        FLOWS["a pipeline"]().load_state_dict(extra)
    missing = copy.deepcopy(state)
    del missing["child"]["source"]["child"]["done"]
    with pytest.raises(StateMismatchError, match=r"^BatchData/LocallyShuffleData/MapData/RepeatedData: the state has "
                                                 r"no 'done' field"):
        FLOWS["a pipeline"]().load_state_dict(missing)


def test_an_unknown_field_is_refused_when_optional_fields_are_absent():
    # fewer keys than declared fields (two optional ones absent), one of them not a field: still refused
    fields = (Count("pos"), Flag("a", optional=True), Flag("b", optional=True), Flag("c", optional=True))
    check_fields(None, {"pos": 1, "a": True}, fields, ())
    with pytest.raises(StateMismatchError, match=r"^the state has a field 'surprise' \(3\) that this flow does not "
                                                 r"save"):
        check_fields(None, {"pos": 1, "surprise": 3}, fields, ())


def test_a_field_changed_into_another_valid_value_is_refused_by_the_checksum():
    """A nearby position is a state the flow could have saved: no field check can tell it from the real one,
    and it resumed elsewhere without a word (the core mutation fuzz counted 23-325 per kind). The outermost
    state's sum covers the tree; a refused state leaves the flows as they were."""
    make = lambda: bf.BatchData(bf.MapData(FLOWS["DataFromList shuffled"](), lambda dp: dp), 2)
    state = _state_mid_epoch(make)
    assert all("check" not in level for path, level in _levels(state) if path)  # one sum, at the top
    moved = copy.deepcopy(state)
    moved["child"]["child"]["pos"] += 1
    df = make()
    with pytest.raises(StateMismatchError, match=r"^BatchData: the state's checksum .* does not match its fields"):
        df.load_state_dict(moved)
    df.reset_state()
    assert [int(dp[0][0]) for dp in df] == [int(dp[0][0]) for dp in make()]  # nothing of the refused state kept
    with pytest.raises(StateMismatchError, match=r"^BatchData/MapData/DataFromList: field 'pos' of the state is "
                                                 r"negative"):  # a value no state holds: named by its field
        make().load_state_dict(dict(moved, child=dict(moved["child"], child=dict(moved["child"]["child"], pos=-1))))
    by_hand = copy.deepcopy(moved)  # a state made by hand (no sum) is taken on its fields
    del by_hand["check"]
    make().load_state_dict(by_hand)


def test_the_checksum_survives_json_and_torch_save():
    torch = pytest.importorskip("torch")
    state = _state_mid_epoch(FLOWS["a pipeline"])
    through_json = json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    through_torch = torch.load(buf, weights_only=True)
    for copy_ in (through_json, through_torch):
        df = FLOWS["a pipeline"]()
        df.load_state_dict(copy_)
        assert copy_["check"] == checksum(copy_) == state["check"]
        df.close()


def test_the_checksum_is_the_crc_of_the_json_text_with_or_without_the_c_encoder(monkeypatch):
    """state_dict() sums the tree with json's C encoder built once (JSONEncoder.encode built one per call, half
    of what a state cost); the sum is the CRC-32 of the text json.dumps writes, as before, so states saved
    earlier still load, and a Python without the C encoder sums the same."""
    import zlib

    from bridgeflow import _state as state_module

    tree = {"class": "X", "version": 1, "pos": 3, "f": 0.1, "nan": float("nan"), "s": "caf\u00e9\n\"", "none": None,
            "flag": True, "big": 2**70, "nested": [{"a": []}, [1, -2]], "t": (1, 2)}
    text = json.dumps(tree, separators=(",", ":"))
    want = f"{zlib.crc32(text.encode()):08x}"
    assert checksum(tree) == want == checksum({**tree, "check": "anything"})
    assert checksum(json.loads(text)) == want  # a tuple reads back as a list: the same sum
    assert checksum({"x": object()}) is None  # JSON cannot write it: the state is taken on its fields
    monkeypatch.setattr(state_module, "_ENCODE", None)
    assert checksum(tree) == want
    assert checksum({"x": object()}) is None


def test_one_error_family_for_damaged_states():
    need("torch")
    from bridgeflow.adapters.torch import ResumeStateError
    from bridgeflow.adapters.torch._state import ResumeStateError as same

    assert same is ResumeStateError
    assert issubclass(ResumeStateError, StateMismatchError) and issubclass(StateMismatchError, StateError)
    assert issubclass(ResumeStateError, ValueError) and issubclass(NotResumableError, StateError)
    assert str(ResumeStateError("state['x']: bad")) == "state['x']: bad"


def test_a_declared_field_names_its_bound_and_where_it_comes_from():
    class Skip(bf.ProxyDataFlow):
        state_fields = (Same("every", "every"), Count("skipped", lambda f: len(f), "the epoch's length"), Child())

        def __init__(self, ds, every):
            super().__init__(ds)
            self.every, self._skipped = every, 0

        def _own_state(self):
            return {"every": self.every, "skipped": self._skipped, "child": self.ds.state_dict()}

    state = Skip(FLOWS["DataFromList shuffled"](), 2).state_dict()
    del state["check"]
    with pytest.raises(StateMismatchError, match=r"^Skip: field 'skipped' of the state is 99, above 12, the most this "
                                                 r"flow can save: the epoch's length"):
        Skip(FLOWS["DataFromList shuffled"](), 2).load_state_dict(dict(state, skipped=99))
    with pytest.raises(StateMismatchError, match=r"^Skip: the state is for every=2, this flow has every=3"):
        Skip(FLOWS["DataFromList shuffled"](), 3).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"^Skip: field 'skipped' of the state is a bool \(True\), "
                                                 r"expected int$"):
        Skip(FLOWS["DataFromList shuffled"](), 2).load_state_dict(dict(state, skipped=True))


# --- crafted states: a StateError with a short message, at load_state_dict() (issue 39) -----------------------

def _batches_state():
    df = bf.BatchData(bf.MapData(bf.DataFromList([[i] for i in range(20)], shuffle=False), lambda dp: dp), 4)
    with df:
        it = iter(df)
        next(it)
        state = df.state_dict()
    state.pop("check")  # a state written by hand is taken on its fields
    return state


def _deep(levels: int) -> dict:
    root = cur = {}
    for _ in range(levels):
        cur["child"] = {}
        cur = cur["child"]
    return root


@pytest.mark.parametrize("edit", [
    lambda s: _deep(100_000),  # RecursionError escaped `except StateError`
    lambda s: {**s, "child": {**s["child"], "child": _deep(5_000)}},
    lambda s: {**s, "class": "X" * 100_000_000},  # a 100 MB message
    lambda s: {**s, "child": {**s["child"], "child": {**s["child"]["child"], "class": ["Y" * 10_000_000]}}},
    lambda s: {**s, "batch_size": "Z" * 10_000_000},
    lambda s: {**s, "unknown": "Z" * 10_000_000},
], ids=["deep", "deep-child", "huge-class", "huge-class-inside", "huge-value", "huge-unknown"])
def test_a_crafted_state_is_a_state_error_with_a_short_message(edit):
    df = bf.BatchData(bf.MapData(bf.DataFromList([[i] for i in range(20)], shuffle=False), lambda dp: dp), 4)
    with pytest.raises(StateMismatchError) as info:
        df.load_state_dict(edit(_batches_state()))
    assert len(str(info.value)) < 2_200 and str(info.value).startswith("BatchData")


def test_a_drop_in_loaders_crafted_state_is_refused_with_a_short_message():
    need("torch")
    from bridgeflow.adapters.torch import DataLoader, ResumeStateError

    loader = DataLoader(list(range(10)), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    config = state["config"]
    for bad in ({**state, "workers": [_deep(100_000)]}, {**state, "config": {**config, "samplers": [_deep(5000)]}},
                {**state, "config": {**config, "batch_size": "x" * 10_000_000}}):
        with pytest.raises(ResumeStateError) as info:
            DataLoader(list(range(10)), batch_size=2).load_state_dict(bad)
        assert len(str(info.value)) < 300


def _ident(dp):
    return dp


def _unbatch_over_unordered():
    src = bf.DataFromList([[np.int64(i)] for i in range(12)], shuffle=False)
    return bf.UnbatchData(bf.BatchData(bf.MultiThreadMapData(src, 2, _ident, ordered=False), 4))


@pytest.mark.parametrize("held", [[5], ["text"], [[3]], [[[1, 2], [3]]]],
                         ids=["a-number", "a-string", "a-component-without-length", "components-of-two-lengths"])
def test_crafted_held_datapoints_are_refused_at_load_not_at_iteration(held):
    """UnbatchData over an unordered stage keeps the rest of the batch it splits (``held``): a crafted one that
    is not a datapoint, or not the rest of a batch, raised TypeError in iter()."""
    from bridgeflow._state import pack_held

    with _unbatch_over_unordered() as df:
        it = iter(df)
        next(it)
        state = json.loads(json.dumps(df.state_dict()))
    assert state["held"] is not None
    state.pop("check")
    state["held"] = pack_held(held, "stage")
    with _unbatch_over_unordered() as again:
        with pytest.raises(StateMismatchError, match="UnbatchData: .*held"):
            again.load_state_dict(state)
