"""The ``bridgeflow`` command (bench, demo, --version) and ``python -m bridgeflow``, run as subprocesses."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import bridgeflow

TIMEOUT = 120


def bridgeflow_exe() -> list[str]:
    exe = shutil.which("bridgeflow")
    assert exe is not None, "the bridgeflow console script is not on PATH; pip install -e . first"
    return [exe]


def run(args: list[str], cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


RATE = re.compile(r"^(\d+) datapoints in [\d.]+s: ([\d.]+) datapoints/s$", re.M)


def test_version():
    out = run(bridgeflow_exe() + ["--version"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"bridgeflow {bridgeflow.__version__}"


def test_python_dash_m():
    out = run([sys.executable, "-m", "bridgeflow", "--version"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"bridgeflow {bridgeflow.__version__}"
    helped = run([sys.executable, "-m", "bridgeflow", "--help"])
    assert helped.returncode == 0 and "bench" in helped.stdout and "demo" in helped.stdout


def test_bench_fake():
    out = run(bridgeflow_exe() + ["bench", "--fake", "3x8x8,1", "--size", "50", "--quiet", "--seconds", "0"])
    assert out.returncode == 0, out.stderr
    m = RATE.search(out.stdout)
    assert m and int(m.group(1)) == 50 and float(m.group(2)) > 0, out.stdout
    assert out.stderr == ""  # --quiet: no progress bar


def test_bench_times_rounds_until_its_seconds_have_passed():
    """A rate measured over a few milliseconds varied 20-fold between runs: bench times --size datapoints
    again and again until --seconds have passed (2 by default) and reports them all."""
    out = run(bridgeflow_exe() + ["bench", "--fake", "4", "--size", "10", "--quiet", "--seconds", "0.3"])
    assert out.returncode == 0, out.stderr
    m = RATE.search(out.stdout)
    assert m and int(m.group(1)) % 10 == 0 and int(m.group(1)) > 10, out.stdout
    assert float(out.stdout.split(" datapoints in ")[1].split("s:")[0]) >= 0.3, out.stdout


def test_bench_fake_batched_counts_its_size_in_datapoints():
    """--size is datapoints with --batch too: 40 of them are 5 batches of 8 (it timed 40 batches, 320
    datapoints, and called them datapoints)."""
    out = run(bridgeflow_exe() + ["bench", "--fake", "4,scalar", "--batch", "8", "--size", "40", "--quiet",
                                  "--constant", "--dtype", "float32", "--seconds", "0"])
    assert out.returncode == 0, out.stderr
    m = re.search(r"^5 batches in [\d.]+s: ([\d.]+) batches/s \(([\d.]+) datapoints/s at 8 a batch\)$",
                  out.stdout, re.M)
    assert m and float(m.group(2)) == pytest.approx(8 * float(m.group(1)), rel=1e-3), out.stdout


FLOW_MODULE = textwrap.dedent('''
    from bridgeflow import DataFromList, MapData, DataFlow

    class Counted(DataFlow):
        def __iter__(self):
            for i in range(7):
                yield [i]

        def stats(self):
            return {"marker": 42}

    def make_flow():
        return MapData(Counted(), lambda dp: [dp[0] * 2])

    def make_list():
        return [[1], [2], [3]]

    def make_number():
        return 5

    def double(dp):
        return [dp[0] * 2]

    def make_spawned():
        from bridgeflow import MultiProcessMapData

        return MultiProcessMapData(DataFromList([[i] for i in range(40)], shuffle=False), 2, double,
                                   start_method="spawn")
''')


def test_bench_module_function(tmp_path):
    (tmp_path / "bf_cli_flows.py").write_text(FLOW_MODULE)
    out = run(bridgeflow_exe() + ["bench", "bf_cli_flows:make_flow", "--size", "20", "--warmup", "0", "--quiet",
                                  "--seconds", "0"],
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert RATE.search(out.stdout).group(1) == "20"
    assert "MapData/Counted: marker=42" in out.stdout  # the wrapped flow's statistics are printed


def test_bench_file_function(tmp_path):
    path = tmp_path / "flows.py"
    path.write_text(FLOW_MODULE)
    out = run(bridgeflow_exe() + ["bench", f"{path}:make_list", "--size", "9", "--quiet", "--seconds", "0"])
    assert out.returncode == 0, out.stderr
    assert RATE.search(out.stdout).group(1) == "9"


@pytest.mark.parametrize("name", ["flows.py", "queue.py"])
def test_bench_file_function_with_spawned_workers(tmp_path, name):
    """The workers import the file's module again to unpickle its functions (spawn, and forkserver, the
    default from Python 3.14). A file named like a standard module (queue.py) must not shadow it."""
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / name
    path.write_text(FLOW_MODULE)
    function = "make_list" if name == "queue.py" else "make_spawned"  # queue.py: loaded privately, fork only
    out = run(bridgeflow_exe() + ["bench", f"{path}:{function}", "--size", "20", "--quiet", "--seconds", "0"],
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert RATE.search(out.stdout).group(1) == "20"


def test_demo():
    out = run(bridgeflow_exe() + ["demo", "--size", "256"])
    assert out.returncode == 0, out.stderr
    assert "256 fake 3x64x64" in out.stdout
    rates = [float(r.replace(",", "")) for r in re.findall(r"([\d,.]+) (?:images|datapoints)/s", out.stdout)]
    assert rates and all(r > 0 for r in rates), out.stdout
    # the CPUs the workers share are said before the speed-up they limit
    lines = out.stdout.splitlines()
    step = next(i for i, line in enumerate(lines) if line.startswith("3. "))
    assert re.search(r"\(\d+ CPUs? here", lines[step]) and re.search(r"\(\d+\.\d\dx\)$", lines[step + 1]), out.stdout


@pytest.mark.parametrize("args, message", [
    (["bench", "--fake", "3xa"], "argument --fake: '3xa'"),
    (["bench", "--fake", "3x-2"], "argument --fake: '3x-2'"),
    (["bench", "--fake", "2", "--dtype", "nosuchtype"], "argument --dtype: 'nosuchtype'"),
    (["bench", "--fake", "2", "--size", "0"], "argument --size: '0'"),
    (["bench", "--fake", "2", "--batch", "-1"], "argument --batch: '-1'"),
    (["bench", "--fake", "2", "--warmup", "x"], "argument --warmup: 'x'"),
    (["bench", "--fake", "2", "--seconds", "-1"], "argument --seconds: '-1'"),
    (["demo", "--size", "0"], "argument --size: '0'"),
    (["bench"], "give either TARGET"),
    (["bench", "bf_no_such_module_xyz:f"], "No module named 'bf_no_such_module_xyz'"),
    (["bench", "nosuchfile.py:f"], "no such file: nosuchfile.py"),
    (["bench", "flows.py:missing"], "has no attribute 'missing'"),
    (["bench", "flows.py:make_number"], "flows.py:make_number gave a int"),
    (["bench", "just_words"], "no such dataset file: just_words"),
    (["bench", "json:dumps"], "json:dumps must be callable without arguments"),
    (["bench", ".:f"], "'.' is not a module name"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
])
def test_bad_arguments(tmp_path, args, message):
    (tmp_path / "flows.py").write_text(FLOW_MODULE)
    out = run(bridgeflow_exe() + args, cwd=tmp_path)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_top_level_help_is_plain_text():
    proc = run([*bridgeflow_exe(), "--help"])
    assert proc.returncode == 0 and "serialize" in proc.stdout and "--traceback" in proc.stdout
    assert "``" not in proc.stdout, proc.stdout
