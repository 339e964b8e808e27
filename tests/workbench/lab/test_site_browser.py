"""The built site opened as a reader opens it: every page in a headless Chromium, offline.

For each page: no request leaves the machine (only ``file:`` and ``data:`` URLs are
loaded), every formula is rendered (MathML laid out, no ``$…$`` TeX left in the text), no
image is broken, and every link to another page of the site points at a file that exists.
Screenshots of each page (its top, and its first formula) go to ``$MOE_LAB_SCREENSHOTS``
when that is set.

The site checked is one built here from small executed notebooks (formulas, a figure, an
exercise, stderr noise), and also ``build/site`` (or ``$MOE_LAB_SITE_DIR``) when
``make workbook`` has built it.
Skipped, saying why, where no Chromium (or Chrome) is installed or ``websocket-client`` is
missing: CI need not have a browser.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from moe_lab.workbench.lab import site

ROOT = Path(__file__).resolve().parents[3]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")


def _browser() -> str | None:
    explicit = os.environ.get("MOE_LAB_CHROMIUM")
    if explicit:
        return explicit
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


BROWSER = _browser()
websocket = pytest.importorskip("websocket", reason="websocket-client is not installed: the "
                                "browser test drives Chromium over its DevTools protocol")
pytestmark = pytest.mark.skipif(
    BROWSER is None, reason="no Chromium or Chrome installed (e.g. `apt-get install chromium`): "
    "the built site is not opened in a browser here")


class Page:
    """One tab of a headless Chromium, driven over the DevTools protocol."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {event} within {timeout} s")
            self.events.append(json.loads(self.ws.recv()))

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


