"""Small helpers shared by the benchmark programs (not a test utility).

Statistics (median, percentiles), loopback ports, and starting/stopping a
server process whose log goes to a file: every process started here is
stopped here, with SIGTERM first and SIGKILL after a bounded wait.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from fencepost_devtools.ports import free_port as free_port  # the benchmarks' servers' ports

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class ArgumentAdder(Protocol):
    """An argparse parser or argument group."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def machine() -> dict[str, Any]:
    mem_gib = 0.0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = int(line.split()[1]) / (1024 * 1024)
                    break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


@dataclass
class ServerProcess:
    """A server started as a child process, logging to a file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    address: str = ""

    def wait_ready(self, pattern: str, timeout: float = 30.0) -> str:
        """Wait until the log matches ``pattern`` (one group: the address)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            m = rx.search(self.log_path.read_text(errors="replace"))
            if m:
                self.address = m.group(1)
                return self.address
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful), then SIGKILL if it has not exited in time."""
        terminate(self.proc, signal.SIGTERM, timeout)
        self.log_file.close()
        return self.proc.returncode


def terminate(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> None:
    """Send ``sig`` to a running ``proc``; SIGKILL it if it has not exited
    within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_server(name: str, argv: Sequence[str], log_path: Path) -> ServerProcess:
    log_file = open(log_path, "wb")  # closed by ServerProcess.stop
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    return ServerProcess(name, proc, log_path, log_file)


def scrape_counters(port: int, names: Sequence[str], timeout: float = 5.0) -> dict[str, float]:
    """Read Prometheus counters from ``http://127.0.0.1:port/metrics``.

    Accepts both the bare name and the ``_total`` sample a counter exposes.
    """
    url = f"http://{HOST}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        sample = parts[0]
        for name in names:
            if sample in (name, f"{name}_total"):
                found[name] = float(parts[1])
    missing = [n for n in names if n not in found]
    if missing:
        raise RuntimeError(f"metrics at {url} lack {missing}")
    return found


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"
