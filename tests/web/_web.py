"""Helpers for the dashboard tests: a ``fencepost serve`` process with its
HTTP side port, and worker processes holding leases."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

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
