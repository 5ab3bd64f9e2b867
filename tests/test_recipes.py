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
from pathlib import Path

import numpy as np
import pytest

from conftest import need, source_tree

RECIPES = Path(source_tree()) / "docs" / "recipes.md"

# What each recipe's output must show (regular expressions), beyond a clean exit: proof that it did its job.
EXPECTED = {
    "An image folder to a torch training loop": [r"epoch 1: loss \d"],
    "tensorpack's efficient LMDB recipe": [r"epoch 1: last batch \(8, 32, 32, 3\)"],
    "Mid-epoch resume in Lightning": [r"resumed at step 5: the next 15 batches are the uninterrupted run's"],
    "Serialize, inspect and measure from the shell": [r"count:\s+12\b", r"classes: 2 .*cat.*dog", r"count:\s+100\b",
                                                      r"shuffled read"],
    "Keras fit": [r"Epoch 3/3"],
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
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry))
    return out


def run_block(language: str, code: str, cwd: Path) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the bridgeflow command
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the block ran past 300 s:\n{code}\n--- output:\n{output}")
    left = session_processes(proc.pid)
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
    blocks = RECIPE_BLOCKS[title]
    for module in missing_modules(blocks) + ([] if importlib.util.find_spec("PIL") else ["PIL"]):
        need(module)  # skips naming the extra to install, or fails under CI where the job installed it
    write_images(tmp_path)
    output = ""
    for language, code in blocks:
        if language == "python" and _file_name(code):
            (tmp_path / _file_name(code)).write_text(code)
        else:
            output += run_block(language, code, tmp_path)
    for expected in EXPECTED[title]:
        assert re.search(expected, output), f"{title}: {expected!r} is not in the output:\n{output}"
