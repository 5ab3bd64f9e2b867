"""Shared test fixtures: a time limit per test, a check that nothing outlives a test, and ``need()`` for optional
packages."""

from __future__ import annotations

import configparser
import contextlib
import faulthandler
import functools
import gc
import importlib
import importlib.util
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from types import ModuleType

import pytest
from procs import children

from bridgeflow._deps import EXTRAS, install_hint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _find_source_tree() -> str | None:
    """The checkout: the folder above tests/ when it is one, else ``BRIDGEFLOW_SOURCE_TREE`` (.ci/run's
    installed-wheel job runs a copy of tests/ from a folder of its own and names the checkout there)."""
    for candidate in (ROOT, os.environ.get("BRIDGEFLOW_SOURCE_TREE")):
        if candidate and os.path.isfile(os.path.join(candidate, "setup.cfg")) \
                and os.path.isdir(os.path.join(candidate, "adapters")):
            return os.path.abspath(candidate)
    return None


SOURCE_TREE = _find_source_tree()


def source_tree() -> str:
    """The checkout's folder, for a test that reads it (docs/, examples/, benchmarks/, setup.cfg) rather than
    the installed package; skips, saying so, where tests/ was copied out of it and no checkout is named."""
    __tracebackhide__ = True
    if SOURCE_TREE is None:
        pytest.skip("needs the source tree (docs/, examples/, setup.cfg...): these tests run from a copy of "
                    "tests/; set BRIDGEFLOW_SOURCE_TREE to the checkout", allow_module_level=True)
    return SOURCE_TREE

# distributions whose import name is not their own name
_IMPORT_NAMES = {"opencv-python-headless": "cv2", "pillow": "PIL", "pyzmq": "zmq", "tensorflow-cpu": "tensorflow",
                 "zlib-ng": "zlib_ng"}


@functools.cache
def _extras() -> dict[str, dict[str, str]]:
    """setup.cfg's extras: extra -> {import name: distribution}; without the checkout, the installed package's."""
    by_extra: dict[str, list[str]] = {}
    if SOURCE_TREE is not None:
        cfg = configparser.ConfigParser()
        cfg.read(os.path.join(SOURCE_TREE, "setup.cfg"))
        for extra, requirements in cfg["options.extras_require"].items():
            by_extra[extra] = [line.strip() for line in requirements.splitlines() if line.strip()]
    else:
        import importlib.metadata

        for requirement in importlib.metadata.requires("bridgeflow") or []:
            m = re.search(r"""extra == ['"]([^'"]+)['"]""", requirement)
            if m:
                by_extra.setdefault(m.group(1), []).append(requirement)
    out: dict[str, dict[str, str]] = {}
    for extra, requirements in by_extra.items():
        dists = [re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements]
        out[extra] = {_IMPORT_NAMES.get(d, d.replace("-", "_")): d for d in dists}
    return out


@functools.cache
def installed_by_ci() -> frozenset[str]:
    """Import names of the packages this CI job installed: a test that needs one of them fails when it is
    missing (an install bug) instead of skipping. Off CI, nothing: a missing package skips its tests.

    ``BRIDGEFLOW_TEST_EXTRAS`` names the extras the job installed (``.ci/run`` sets it to what it passed
    to pip: ``lmdb,hdf5,msgpack,zmq,test`` for the core jobs); under ``CI`` without it, every extra.
    """
    if not os.environ.get("CI"):
        return frozenset()
    extras = _extras()
    chosen = os.environ.get("BRIDGEFLOW_TEST_EXTRAS")
    names = list(extras) if chosen is None else [e.strip() for e in chosen.split(",") if e.strip()]
    unknown = [e for e in names if e not in extras]
    if unknown:
        raise pytest.UsageError(f"BRIDGEFLOW_TEST_EXTRAS names extras setup.cfg does not have: {unknown}")
    return frozenset(m for e in names for m in extras[e])


