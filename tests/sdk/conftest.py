"""SDK fixtures: async clients on the shared ManualClock server (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import fencepost
from fencepost_server.harness import ServerThread


@pytest.fixture
async def client(server: ServerThread) -> AsyncIterator[fencepost.Client]:
    """The worker under test (owner "worker-a")."""
    async with fencepost.Client(server.address, owner="worker-a") as c:
        yield c


@pytest.fixture
async def rival(server: ServerThread) -> AsyncIterator[fencepost.Client]:
    """Another worker process (owner "worker-b")."""
    async with fencepost.Client(server.address, owner="worker-b") as c:
        yield c
