"""Differential tests against tensorpack 0.11: positional orders (and the workers they start), older
keywords, old-style subclasses and LocallyShuffleData's stream.

tests/data/make_tensorpack_surface_fixtures.py defines the cases and the code that observes them, taking
the library's ``dataflow`` module as an argument; here it runs over ``bridgeflow.dataflow``. tensorpack's
side comes from running that script with the Python named by ``BRIDGEFLOW_TENSORPACK_PYTHON`` (CI sets
it) or, when it is not set, from the file the script committed (tests/data/tensorpack_surface.json).
With ``CI`` set and no tensorpack Python, the tests fail: CI must compare against tensorpack itself.
Where bridgeflow differs on purpose, the test asserts exactly that difference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import warnings

import pytest

import bridgeflow.dataflow as bfd

ENV = "BRIDGEFLOW_TENSORPACK_PYTHON"
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SCRIPT = os.path.join(DATA, "make_tensorpack_surface_fixtures.py")

spec = importlib.util.spec_from_file_location("make_tensorpack_surface_fixtures", SCRIPT)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)

with open(os.path.join(DATA, script.EXPECTED)) as f:
    COMMITTED = json.load(f)


def live_tensorpack(out_dir: str) -> dict | None:
    """tensorpack's observations made now, or ``None`` (use the committed file) off CI without tensorpack."""
    exe = os.environ.get(ENV)
    if not exe:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {ENV} is not: the differential tests must run against tensorpack itself "
                        "(.ci/run makes its venv and exports the variable)")
        return None
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([exe, SCRIPT, "--out", out_dir], capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        pytest.fail(f"{SCRIPT} failed under {exe} ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, script.EXPECTED)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tp(tmp_path_factory) -> dict:
    live = live_tensorpack(str(tmp_path_factory.mktemp("tensorpack")))
    return COMMITTED if live is None else live


@pytest.fixture(scope="module")
def bf() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings themselves are observed case by case
        return json.loads(json.dumps(script.observe(bfd, endless_iterator=False)))


def test_the_reference_covers_every_case(tp):
    """The committed file was made from this script's cases; a live run agrees with it."""
    cases = {"signatures": script.SIGNATURES, "workers": script.WORKERS, "orders": script.WORKERS,
             "nr_keywords": script.NR_KEYWORDS, "old_style": script.OLD_STYLE, "local_shuffle": script.LOCAL_SHUFFLE}
    for section, names in cases.items():
        assert sorted(COMMITTED[section]) == sorted(names), f"{section}: regenerate {script.EXPECTED} with {SCRIPT}"
    assert COMMITTED["versions"]["tensorpack"] == "0.11"
    if tp is not COMMITTED:
        assert {k: v for k, v in tp.items() if k != "versions"} == \
            {k: v for k, v in COMMITTED.items() if k != "versions"}, "the committed fixture is out of date"


@pytest.mark.parametrize("name", script.SIGNATURES)
def test_positional_parameters_are_tensorpacks(name, tp, bf):
    theirs, ours = tp["signatures"][name], bf["signatures"][name]
    assert ours["positional"][:len(theirs["positional"])] == theirs["positional"]
    assert set(theirs["keyword_only"]) <= set(ours["positional"] + ours["keyword_only"])


FEEDER = "MultiProcessMapAndBatchData(ds, 2, f, 2, 8)"  # tensorpack forks a feeder process besides its workers


@pytest.mark.parametrize("case", sorted(script.WORKERS))
def test_a_call_starts_as_many_workers(case, tp, bf):
    theirs, ours = tp["workers"][case], bf["workers"][case]
    if case == FEEDER:
        assert ours == {"processes": 2, "threads": 0} and theirs == {"processes": 3, "threads": 0}
    else:
        assert ours == theirs


LOOKS_SWAPPED = {"MultiProcessRunner(ds, 2, 3)", "MultiThreadRunner(get_df, 2, 3)"}  # warned about here


@pytest.mark.parametrize("case", sorted(script.WORKERS))
def test_a_call_takes_the_same_counts(case, tp, bf):
    theirs, ours = tp["orders"][case], bf["orders"][case]
    workers = theirs.get("num_proc", theirs.get("num_thread"))
    assert ours["num_workers"] == workers
    if "num_prefetch" in theirs:
        assert ours["num_prefetch"] == theirs["num_prefetch"]
    assert theirs["warnings"] == []
    ours_here = [w for w in ours["warnings"] if w != "OversubscribedWarning"]  # more processes than this box's CPUs
    assert ours_here == (["UserWarning"] if case in LOOKS_SWAPPED else [])


@pytest.mark.parametrize("case", sorted(script.NR_KEYWORDS))
def test_older_keywords_are_accepted_here_and_no_longer_by_tensorpack(case, tp, bf):
    theirs, ours = tp["nr_keywords"][case], bf["nr_keywords"][case]
    assert theirs["error"] == "TypeError" and "unexpected keyword argument 'nr_" in theirs["message"]
    assert ours["warnings"] == ["DeprecationWarning"]
    renamed = script.NR_KEYWORDS[case].replace("nr_", "num_")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {k: v for k, v in script.constructed(bfd, renamed).items()} == {**ours, "warnings": []}


@pytest.mark.parametrize("case", sorted(script.OLD_STYLE))
def test_old_style_subclasses_yield_what_tensorpacks_yield(case, tp, bf):
    assert bf["old_style"][case] == tp["old_style"][case]


TENSORPACK_CRASHES = {"n12 b2 default interval"}  # buffer_size // 3 == 0: tensorpack divides by it


@pytest.mark.parametrize("case", sorted(script.LOCAL_SHUFFLE))
def test_local_shuffle_streams_are_tensorpacks(case, tp, bf):
    """Same generator, same stream: ``epochs`` iterations here are the first ``epochs * len()`` datapoints of
    tensorpack's endless iterator, and both go on after them."""
    theirs, ours = tp["local_shuffle"][case], bf["local_shuffle"][case]
    n, buffer_size, num_reuse, interval, epochs = script.LOCAL_SHUFFLE[case]
    assert ours["len"] == theirs["len"] == n * num_reuse
    assert ours["goes_on"] and len(ours["stream"]) == epochs * n * num_reuse
    if case in TENSORPACK_CRASHES:
        assert theirs["error"].startswith("ZeroDivisionError")
        assert sorted(set(ours["stream"])) == list(range(n))  # here the interval is 1
        return
    assert theirs["goes_on"]
    assert ours["stream"] == theirs["stream"]