def docs_module(name: str):
    """Import ``docs/<name>.py`` (the docs' build scripts are not a package) for a module-scoped fixture;
    after the module's tests, forget it and the docs modules it imported."""
    import contextlib
    from pathlib import Path

    docs = str(Path(source_tree()) / "docs")

    @contextlib.contextmanager
    def imported():
        sys.path.insert(0, docs)
        try:
            yield importlib.import_module(name)
        finally:
            sys.path.remove(docs)
            for mod in (name, "check_site", "apigen", "api_pages"):
                sys.modules.pop(mod, None)

    return imported()


def need(module: str, import_it: bool = True) -> ModuleType | None:
    """Import ``module`` (``"torch"``, ``"lightning.pytorch"``) for the test or test file that calls this; when
    it is not installed, skip with the extra that installs it, or fail under CI when the job installed it.

    At the top of a test file (before the imports from that package) it skips the whole file; in a test,
    that test. With ``import_it=False`` only a top-level package is looked up, not imported (None): for a file
    whose tests run the package in subprocesses, or import it themselves.
    """
    __tracebackhide__ = True  # a skip names the test file that needs the package, not this one
    try:
        if not import_it:
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"No module named {module!r}", name=module)
            return None
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        missing = (exc.name or top).split(".")[0]
        extra = next((e for e, names in _extras().items() if top in names and e != "all"), None)
        how = (install_hint(top) if extra in EXTRAS else f'pip install -e ".[{extra}]"' if extra
               else f"pip install {top}")
        why = f"needs {top} ({how})" + (f": it imports {missing}, which is missing" if missing != top else "")
        if top in installed_by_ci() or missing in installed_by_ci():
            pytest.fail(f"{why}, but this CI job installed it: a test that skips here would hide an install "
                        f"bug ({exc})", pytrace=False)
        pytest.skip(why, allow_module_level=True)


def have(module: str) -> bool:
    """Whether ``module`` is installed, for a test that checks more with it and still checks the rest without;
    under CI, a job that installed it fails the test when it is missing, as :func:`need` does."""
    __tracebackhide__ = True
    try:
        need(module)
    except pytest.skip.Exception:
        return False
    return True


# A suite started with SIGINT ignored (a background job of a script, nohup) passes that on to the processes
# its tests start, which then never see the Ctrl-C a test sends them: give them Python's handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A bound on a wait that ends within a second when the code works and much later, or never, when it does not (a
# timeout that does not fire, a dead worker nobody notices). Generous, so that a busy machine does not fail it:
# the tests assert what ended the wait and in what order, not how fast (benchmarks measure speed).
PROMPTLY_S = 30.0

SHM_DIR = "/dev/shm"
SHM_PREFIX = "bf"  # bridgeflow's shared-memory segments are named bf<pid>_...


# A test that runs longer than its time limit fails, and the run goes on (setup.cfg: pytest-timeout, 240 s,
# `--timeout N` or a `timeout` mark to change it): its report then holds every thread's stack of the test process
# and of each process under it (tests/hangs.py). Should the main thread be stuck where a signal cannot reach it
# (a C call holding the GIL), a backstop 60 s later writes every thread's stack to a file and ends the test
# process; under pytest-xdist that is a crashed worker, reported as the test's failure with the file's stacks,
# and the run goes on in a new worker.
_BACKSTOP_S = float(os.environ.get("BRIDGEFLOW_TEST_BACKSTOP_S", "60"))  # tests/test_hangs.py sets it
_controller = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
_HANG_LOG = os.environ.get("BRIDGEFLOW_TEST_HANG_LOG") or os.path.join(
    tempfile.gettempdir(), f"bridgeflow-test-hang-{_controller}.log")
_hang_file = None  # this process's, opened at the first test: HANG_LOG.gw0, HANG_LOG.gw1... under xdist


