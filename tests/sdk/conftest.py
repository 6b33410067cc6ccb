"""SDK fixtures: async clients on the shared ManualClock server (tests/conftest.py).

The clients send ledger mutations over the Execute stream by default. A test
module that sets ``BOTH_TRANSPORTS = True`` runs each of its tests that uses
the ``transport`` fixture (directly, or through ``client``/``rival``) twice:
over the stream and over unary calls, so one set of behaviour tests covers
both. Elsewhere ``transport`` is the default, "stream".
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import fencepost
from fencepost_server.testing.server import ServerThread

TRANSPORTS = ("stream", "unary")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "transport" in metafunc.fixturenames and getattr(metafunc.module, "BOTH_TRANSPORTS", False):
        metafunc.parametrize("transport", TRANSPORTS, indirect=True)


@pytest.fixture
def transport(request: pytest.FixtureRequest) -> str:
    """How the clients under test send ledger mutations: "stream" or "unary"."""
    return str(getattr(request, "param", "stream"))


@pytest.fixture
async def client(server: ServerThread, transport: str) -> AsyncIterator[fencepost.Client]:
    """The worker under test (owner "worker-a")."""
    async with fencepost.Client(server.address, owner="worker-a",
                                transport=transport) as c:  # type: ignore[arg-type]
        yield c


@pytest.fixture
async def rival(server: ServerThread, transport: str) -> AsyncIterator[fencepost.Client]:
    """Another worker process (owner "worker-b")."""
    async with fencepost.Client(server.address, owner="worker-b",
                                transport=transport) as c:  # type: ignore[arg-type]
        yield c
