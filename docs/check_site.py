"""Checks a built documentation site: the reference by public name, and code that fits at 1280 px.

Run it after the build (it builds nothing itself)::

    sphinx-build -q -W --keep-going -b html docs docs/_build/html
    python docs/check_site.py docs/_build/html --screens .screens

1. **The reference** (needs only the HTML): every public name (``api_pages.py``) has its entry, under the
   path users import, on a page at most two clicks from ``index.html``; every other path of the object is
   named on that entry's page; the reference pages describe nothing under an internal module's path.
2. **Code that fits** (needs Chromium and its driver: ``apt-get install -y chromium chromium-driver``): opens
   the front page, getting started, PyTorch and every reference page in headless Chromium at 1280 px and
   fails if any text is out of sight: a code block wider than its box (code must wrap, not scroll: overlay
   scrollbars hide until used), any other element wider than its box with no scrollbar to reach the rest, or
   past the edge of the box that clips it or of the window. With ``--screens DIR`` it saves a PNG of each
   page's top and of its widest code block, for a person to look at.

Exit status 1 when a check fails (each failure is printed), 2 when Chromium is missing for ``--screens`` or
``--fit``. This is a script, not a test: the test suite does not build the site (a build imports TensorFlow
and torch and takes half a minute); CI runs it right after its docs build.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WIDTH, HEIGHT = 1280, 800
FIT_PAGES = ["index.html", "getting-started.html", "torch.html", "recipes.html"]  # and every api/ page
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage",
                 f"--window-size={WIDTH},{HEIGHT}"]


# -- the reference --------------------------------------------------------------------------------------


class _Page(HTMLParser):
    """The links, element ids and text of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: set[str] = set()
        self.ids: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            self.ids.add(attributes["id"] or "")
        if tag == "a" and attributes.get("href"):
            self.links.add(attributes["href"] or "")

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _read(site: Path, page: str) -> _Page:
    parsed = _Page()
    parsed.feed((site / page).read_text(encoding="utf-8"))
    return parsed


def _linked(site: Path, page: str, parsed: _Page) -> set[str]:
    """The site's pages that ``page`` links to, as paths relative to the site."""
    out = set()
    for href in parsed.links:
        if "://" in href or href.startswith(("#", "mailto:")):
            continue
        target = os.path.normpath(os.path.join(os.path.dirname(page), href.split("#")[0]))
        if target.endswith(".html") and (site / target).exists():
            out.add(target)
    return out


def check_reference(site: Path) -> list[str]:
    """Every public name reachable in two clicks under its import path; nothing internal described."""
    import apigen

    the_plan = apigen.plan()
    problems = list(the_plan.problems)
    front = _read(site, "index.html")
    one_click = _linked(site, "index.html", front)
    pages = {p: _read(site, p) for p in one_click}
    two_clicks = set(one_click)
    for page, parsed in list(pages.items()):
        two_clicks |= _linked(site, page, parsed)
    if "api/index.html" not in one_click:
        problems.append("index.html does not link to the API reference (api/index.html)")
    pages.update({p: _read(site, p) for p in two_clicks - set(pages)})
    where = {anchor: page for page, parsed in pages.items() for anchor in parsed.ids}
    for path in the_plan.entries:
        page = where.get(path)
        if page is None:
            problems.append(f"{path}: no entry with that id on any page within two clicks of index.html")
            continue
        text = "".join(pages[page].text)
        problems += [f"{path}: its other path {alias} is not named on {page}"
                     for alias in the_plan.aliases[path] if alias not in text]
    entries = tuple(the_plan.entries)
    for page in sorted(p for p in pages if p.startswith("api/") and p != "api/internals.html"):
        for anchor in sorted(pages[page].ids):
            name = anchor.removeprefix("module-")
            if not (name.startswith("bridgeflow.") or anchor == "module-bridgeflow"):  # a section's id has no dot
                continue
            public = name in apigen.NAMESPACES if anchor.startswith("module-") else \
                any(name == e or name.startswith(e + ".") for e in entries)
            if not public:
                problems.append(f"{page} describes {name}, which is not a public name")
    return problems


# -- code that fits -------------------------------------------------------------------------------------

