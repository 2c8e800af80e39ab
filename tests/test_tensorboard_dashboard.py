"""TensorBoard's own Graphs dashboard, in headless Chromium: a traced step's `step_N` graph colours by compute
time and by memory, with the device listed, as TF's did (skipped where Chromium is not installed)."""

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest

from lightning_prof import ProfilerHook
from tests.lightning_models import TinyModel, loader, trainer
from tests.test_tensorboard_server import free_port, stop, tensorboard_server

websocket = pytest.importorskip("websocket", reason="websocket-client drives Chromium over CDP")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")

DEEP = """function deep(root, sel) { const f = root.querySelector(sel); if (f) return f;
  for (const el of root.querySelectorAll('*'))
    if (el.shadowRoot) { const g = deep(el.shadowRoot, sel); if (g) return g; }
  return null; }"""
ALL_TEXT = """(() => { let s = ''; const walk = (node) => { for (const ch of node.childNodes) {
    if (ch.nodeType === 3) s += ch.textContent + ' ';
    else if (ch.nodeType === 1 && ch.tagName !== 'NOSCRIPT' && ch.tagName !== 'STYLE') {
      if (ch.shadowRoot) walk(ch.shadowRoot); walk(ch); } } };
  walk(document.body); return s; })()"""


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, url: str) -> None:
        self._ws = websocket.create_connection(url, timeout=30)
        self._id = 0

    def call(self, method: str, **params):
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == self._id:
                assert "error" not in message, message["error"]
                return message.get("result", {})

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 90):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.js(DEEP + expression):
                return
            time.sleep(0.5)
        pytest.fail(f"the dashboard never showed: {expression}")


@contextlib.contextmanager
def chromium_page():
    """A headless Chromium (always stopped) and its first tab."""
    cdp_port = free_port()
    chromium = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                                 f"--remote-debugging-port={cdp_port}", f"--user-data-dir={tempfile.mkdtemp()}",
                                 "--window-size=1600,1000", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{cdp_port}/json", timeout=2))
                if targets:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("chromium did not start")
            time.sleep(0.5)
        yield Page(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
    finally:
        stop(chromium)


def screenshot(page: Page, path: str) -> None:
    """What a person would see, kept for a look."""
    png = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    with open(path, "wb") as f:
        f.write(png)


@pytest.fixture
def dashboard(tmp_dir):
    t = trainer(tmp_dir, [ProfilerHook(save_steps=2, show_memory=True)], 4)  # the logger's run dir
    t.fit(TinyModel(), loader())
    ready = lambda base: json.load(urllib.request.urlopen(base + "/data/runs", timeout=2))  # noqa: E731
    with tensorboard_server(tmp_dir, ready) as base, chromium_page() as page:
        run = os.path.relpath(t.log_dir, tmp_dir)
        page.call("Page.navigate", url=f"{base}/#graphs&run={run}")
        yield page, run


def legend_for(page: Page, run: str, tag: str, color: str) -> str:
    """Pick the run's tag under 'Session runs', colour by `color`, and return the legend's text."""
    page.wait_for("(() => { const c = deep(document, 'tf-graph-controls'); "
                  "return c && c.datasets && c.datasets.length; })()")
    tags = page.js(DEEP + "deep(document, 'tf-graph-controls').datasets.map(d => [d.name, d.tags.map(t => t.tag)])")
    run_index = [name for name, _ in tags].index(run)
    tag_index = tags[run_index][1].index(tag)
    page.js(DEEP + f"(() => {{ const c = deep(document, 'tf-graph-controls'); c._selectedRunIndex = {run_index}; "
                   f"c._selectedTagIndex = {tag_index}; }})()")
    page.wait_for("(() => { const b = deep(document, 'tf-graph-board'); return b && b.stats; })()")
    page.js(DEEP + f"(() => {{ deep(document, 'tf-graph-controls').colorBy = '{color}'; }})()")
    time.sleep(2)
    text = " ".join(page.js(ALL_TEXT).split())
    legend = re.search(r"Legend (.*?Devices included in stats: \S+)", text)
    assert legend, text[-2000:]
    return legend.group(1)


def test_the_step_graph_colours_by_compute_time_and_memory(dashboard, tmp_dir):
    page, run = dashboard
    compute = legend_for(page, run, "step_4", "compute_time")
    # before TF-style device names the legend read "0 us - NaN us" and listed no device
    match = re.fullmatch(r"0 µs ([\d.]+) (µs|ms|s) Devices included in stats: CPU:0", compute)
    assert match and float(match.group(1)) > 0, compute
    memory = legend_for(page, run, "step_4", "memory")
    match = re.fullmatch(r"0 B ([\d.]+) (B|KB|MB) Devices included in stats: CPU:0", memory)
    assert match and float(match.group(1)) > 0, memory
    screenshot(page, os.path.join(tmp_dir, "graphs-memory.png"))
