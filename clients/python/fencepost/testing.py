"""pytest fixtures for testing code that uses fencepost, against a real
coordinator running in-process on a loopback port.

Import the fixtures into a ``conftest.py`` (this module is not registered as
a pytest plugin entry point)::

    from fencepost.testing import fencepost_client, fencepost_server  # noqa: F401

    def test_takeover(fencepost_client, fencepost_server):
        lease = fencepost_client.acquire("run-1", ttl_ms=60_000)
        fencepost_server.clock.advance(60_000)  # the server's time, not yours
        ...  # another owner may take the run over now

``fencepost_server`` is a ``fencepost_server.testing.server.ServerThread`` whose
clock is a ``ManualClock``: leases expire only when the test advances it.
Background renewal still runs in real time (every ttl/3), and a renewal
extends the lease from the server's clock, so give leases a ttl long enough
that no renewal falls due during the test when you advance past it.
Advancing past a lease's expiry makes the server push ``expiring``: the
lease turns ``at_risk`` (and ``guard()`` stops its block) until renewed.
It needs the ``fencepost_server`` package (installed with the server).

The server keeps its data in a fresh SQLite file in ``tmp_path``. To run it on
PostgreSQL instead, define a ``fencepost_db`` fixture that returns the
``postgresql://`` URL of an empty database (or any SQLite path); the test
clock is then exempt from the clock bound (``max_clock_skew``), since it is
nowhere near the database's clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ._sync import SyncClient

if TYPE_CHECKING:
    from fencepost_server.testing.server import ServerThread

__all__ = ["fencepost_client", "fencepost_server"]


@pytest.fixture
def fencepost_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerThread]:
    """A coordinator on 127.0.0.1 (random port) over a fresh SQLite file in
    ``tmp_path`` (or your ``fencepost_db``), driven by a ``ManualClock``.
    ``.address``, ``.clock``, ``.restart()``."""
    from fencepost_server.testing.clock import ManualClock
    from fencepost_server.testing.server import ServerThread

    try:
        db: str | Path = request.getfixturevalue("fencepost_db")
    except pytest.FixtureLookupError:
        db = tmp_path / "fencepost.db"
    with ServerThread(db, clock=ManualClock()) as server:
        yield server


@pytest.fixture
def fencepost_client(fencepost_server: ServerThread) -> Iterator[SyncClient]:
    """A ``SyncClient`` connected to ``fencepost_server`` (owner "test-worker")."""
    with SyncClient(fencepost_server.address, owner="test-worker") as client:
        yield client
