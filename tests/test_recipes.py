"""Every recipe of docs/recipes.md runs as written, on a small image folder, and leaves nothing behind.

Each ``##`` section is a recipe; its fenced ``python`` and ``bash`` blocks run in order, each as a program of
its own (a reader copies one block at a time), in one temporary folder holding ``images/<class>/<file>.jpg``.
A python block whose first line is a file name comment (``# points.py``) is written to that file instead:
it is the module a later command names. A recipe whose imports are not installed is skipped, naming them.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from procs import processes

from conftest import need, source_tree

RECIPES = Path(source_tree()) / "docs" / "recipes.md"

# What each recipe's output must show (regular expressions), beyond a clean exit: proof that it did its job.
EXPECTED = {
    "An image folder to a torch training loop": [r"epoch 1: loss \d"],
    "tensorpack's efficient LMDB recipe": [r"epoch 1: last batch \(8, 32, 32, 3\)"],
    "Mid-epoch resume in Lightning": [r"resumed at step 5: the next 15 batches are the uninterrupted run's"],
    "Serialize, inspect and measure from the shell": [r"count:\s+12\b", r"classes: 2 .*cat.*dog", r"count:\s+100\b",
                                                      r"shuffled read"],
    "Keras fit": [r"Epoch 3/3\n[^\n]*accuracy: (0\.9|1\.0)"],  # it learns: at chance (0.5) it read as broken
}


def recipes() -> dict[str, list[tuple[str, str]]]:
    """``{title: [(language, code), ...]}`` in page order."""
    out: dict[str, list[tuple[str, str]]] = {}
    title, block, language = None, None, ""
    for line in RECIPES.read_text(encoding="utf-8").splitlines():
        if block is not None:
            if line.startswith("```"):
                out[title].append((language, "\n".join(block) + "\n"))
                block = None
            else:
                block.append(line)
        elif line.startswith("## "):
            title = line[3:].strip()
            out[title] = []
        elif line.startswith("```") and title is not None:
            language, block = line[3:].strip(), []
    return out


RECIPE_BLOCKS = recipes()


def test_the_page_has_the_recipes_this_file_checks():
    # Without this, a renamed heading would skip its output check, and an emptied page would pass.
    assert set(RECIPE_BLOCKS) == set(EXPECTED)
    assert all(any(lang == "python" for lang, _ in blocks) for blocks in RECIPE_BLOCKS.values())
    assert {lang for blocks in RECIPE_BLOCKS.values() for lang, _ in blocks} == {"python", "bash"}


def missing_modules(blocks: list[tuple[str, str]]) -> list[str]:
    """The top-level modules the recipe's python blocks import that are not installed."""
    names = set()
    for language, code in blocks:
        if language != "python":
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    written = {code.split("\n", 1)[0][2:].removesuffix(".py") for lang, code in blocks if _file_name(code)}
    return sorted(n for n in names - written if importlib.util.find_spec(n) is None)


def _file_name(code: str) -> str | None:
    match = re.fullmatch(r"# (\w+\.py)", code.split("\n", 1)[0])
    return match.group(1) if match else None


def write_images(root: Path) -> None:
    """``root/images/{cat,dog}/*.jpg``: 6 JPEGs per class, of two sizes, each a different pattern."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(("cat", "dog")):
        (root / "images" / name).mkdir(parents=True)
        for i in range(6):
            shape = (48, 64, 3) if i % 2 else (64, 48, 3)
            pixels = (rng.integers(0, 64, shape) + 96 * c + 10 * i).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / "images" / name / f"{i}.jpg", quality=90)


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a block's program and anything it started)."""
    return [p.pid for p in processes() if p.session == sid]


def run_block(language: str, code: str, cwd: Path, start_method: str | None = None) -> str:
    """Run a block as a program of its own: a python block as a file (``block.py``, as a reader saves it), under
    ``start_method`` when given (set before the file runs as ``__main__``, as Python 3.14 and macOS default to)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the bridgeflow command
    if language == "python":
        (cwd / "block.py").write_text(code)
        command = [sys.executable, "block.py"] if start_method is None else [
            sys.executable, "-c", f"import multiprocessing, runpy; multiprocessing.set_start_method({start_method!r}); "
                                  "runpy.run_path('block.py', run_name='__main__')"]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the block ran past 300 s:\n{code}\n--- output:\n{output}")
    # multiprocessing's forkserver and resource tracker leave when the program's end closes their pipes: a
    # moment after it, longer on a busy machine. What is still there after a few seconds was left running.
    deadline = time.monotonic() + 5
    while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"bf{proc.pid}_")]
    for name in segments:
        os.unlink(f"/dev/shm/{name}")
    assert proc.returncode == 0, f"the block failed (exit {proc.returncode}):\n{code}\n--- output:\n{output}"
    assert not left, f"the block left processes running: {left}\n{code}"
    assert not segments, f"the block left shared memory behind: {segments}\n{code}"
    return output


@pytest.mark.slow
@pytest.mark.parametrize("title", list(RECIPE_BLOCKS))
def test_recipe(title, tmp_path):
    _run_recipe(title, tmp_path)


def _run_recipe(title: str, cwd: Path, start_method: str | None = None) -> str:
    blocks = RECIPE_BLOCKS[title]
    for module in missing_modules(blocks) + ([] if importlib.util.find_spec("PIL") else ["PIL"]):
        need(module)  # skips naming the extra to install, or fails under CI where the job installed it
    write_images(cwd)
    output = ""
    for language, code in blocks:
        if language == "python" and _file_name(code):
            (cwd / _file_name(code)).write_text(code)
        else:
            output += run_block(language, code, cwd, start_method)
    for expected in EXPECTED[title]:
        assert re.search(expected, output), f"{title}: {expected!r} is not in the output:\n{output}"
    return output


@pytest.mark.slow
def test_a_recipe_with_worker_processes_runs_under_forkserver(tmp_path):
    """Python 3.14's default start method on Linux (spawn, macOS's, imports the file the same way): without
    ``if __name__ == "__main__":`` each worker would start the pipeline again, and fail."""
    output = _run_recipe("tensorpack's efficient LMDB recipe", tmp_path, "forkserver")
    assert "Error" not in output, output


def readme_quick_start() -> str:
    """The README's first python block under "## Quick start"."""
    text = (Path(source_tree()) / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_quick_start_runs_under_forkserver_on_two_cpus_without_a_warning(tmp_path):
    code = readme_quick_start()
    assert "if __name__ == \"__main__\":" in code
    cpus = sorted(os.sched_getaffinity(0))[:2]  # a 2-core machine, as a newcomer's laptop or CI runner may be
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # inherited by the block's process
    try:
        output = run_block("python", code, tmp_path, "forkserver")
    finally:
        os.sched_setaffinity(0, old)
    assert "Warning" not in output, output  # OversubscribedWarning above all
    assert re.search(r"\d+ (batches|it)", output), output  # TestDataSpeed's figures