_STACKS = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's signal method, plus the stacks of every process taken when the limit strikes (before the
    test's ``finally`` and ``with`` blocks stop what hung), and the backstop."""
    global _hang_file
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own thread method: it dumps this process's stacks and ends it
    if _hang_file is None:
        _hang_file = open(f"{_HANG_LOG}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "w")
    _hang_file.seek(0)
    _hang_file.truncate()
    _hang_file.write(f"{item.nodeid} ran {settings.timeout + _BACKSTOP_S:.0f} s and did not stop when its time "
                     f"limit ({settings.timeout:.0f} s) failed it; every thread's stack:\n")
    _hang_file.flush()
    faulthandler.dump_traceback_later(settings.timeout + _BACKSTOP_S, exit=True, file=_hang_file)

    def on_timeout(signum, frame):
        __tracebackhide__ = True
        from hangs import stacks_of_everything

        item.stash[_STACKS] = stacks_of_everything()
        pytest.fail(f"Timeout (>{settings.timeout}s) from pytest-timeout.")

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        faulthandler.cancel_dump_traceback_later()
        _hang_file.seek(0)
        _hang_file.truncate()

    item.cancel_timeout = cancel  # what pytest-timeout's pytest_timeout_cancel_timer calls
    signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    stacks = item.stash.get(_STACKS, None)
    if stacks is not None and call.excinfo is not None:
        del item.stash[_STACKS]
        outcome.get_result().sections.append(("stacks when the time limit struck", stacks))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (the README's command) whose crashed worker is a reported failure, not a wait."""
    if config.getvalue("dist") == "loadgroup":
        from hangs import CrashTolerantLoadGroup

        return CrashTolerantLoadGroup(config, log)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """A worker that died: its backstop's stacks, if it wrote them, go into the failure's report."""
    try:
        with open(f"{_HANG_LOG}.{report.node.gateway.id}") as f:
            stacks = f.read()
    except (OSError, AttributeError):
        return
    if stacks.strip():
        report.longrepr = f"{report.longrepr}\n{stacks}"


def pytest_unconfigure(config):
    if _hang_file is not None:
        _hang_file.close()
    if not os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("BRIDGEFLOW_TEST_HANG_LOG"):
        for name in os.listdir(os.path.dirname(_HANG_LOG)):
            if name.startswith(os.path.basename(_HANG_LOG)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(os.path.dirname(_HANG_LOG), name))


def pytest_report_header(config):
    import bridgeflow

    return f"bridgeflow {bridgeflow.__version__} imported from {os.path.dirname(bridgeflow.__file__)}"


def pytest_configure(config):
    """``BRIDGEFLOW_TEST_INSTALLED=1`` (.ci/run's installed-wheel job): the package under test must be the
    installed one, in site-packages, not a checkout; every test process checks."""
    if os.environ.get("BRIDGEFLOW_TEST_INSTALLED"):
        import bridgeflow

        where = os.path.dirname(os.path.realpath(bridgeflow.__file__))
        # (a venv may live inside the checkout, as .ci/run's do: its site-packages is still an install)
        if os.path.basename(os.path.dirname(where)) != "site-packages" or (
                SOURCE_TREE is not None and where == os.path.realpath(os.path.join(SOURCE_TREE, "bridgeflow"))):
            raise pytest.UsageError(f"BRIDGEFLOW_TEST_INSTALLED is set, but bridgeflow was imported from {where}, "
                                    "not from an installed package's site-packages")


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which writes each test's group into its id
def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (tens of seconds: a training framework's processes, a type check) run first, in
    the order collected, the rest after them as collected. Under pytest-xdist (``-n 3``) a long test started
    last keeps one process busy after the others have finished everything else; started first, it runs beside
    the short tests, which then fill every process to the end. Tests whose cost is a module-scoped fixture
    (a live tensorpack run, a Ray cluster) are not marked: moved apart from their module, each test process
    would build the fixture again.

    Under ``--dist loadgroup`` a test marked ``xdist_group`` must carry its group in its id, or the scheduler
    sends the group's tests to any worker at once (two Ray clusters, two six-launch fixtures side by side):
    pytest 9.2 with pytest-xdist 3.8 did that, silently. Such a test fails at setup, naming the versions."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: collection order kept
    if not getattr(config.option, "loadgroup", False):  # True on the workers of a loadgroup run only
        return
    import xdist

    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[_UNGROUPED] = (
                f"--dist loadgroup: this test is marked xdist_group but its id names no group, so its group runs "
                f"split across workers: pytest {pytest.__version__} with pytest-xdist {xdist.__version__} does "
                f"not group; install the versions that setup.cfg's test extra names")


_UNGROUPED = pytest.StashKey[str]()


def pytest_runtest_setup(item):
    if _UNGROUPED in item.stash:
        pytest.fail(item.stash[_UNGROUPED], pytrace=False)


def pytest_collection_finish(session):
    """Once every test file is imported (torch, TensorFlow, Lightning: ~600,000 objects the collector tracks),
    move what survives a full collection out of the collector's reach for the rest of the run: each later
    ``gc.collect()`` (``leak_check`` runs one after every test it guards; the interpreter runs them too) then
    walks only what the tests made since, 0.01 s instead of 0.3-0.6 s. What a test drops in a reference cycle
    is still collected; only objects alive now, imports and module-level values, are never freed."""
    gc.collect()
    gc.freeze()


# multiprocessing's own helpers live as long as the interpreter once started; they are not workers.
_STDLIB_HELPERS = (b"resource_tracker", b"forkserver")


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this process, read from /proc, less multiprocessing's helpers."""
    out = set()
    for pid in children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if not any(h in cmdline for h in _STDLIB_HELPERS):
            out.add(pid)
    return out


def shm_entries(mine_only: bool = True) -> set[str]:
    """bridgeflow's shared-memory segments: by default only this process's pools (``bf<pid>_...``), so
    test suites running side by side do not see each other's."""
    prefix = f"{SHM_PREFIX}{os.getpid()}_" if mine_only else SHM_PREFIX
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def wait_for(predicate, timeout: float = PROMPTLY_S, interval: float = 0.02) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds; polled, so a wait that works ends at once.
    Bounded by ``PROMPTLY_S`` unless told: what a test waits for (a thread ending, workers exiting after their
    parent died) comes within a second on a quiet machine and only later on a busy one, never when broken."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def leak_check():
    """Assert that no child process, thread or bridgeflow shared-memory segment outlives the test: they go
    within a second or two once a loader ends; on a busy machine (three test processes on two cores) that can
    take longer, so the wait is bounded by ``PROMPTLY_S``, which only a leak exceeds."""
    procs0, shm0 = child_pids(), shm_entries()
    threads0 = {t.ident for t in threading.enumerate()}
    yield
    gc.collect()  # what the test dropped inside a reference cycle goes now, not whenever the collector next runs
    new_threads = lambda: [t for t in threading.enumerate() if t.ident not in threads0 and t.is_alive()]
    assert wait_for(lambda: not (child_pids() - procs0), PROMPTLY_S), f"child processes left: {child_pids() - procs0}"
    assert wait_for(lambda: not (shm_entries() - shm0), PROMPTLY_S), f"shared memory left: {shm_entries() - shm0}"
    assert wait_for(lambda: not new_threads(), PROMPTLY_S), f"threads left: {[t.name for t in new_threads()]}"


class InterruptAfterRead:
    """Stands in for a pool's result reader and raises ``KeyboardInterrupt`` once, after the message was
    read from the pipe: Ctrl-C striking between reading a worker's results and filing them."""

    def __init__(self, reader) -> None:
        self.reader, self.fired = reader, False

    def loads(self, data):
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return self.reader.loads(data)

    def close(self) -> None:
        self.reader.close()


def results_of_forked_children(target, args: tuple, n: int = 3, timeout: float = 60) -> list:
    """Run ``target(*args, queue)`` in ``n`` forked children; the value each put on the queue, in the order
    they came. Every child must exit cleanly."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"a reader exited with {p.exitcode}"
    return results


def free_tcp() -> str:
    """A TCP address on loopback with a port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def exit_with_parent(ppid: int) -> None:
    """Run in a daemon thread of a forked helper process: end it once its parent is gone (no orphans)."""
    while os.getppid() == ppid:
        time.sleep(0.2)
    os._exit(1)
