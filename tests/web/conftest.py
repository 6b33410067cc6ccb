"""Dashboard fixtures: a real ``fencepost serve`` process with its HTTP side
port, worker processes, and headless Chromium driven by Selenium (Debian's
chromium and chromium-driver; ``make test`` installs them when missing)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _web import CHROMEDRIVER, CHROMIUM, CHROMIUM_FLAGS, WebServer, Worker


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
