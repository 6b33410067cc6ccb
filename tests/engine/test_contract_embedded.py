"""The reusable EngineStore contract suite (``fencepost.store_contract``), run
against the embedded server: once with a test clock (the exact instant of
expiry is checked) and once in real time (as a deployment without a test clock
would run it). With the test clock it runs twice: with the unary RPCs and with
every mutation sent over Ledger.Execute instead, so the stream cannot
drift from the unary calls. (The transport does not touch the clock: real time
over the stream would only repeat the real-time run, and slowly.) All of it on
each storage backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from _db import Databases
from _stream_store import engine_client

from fencepost.store_contract import *  # noqa: F403
from fencepost_server.clock import SystemClock
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

MODES = [("test-clock", "unary"), ("test-clock", "stream"), ("real-time", "unary")]


@pytest.fixture(scope="module", params=MODES, ids=["-".join(m) for m in MODES])
def mode(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(clock, transport) of this run of the suite."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def embedded(mode: tuple[str, str], module_databases: Databases) -> Iterator[ServerThread]:
    clock = ManualClock() if mode[0] == "test-clock" else SystemClock()
    with module_databases.server("-".join(mode), clock=clock) as srv:
        yield srv


@pytest.fixture(scope="module")
def store_endpoint(embedded: ServerThread) -> str:
    return embedded.address


@pytest.fixture
def engine_store(mode: tuple[str, str], store_endpoint: str) -> Iterator[Any]:
    """Overrides the suite's stub: "stream" sends every mutation over
    Ledger.Execute (reads and PutArtifact stay unary)."""
    with grpc.insecure_channel(store_endpoint) as ch, engine_client(ch, mode[1]) as client:
        yield client


@pytest.fixture
def advance_clock(embedded: ServerThread) -> Callable[[int], object] | None:
    return embedded.clock.advance if isinstance(embedded.clock, ManualClock) else None


def test_the_suite_exports_every_test() -> None:
    """``from fencepost.store_contract import *`` must bring every test along."""
    import fencepost.store_contract as suite

    tests = {name for name in vars(suite) if name.startswith("test_")}
    assert tests and tests <= set(suite.__all__)
