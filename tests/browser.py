"""A real browser for the dashboard tests: headless Chromium (Debian's `chromium`), driven over the
DevTools protocol with the `websockets` client, so a page runs its own script in real time (polling,
timers) while the test reads its DOM. Also `python -m tests.browser URL OUT.png` for the docs' screenshot.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack

from websockets.sync.client import connect

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One Chromium process and one page; evaluate(js) returns the value, screenshot(path) a PNG."""

    def __init__(self, url: str, width: int = 1280, height: int = 900, timeout: float = 30.0):
        self.profile = tempfile.mkdtemp(prefix="edge-chromium-")
        self.proc = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout
        while not (os.path.exists(port_file) and open(port_file).read().count("\n") >= 1):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.05)
        port = int(open(port_file).read().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout))
        page = next(p for p in pages if p.get("type") == "page")
        self.stack = ExitStack()
        self.ws = self.stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=64 << 20,
                                                   open_timeout=timeout))
        self.ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        # navigate returns before the new document is there: wait until it is (its scripts have run)
        while self.evaluate("document.readyState === 'complete' && location.href") not in (url, url + "/"):
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not load {url}")
            time.sleep(0.05)

    def call(self, method: str, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, js: str):
        r = self.call("Runtime.evaluate", expression=js, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{js}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: str) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.stack.close()
        except Exception:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


if __name__ == "__main__":        # python -m tests.browser URL OUT.png [SECONDS]
    b = Browser(sys.argv[1])
    try:
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 10)
        b.screenshot(sys.argv[2])
    finally:
        b.close()
