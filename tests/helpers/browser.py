"""What the browser tests share: headless Chromium launched the one way CI can run it, a coordinator
app served on 127.0.0.1, and a page that records console errors and requests that leave the host.

The ``browser`` fixture (tests/conftest.py) launches Chromium once per test module, not once per
session: while a sync Playwright is alive it marks its event loop as the main thread's running loop
between calls (playwright/_impl/_greenlets.py, ``wait_for_future``), so every later test in the
session would find a running loop and ``asyncio.run()`` would refuse to start there.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright's own browser download is not used
# No setuid sandbox in containers, no GPU on CI machines, and no request of Chromium's own (updates,
# safe browsing) that would leave the host and be counted as a page's foreign request.
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-background-networking")
TIMEOUT_MS = 60_000  # generous: the machine is shared; load times are reported, not asserted


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (a Playwright ``Browser``); skips the test where it is not installed."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_ARGS))
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def serve(app: Any, *, start_timeout_s: float = 60.0) -> Iterator[str]:
    """Serves ``app`` with uvicorn in a thread on a free 127.0.0.1 port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no other process can take the port meanwhile
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    # uvicorn offers a flag, no event, for "started"; a thread that died (failed startup) ends the wait
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup"
        assert time.monotonic() < deadline, f"uvicorn did not start within {start_timeout_s} s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class Watched:
    """A page with its console errors, uncaught exceptions and off-host requests recorded."""

    def __init__(self, page: Any, base: str) -> None:
        self.page, self.base = page, base
        self.errors: list[str] = []
        self.foreign: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("request", lambda r: None if r.url.startswith((base, "data:")) else self.foreign.append(r.url))

    def goto(self, path: str) -> Any:
        resp = self.page.goto(self.base + path, wait_until="load")
        assert resp is not None and resp.status == 200, f"{path}: HTTP {resp and resp.status}"
        return resp

    def clean(self) -> None:
        assert self.errors == [], f"console errors: {self.errors}"
        assert self.foreign == [], f"requests that left the coordinator: {self.foreign}"


@contextmanager
def watched_page(browser: Any, base: str, *, width: int = 1280, height: int = 720) -> Iterator[Watched]:
    """A page in a context of its own (no cookies or storage shared with other tests), closed after."""
    ctx = browser.new_context(viewport={"width": width, "height": height})
    ctx.set_default_timeout(TIMEOUT_MS)
    try:
        yield Watched(ctx.new_page(), base)
    finally:
        ctx.close()
