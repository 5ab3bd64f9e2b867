"""docs/check_site.py finds what it is for: a public name missing from the site, an internal path described,
a code block that scrolls sideways (in headless Chromium, skipped without it)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from conftest import docs_module, source_tree

DOCS = Path(source_tree()) / "docs"


@pytest.fixture(scope="module")
def check_site():
    with docs_module("check_site") as module:
        yield module


def page(body: str) -> str:
    return f"<!doctype html><html><head><meta charset='utf-8'></head><body>{body}</body></html>"


def test_the_reference_check_names_what_is_missing_or_internal(check_site, tmp_path):
    for framework in ("torch", "tensorflow"):
        if importlib.util.find_spec(framework) is None:
            pytest.skip(f"the reference lists bridgeflow.adapters' names, which import {framework}")
    (tmp_path / "api").mkdir()
    (tmp_path / "index.html").write_text(page("<a href='api/index.html'>API</a>"))
    (tmp_path / "api" / "index.html").write_text(page(
        "<a href='flows.html'>flows</a><dl><dt id='bridgeflow.__version__'>__version__</dt>"
        "<dd>bridgeflow.dataflow.__version__</dd></dl>"))
    (tmp_path / "api" / "flows.html").write_text(page(
        "<dl><dt id='bridgeflow.DataFlow'>DataFlow</dt><dd><code>bridgeflow.dataflow.DataFlow</code></dd>"
        "<dt id='bridgeflow.DataFlow.close'>close</dt>"
        "<dt id='bridgeflow.parallel._transport.shm.SlabWriter'>SlabWriter</dt></dl>"))
    (tmp_path / "api" / "deep.html").write_text(page("<dt id='bridgeflow.MapData'>MapData</dt>"))  # 3 clicks
    problems = check_site.check_reference(tmp_path)
    assert ("api/flows.html describes bridgeflow.parallel._transport.shm.SlabWriter, which is not a public name"
            in problems)
    assert "bridgeflow.MapData: no entry with that id on any page within two clicks of index.html" in problems
    assert not [p for p in problems if p.startswith(("bridgeflow.DataFlow:", "bridgeflow.__version__:"))]
    assert all("DataFlow.close" not in p for p in problems)  # a member of an entry is public


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="needs chromium and chromedriver (apt-get install -y chromium chromium-driver)")
def test_the_fit_check_finds_code_that_scrolls_or_is_cut(check_site, tmp_path):
    long = "x = 1  # " + "a long comment " * 20
    (tmp_path / "index.html").write_text(page(
        "<article role='main' style='width: 400px'>"
        f"<pre id='scrolls' style='overflow: auto; white-space: pre'>{long}</pre>"
        f"<pre id='wraps' style='white-space: pre-wrap'>{long}</pre>"
        "<div style='overflow: hidden; width: 200px'><span style='white-space: nowrap'>"
        "hidden past the edge of its box, hidden past the edge of its box</span></div>"
        "</article>"))
    problems = check_site.check_fit(tmp_path, tmp_path / "screens")
    # the scrolling block (not the wrapping one), and the clipped line: its box and the line itself
    assert len(problems) == 3, "\n".join(problems)
    assert problems[0].startswith("index.html: cut off: pre: x = 1 # a long comment")
    assert "px of code in 400 px" in problems[0]
    assert problems[1].startswith("index.html: cut off: div: hidden past the edge")
    assert "no scrollbar" in problems[1]
    assert problems[2].startswith("index.html: cut off: span: hidden past the edge")
    assert (tmp_path / "screens" / "index.png").stat().st_size > 1000
