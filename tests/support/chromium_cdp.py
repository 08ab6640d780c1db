"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

No ports and no extra packages: Chromium reads CDP commands from fd 3 and writes replies and
events to fd 4, each message one JSON object terminated by a NUL byte. ``Browser.open()`` creates
a page target and attaches to it (flat sessions); the page's JavaScript exceptions, console errors
and log-entry errors are collected in ``Page.errors``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    """Path of Debian's ``chromium`` (or another Chromium/Chrome on PATH), None when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def optional_browser():
    """A ``Browser`` context on the installed Chromium, or a context yielding None where there is none,
    unless CI requires one (``PDSERVE_REQUIRE_CHROMIUM=1``: then its absence fails the test)."""
    path = find_chromium()
    if path is None:
        assert os.environ.get("PDSERVE_REQUIRE_CHROMIUM") != "1", "chromium is not installed"
        return contextlib.nullcontext()
    return Browser(path)


class CDPError(RuntimeError):
    """A CDP command answered with an error, or the browser went away."""


class Browser:
    """One headless Chromium process; ``close()`` (or the context manager) ends it."""

    def __init__(self, executable: str, window: tuple[int, int] = (1440, 1000)) -> None:
        self.profile = tempfile.mkdtemp(prefix="pdserve-chromium-")
        cmd_r, cmd_w = os.pipe()  # we write commands; Chromium reads them as fd 3
        evt_r, evt_w = os.pipe()  # Chromium writes fd 4; we read
        self.log = tempfile.TemporaryFile()

        def remap() -> None:
            a, b = os.dup(cmd_r), os.dup(evt_w)  # dup first: cmd_r/evt_w may themselves be 3 or 4
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [
            executable,
            *FLAGS,
            f"--user-data-dir={self.profile}",
            f"--window-size={window[0]},{window[1]}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            pass_fds=(3, 4, cmd_r, evt_w),
            preexec_fn=remap,
        )
        os.close(cmd_r)
        os.close(evt_w)
        self._out = os.fdopen(cmd_w, "wb", buffering=0)
        self._in = os.fdopen(evt_r, "rb", buffering=0)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while chunk := self._in.read(65536):
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self._cv:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        """Send one command and wait for its result; ``CDPError`` on an error reply or timeout."""
        with self._cv:
            self._next_id += 1
            mid = self._next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._out.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cv:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise CDPError(f"{method}: no reply within {timeout}s (browser alive: {self.proc.poll() is None})")
                self._cv.wait(min(left, 0.5))
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def events(self, session: str) -> list[dict]:
        """Events received so far for ``session`` (a copy)."""
        with self._cv:
            return [e for e in self._events if e.get("sessionId") == session]

    def open(self, width: int = 1440, height: int = 1000) -> Page:
        """A new page (tab) with Runtime, Log and Page events enabled."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Runtime", "Log", "Page"):
            page.send(f"{domain}.enable")
        page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page

    def close(self) -> None:
        """End the browser and remove its profile."""
        try:
            self.send("Browser.close", timeout=5)
        except CDPError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    """One attached page: navigate, evaluate JavaScript, read errors, take screenshots."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def send(self, method: str, params: dict | None = None, timeout: float = 30) -> dict:
        """A CDP command on this page's session."""
        return self.browser.send(method, params, self.session, timeout)

    def navigate(self, url: str, timeout: float = 30) -> None:
        """Load ``url`` and wait until ``document.readyState`` is complete."""
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression (promises awaited); ``CDPError`` if it throws."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise CDPError(f"evaluate {expression[:80]!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30, poll_s: float = 0.2):
        """Poll until ``expression`` is truthy; returns its value, ``TimeoutError`` otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still falsy after {timeout}s")
            time.sleep(poll_s)

    def errors(self) -> list[str]:
        """JavaScript exceptions, console.error/assert calls and error log entries, as text."""
        out = []
        for e in self.browser.events(self.session):
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(
                    f"console.{p['type']}: "
                    + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", []))
                )
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log ({p['entry'].get('source')}): {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the whole page (the viewport grows to the content height) at ``path``."""
        height = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))
        width = int(self.evaluate("Math.ceil(document.documentElement.clientWidth)"))
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
