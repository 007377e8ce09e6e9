"""Headless Chromium for tests and scripts, driven through chromedriver's W3C WebDriver HTTP
API with httpx (Debian's `chromium` and `chromium-driver` packages; nothing downloaded)."""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
import time
from typing import Any

import httpx

from tests.server_utils import free_port

CHROMEDRIVER = "/usr/bin/chromedriver"
# Flags for a root user in a container, with nothing reaching out to the network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars"]


def missing() -> str | None:
    """Why the browser cannot run here (None: it can)."""
    if shutil.which("chromium") is None or shutil.which(CHROMEDRIVER) is None:
        return "no chromium/chromedriver: apt-get install chromium chromium-driver (scripts/test.sh does)"
    return None


class Chromium:
    """One headless browser window (a fresh profile) of the given size in CSS pixels."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        port = free_port()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.profile = tempfile.mkdtemp(prefix="minivllm-chromium-")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            self._wait_for_driver()
            options = {"binary": shutil.which("chromium"),
                       "args": [*CHROMIUM_ARGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}"]}
            session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": options}}})
            self.session = f"/session/{session['sessionId']}"
        except BaseException:
            self._stop_driver()
            raise

    def _wait_for_driver(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.http.get("/status").json()["value"]["ready"]:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.05)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(method, path, json=body)
        value = response.json()["value"]
        if response.status_code != 200:
            raise RuntimeError(f"WebDriver {method} {path}: {value.get('error')}: {value.get('message')}")
        return value

    def open(self, url: str) -> None:
        self._call("POST", f"{self.session}/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """The value of a function body run in the page (`arguments` holds args)."""
        return self._call("POST", f"{self.session}/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, timeout_s: float = 20) -> Any:
        """Poll `script` until it returns something truthy; returns that."""
        deadline = time.monotonic() + timeout_s
        while not (value := self.run(script)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied: {script}")
            time.sleep(0.1)
        return value

    def screenshot(self) -> bytes:
        """The window as PNG."""
        return base64.b64decode(self._call("GET", f"{self.session}/screenshot"))

    def close(self) -> None:
        try:
            self._call("DELETE", self.session)
        finally:
            self._stop_driver()

    def _stop_driver(self) -> None:
        self.http.close()
        self.driver.terminate()
        self.driver.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
