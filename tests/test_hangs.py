"""The test command never hangs (tests/conftest.py, tests/hangs.py): a test past its time limit fails with every
thread's stack of every process, and the run goes on; a test process that dies (a crashed pytest-xdist worker)
is a reported failure and the run goes on, rather than waiting forever at 99%. Each case runs pytest on a small
test file in a subprocess, with this suite's conftest."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # pytest and its workers started anew: 10-30 s each

HERE = os.path.dirname(os.path.abspath(__file__))


def run_pytest(tmp_path, test_file: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "hangs.py", "procs.py"):
        shutil.copy(os.path.join(HERE, name), tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout_method = signal\n")
    (tmp_path / "test_it.py").write_text(textwrap.dedent(test_file))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, "test_it.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, **(env or {}), BRIDGEFLOW_TEST_HANG_LOG=str(tmp_path / "hang.log")))


HANGS = """
    import subprocess, sys, threading, time

    def stuck_in_a_thread():
        time.sleep(300)

    def test_hangs():
        child = subprocess.Popen([sys.executable, "-c", "import time\\ndef waiting_child():\\n    time.sleep(300)\\n"
                                                        "waiting_child()"])
        threading.Thread(target=stuck_in_a_thread, daemon=True).start()
        try:
            time.sleep(300)
        finally:
            child.kill()
            child.wait()

    def test_after_it():
        pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadgroup"]], ids=["alone", "xdist"])
def test_a_test_past_its_time_limit_fails_with_every_process_s_stacks(tmp_path, workers):
    out = run_pytest(tmp_path, HANGS, "--timeout", "4", *workers)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "1 failed, 1 passed" in text and "Timeout (>4.0s) from pytest-timeout" in text, text
    assert "stacks when the time limit struck" in text
    assert "stuck_in_a_thread" in text  # another thread of the test process
    if shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable)):
        assert "waiting_child (<string>:3)" in text, text  # the child's own stack, read by py-spy
    else:
        assert "-c import time" in text  # the child, named by its command line


CRASHES = """
    import os, signal, time
    import pytest

    @pytest.mark.parametrize("i", range(6))
    def test_before(i):
        time.sleep(0.2)

    def test_kills_its_worker(tmp_path):
        pid = os.fork()
        if pid == 0:  # a child that outlives the worker, holding every descriptor it inherited
            time.sleep(120)
            os._exit(0)
        with open(os.path.join(os.path.dirname(__file__), "orphan"), "w") as f:
            f.write(str(pid))
        os.kill(os.getpid(), signal.SIGKILL)

    @pytest.mark.parametrize("i", range(6))
    def test_after(i):
        time.sleep(0.2)
"""


def test_a_crashed_worker_is_a_reported_failure_and_the_run_goes_on(tmp_path):
    """pytest-xdist 3.8.0 alone waits forever here, its workers idle (tests/hangs.py says why)."""
    try:
        out = run_pytest(tmp_path, CRASHES, "-n", "2", "--dist", "loadgroup")
    finally:
        orphan = tmp_path / "orphan"
        if orphan.exists():
            pid = int(orphan.read_text())
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "1 failed, 12 passed" in text, text  # every other test ran; the one that crashed was not run again
    assert "crashed while running 'test_it.py::test_kills_its_worker'" in text, text
    assert text.count("node down") == 1, text  # run again, it would have killed the replacement too


TWO_CRASHES = """
    import os, signal, time
    import pytest

    HERE = os.path.dirname(__file__)
    if os.environ["PYTEST_XDIST_WORKER"] not in ("gw0", "gw1"):
        time.sleep(6)  # a replacement worker: still collecting when the second worker dies

    @pytest.mark.xdist_group("a")
    def test_first_crash():
        open(os.path.join(HERE, "first"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    @pytest.mark.xdist_group("b")
    def test_second_crash():
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(HERE, "first")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # xdist has seen the first crash and started a replacement
        os.kill(os.getpid(), signal.SIGKILL)

    @pytest.mark.parametrize("i", range(8))
    def test_after(i):
        time.sleep(0.2)
"""


def test_a_crash_while_a_replacement_worker_collects_is_reported_and_the_run_goes_on(tmp_path):
    """pytest-xdist 3.8.0 ends this run in an INTERNALERROR (KeyError in ``_assign_work_unit``): the second
    crash gave work to the first's replacement before it had collected any test."""
    out = run_pytest(tmp_path, TWO_CRASHES, "-n", "2", "--dist", "loadgroup")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "INTERNALERROR" not in text, text
    assert "2 failed, 8 passed" in text, text
    assert "crashed while running 'test_it.py::test_first_crash@a'" in text, text  # its group in its id
    assert "crashed while running 'test_it.py::test_second_crash@b'" in text, text


STUCK = """
    import signal, time

    def test_deaf_to_the_time_limit():
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as a C call that never returns to Python
        time.sleep(300)

    def test_other():
        pass
"""


def test_a_test_deaf_to_its_time_limit_ends_its_worker_with_its_stacks(tmp_path):
    out = run_pytest(tmp_path, STUCK, "--timeout", "2", "-n", "2", "--dist", "loadgroup",
                     env={"BRIDGEFLOW_TEST_BACKSTOP_S": "3"})
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "1 failed, 1 passed" in text, text
    assert "crashed while running 'test_it.py::test_deaf_to_the_time_limit'" in text
    assert "did not stop when its time limit (2 s) failed it" in text  # the backstop's file, in the report
    assert 'File "' in text.split("did not stop when its time limit")[1]  # with the stack that was stuck
