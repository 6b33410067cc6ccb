"""Dashboard fixtures: a real ``fencepost serve`` process with its HTTP side
port, worker processes, and headless Chromium driven by Selenium (Debian's
chromium and chromium-driver; ``make test`` installs them when missing)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "system"))

from _proc import ServerProc, free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WORKER = Path(__file__).with_name("_worker.py")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1360,900", "--hide-scrollbars",
)


class WebServer(ServerProc):
    """``fencepost serve`` with the dashboard on its own free port."""

    def __init__(self, tmp: Path) -> None:
        self.http_port = free_port()
        super().__init__(tmp / "fp.db", tmp / "server.log",
                         args=("--http-listen", f"127.0.0.1:{self.http_port}"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return bytes(resp.read())


@pytest.fixture(scope="module")
def web_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebServer]:
    srv = WebServer(tmp_path_factory.mktemp("web"))
    srv.start()
    deadline = time.monotonic() + 10
    while True:  # the HTTP port opens right after gRPC's
        try:
            srv.get("/healthz")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield srv
    finally:
        srv.kill()


class Worker:
    """A real worker process holding one run's lease."""

    def __init__(self, addr: str, run_id: str, owner: str, ttl_ms: int = 30_000) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), addr, run_id, owner, str(ttl_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("headless Chromium is missing: `make test` installs Debian's chromium and "
                    "chromium-driver (apt-get install -y chromium chromium-driver)")
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="fencepost-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        subprocess.run(["rm", "-rf", profile], check=False)