# For each element of the page's text: is part of it out of sight? A code block (``pre``) must show all its text
# at this width: no scrolling sideways, since a scrollbar is easy to miss (overlay scrollbars hide until
# scrolled). Any other element wider than its box needs a visible scrollbar (one that takes room); an
# element's boxes must end inside the nearest ancestor that clips (overflow other than visible), unless that
# ancestor scrolls with a visible scrollbar, and inside the window.
_MEASURE = """
const article = document.querySelector('article[role=main]') || document.body;
const view = document.documentElement.clientWidth;
const describe = (el) => el.tagName.toLowerCase() + (el.className ? '.' + String(el.className).split(' ')[0] : '')
    + ': ' + (el.textContent || '').trim().slice(0, 60).replace(/\\s+/g, ' ');
const scrollbar = (el) => {
  const cs = getComputedStyle(el);
  if (!['auto', 'scroll'].includes(cs.overflowX)) return false;
  const borders = parseFloat(cs.borderTopWidth) + parseFloat(cs.borderBottomWidth);
  return el.offsetHeight - el.clientHeight - borders > 0;
};
const cut = [];
let widest = null;
for (const el of article.querySelectorAll('*')) {
  const cs = getComputedStyle(el);
  if (cs.display === 'none' || cs.visibility === 'hidden') continue;
  if (el.tagName === 'PRE' && (!widest || el.scrollWidth > widest.scrollWidth)) widest = el;
  if (el.tagName === 'PRE' && el.scrollWidth > el.clientWidth + 1) {  // code must not need scrolling sideways
    cut.push(`${describe(el)} (${el.scrollWidth} px of code in ${el.clientWidth} px)`);
    continue;
  }
  if (cs.overflowX !== 'visible' && el.scrollWidth > el.clientWidth + 1 && !scrollbar(el)) {
    cut.push(`${describe(el)} (${el.scrollWidth} px of text in ${el.clientWidth} px, no scrollbar)`);
    continue;
  }
  let clip = el.parentElement;
  while (clip && clip !== document.body && getComputedStyle(clip).overflowX === 'visible') clip = clip.parentElement;
  if (clip && clip !== document.body && scrollbar(clip)) continue;
  const limit = clip && clip !== document.body
      ? clip.getBoundingClientRect().right - parseFloat(getComputedStyle(clip).borderRightWidth) : view;
  const edge = Math.min(limit, view);
  for (const r of el.getClientRects()) {
    if (r.width > 0 && r.right > edge + 1) {
      cut.push(`${describe(el)} (ends at ${Math.round(r.right)} px, its box at ${Math.round(edge)} px)`);
      break;
    }
  }
}
if (widest) widest.scrollIntoView({block: 'center', behavior: 'instant'});
return {view: view, cut: [...new Set(cut)], widest: widest ? widest.scrollWidth : 0};
"""


class Browser:
    """Headless Chromium driven through chromedriver's WebDriver HTTP interface (the standard library only)."""

    def __init__(self) -> None:
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        driver = shutil.which("chromedriver")
        if not chromium or not driver:
            raise FileNotFoundError("chromium and chromedriver are needed: apt-get install -y chromium chromium-driver")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.profile = tempfile.mkdtemp(prefix="bf-chromium-")
        self.driver = subprocess.Popen([driver, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.session = ""
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    self._call("GET", "/status")
                    break
                except OSError:
                    if time.monotonic() > deadline or self.driver.poll() is not None:
                        raise
                    time.sleep(0.1)
            options = {"binary": chromium, "args": [*CHROMIUM_ARGS, f"--user-data-dir={self.profile}"]}
            self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": options}}})["sessionId"]
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)["value"]

    def open(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def run(self, script: str):
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": []})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", f"/session/{self.session}/screenshot")))

    def close(self) -> None:
        try:
            if self.session:
                self._call("DELETE", f"/session/{self.session}")
        finally:
            self.driver.terminate()
            try:
                self.driver.wait(10)
            except subprocess.TimeoutExpired:
                self.driver.kill()
                self.driver.wait()
            shutil.rmtree(self.profile, ignore_errors=True)


def check_fit(site: Path, screens: Path | None) -> list[str]:
    pages = [p for p in FIT_PAGES if (site / p).exists()]
    pages += sorted(str(p.relative_to(site)) for p in (site / "api").glob("*.html"))
    if screens:
        screens.mkdir(parents=True, exist_ok=True)
    problems = []
    browser = Browser()
    try:
        for page in pages:
            browser.open((site / page).resolve().as_uri())
            if screens:
                browser.screenshot(screens / (page.replace("/", "_").removesuffix(".html") + ".png"))
            found = browser.run(_MEASURE)
            if found["view"] != WIDTH and found["view"] < WIDTH - 20:  # a vertical scrollbar takes up to ~15 px
                problems.append(f"{page}: the window is {found['view']} px wide, not {WIDTH}")
            problems += [f"{page}: cut off: {what}" for what in found["cut"]]
            if screens and found["widest"]:
                browser.screenshot(screens / (page.replace("/", "_").removesuffix(".html") + "-widest-code.png"))
            print(f"{page}: {len(found['cut'])} cut off (widest code block {found['widest']} px)", flush=True)
    finally:
        browser.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the built site, e.g. docs/_build/html")
    parser.add_argument("--screens", type=Path, metavar="DIR", help="also save PNGs of the pages here")
    parser.add_argument("--fit", action="store_true", help="check that code fits even without --screens")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        parser.error(f"{args.site} holds no index.html: build the site first")
    problems = check_reference(args.site)
    print(f"reference: {len(problems)} problem(s)", flush=True)
    if args.fit or args.screens:
        try:
            problems += check_fit(args.site, args.screens)
        except FileNotFoundError as exc:
            print(f"check_site: {exc}", file=sys.stderr)
            return 2
    for problem in problems:
        print(f"FAIL {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