@pytest.fixture(scope="module")
def chromium():
    profile = tempfile.mkdtemp(prefix="moe-lab-chromium-")
    proc = subprocess.Popen(
        [BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
         "--window-size=1280,900", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = Path(profile) / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{BROWSER} did not start its DevTools endpoint")
        time.sleep(0.1)
    port = int(port_file.read_text().splitlines()[0])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def _open(endpoint: str) -> tuple[Page, str]:
    request = urllib.request.Request(f"{endpoint}/json/new?about:blank", method="PUT")
    with urllib.request.urlopen(request, timeout=30) as response:  # the local DevTools endpoint
        target = json.load(response)
    return Page(target["webSocketDebuggerUrl"]), target["id"]


CHECKS = r"""(() => {
  const maths = [...document.querySelectorAll('math')];
  const text = document.body.innerText;
  return {
    maths: maths.length,
    unrendered_maths: maths.filter(m => m.getBoundingClientRect().width === 0).length
                      + document.querySelectorAll('code.tex').length,
    tex_left: (text.match(/\$\$[^$]+\$\$|(^|[\s(])\$[^$\s][^$\n]*[^$\s\\]\$(?!\d)/g) || []).slice(0, 5),
    broken_images: [...document.images].filter(i => !i.complete || i.naturalWidth === 0)
                     .map(i => i.src.slice(0, 80)),
    links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
    scripts_with_src: [...document.querySelectorAll('script[src]')].map(s => s.src),
    nav_links: [...document.querySelectorAll('nav.moe-nav a')].map(a => a.getAttribute('href')),
    height: document.documentElement.scrollHeight,
  };
})()"""


def check_page(endpoint: str, path: Path, shots: Path | None) -> dict:
    page, target = _open(endpoint)
    try:
        page.call("Network.enable")
        page.call("Page.enable")
        page.call("Runtime.enable")
        page.call("Page.navigate", url=path.resolve().as_uri())
        page.wait_for("Page.loadEventFired")
        time.sleep(0.3)  # late requests (fonts, lazy images) show up as events too
        report = page.evaluate(CHECKS)
        if shots is not None:  # the top of the page, and where its first formula is
            shots.mkdir(parents=True, exist_ok=True)
            png = page.call("Page.captureScreenshot", format="png")["data"]
            (shots / f"{path.stem}.png").write_bytes(base64.b64decode(png))
            if report["maths"]:
                page.evaluate("document.querySelector('math').scrollIntoView({block: 'center'})")
                png = page.call("Page.captureScreenshot", format="png")["data"]
                (shots / f"{path.stem}-math.png").write_bytes(base64.b64decode(png))
        page.call("Runtime.evaluate", expression="document.body.innerText.length")  # drain events
        requests = [e["params"]["request"]["url"] for e in page.events
                    if e.get("method") == "Network.requestWillBeSent"]
        failed = [e["params"] for e in page.events if e.get("method") == "Network.loadingFailed"]
    finally:
        page.ws.close()
        urllib.request.urlopen(f"{endpoint}/json/close/{target}", timeout=30).close()
    report["outside"] = [u for u in requests if not u.startswith(("file:", "data:", "about:"))]
    report["failed"] = [f.get("errorText") for f in failed]
    report["missing_targets"] = []
    for href in report["links"]:
        parsed = urlparse(href)
        if parsed.scheme or href.startswith("#"):
            continue  # an external link is only followed if clicked; an anchor is on the page
        if not (path.parent / unquote(parsed.path)).exists():
            report["missing_targets"].append(href)
    return report


def _assert_page(name: str, report: dict, expect_math: bool) -> None:
    assert report["outside"] == [], f"{name}: requests leaving the machine {report['outside']}"
    assert report["failed"] == [], f"{name}: failed loads {report['failed']}"
    assert report["scripts_with_src"] == [], f"{name}: scripts fetched {report['scripts_with_src']}"
    assert report["broken_images"] == [], f"{name}: broken images {report['broken_images']}"
    assert report["missing_targets"] == [], f"{name}: broken links {report['missing_targets']}"
    assert report["unrendered_maths"] == 0, f"{name}: formulas not laid out"
    assert report["tex_left"] == [], f"{name}: TeX shown as text {report['tex_left']}"
    if expect_math:
        assert report["maths"] > 0, f"{name}: no formula rendered"


def _notebook(path: Path, title: str, formula: str) -> None:
    md = nbformat.v4.new_markdown_cell(
        f"# {title}\n\nThe bubble is ${formula}$ of the step.\n\n**You will learn**\n"
        "- a bullet that wraps\n  where the source wraps, and stays whole;\n"
        "- a formula in a bullet, $p - 1$.\n\n$$y = \\sum_{j=1}^{k} w_j x_j$$\n\n"
        "Code keeps its dollars: `echo $HOME`.")
    code = nbformat.v4.new_code_cell("plot()", execution_count=1)
    code.outputs = [
        nbformat.v4.new_output("display_data", data={"image/png": _PNG, "text/plain": "<Figure>"}),
        nbformat.v4.new_output("stream", name="stderr", text=(
            "Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load\n"
            "UserWarning: moe_lab says this matters\n")),
        nbformat.v4.new_output("display_data", data={"text/markdown": "| a | b |\n|---|---|\n| 1 | $x^2$ |",
                                                     "text/plain": "table"}),
    ]
    nb = nbformat.v4.new_notebook(cells=[md, code])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def small_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    workbook = root / "workbook"
    workbook.mkdir()
    _notebook(workbook / "01_first.ipynb", "01 · First", "(p-1)/(m+p-1)")
    _notebook(workbook / "02_second.ipynb", "02 · Second", r"\frac{a}{b}")
    ledger = root / "ledger.jsonl"
    ledger.write_text("")
    return site.build_site(workbook, root / "site", ledger).parent


def _shots(tag: str) -> Path | None:
    base = os.environ.get("MOE_LAB_SCREENSHOTS")
    return Path(base) / tag if base else None


def test_a_small_site_renders_offline(chromium, small_site):
    for path in sorted(small_site.glob("*.html")):
        report = check_page(chromium, path, _shots("small"))
        _assert_page(path.name, report, expect_math=True)
        if path.name != "index.html":
            assert "index.html" in report["nav_links"], path.name
    first = (small_site / "01_first.html").read_text()
    assert "moe_lab says this matters" in first and "torchao" not in first
    assert "echo $HOME" in first and "<table" in first


BUILT = Path(os.environ.get("MOE_LAB_SITE_DIR") or ROOT / "build" / "site")


@pytest.mark.skipif(not (BUILT / "index.html").exists(),
                    reason="build/site has not been built (`make workbook` builds it)")
def test_the_built_site_renders_offline(chromium):
    built = BUILT
    pages = sorted(built.glob("*.html"))
    for path in pages:
        report = check_page(chromium, path, _shots("built"))
        _assert_page(path.name, report, expect_math=False)
        if path.name != "index.html":
            assert "index.html" in report["nav_links"], f"{path.name}: no link to the index"
