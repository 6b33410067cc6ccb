"""A free loopback port for a server a test, a benchmark or a local cluster
is about to start.

Not from the kernel's ephemeral range (``bind(0)`` hands those out): a port
there may meanwhile become the local end of any outgoing connection, and a
server started, or restarted, on it could then not bind its own address.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

HOST = "127.0.0.1"
LOWEST = 20_000

_handed_out: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's local port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = HOST) -> int:
    """A port free on ``host`` a moment ago, below the ephemeral range, never
    the same one twice in this process (a server restarted on its port finds
    it free again, and no two servers of one test run are handed one port)."""
    high = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(LOWEST, high) if high > LOWEST + 1 else 0
        with _lock:
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                port = int(s.getsockname()[1])
            _handed_out.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")
