"""Shared fixtures: a real server on a real loopback port over a real SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost_server.clock import ManualClock
from fencepost_server.harness import ServerThread

T0 = 1_700_000_000_000  # the ManualClock's start, ms since the epoch


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def server(tmp_path: Path, clock: ManualClock) -> Iterator[ServerThread]:
    """An in-process server (own loop thread) driven by a ManualClock."""
    with ServerThread(tmp_path / "fencepost.db", clock=clock) as srv:
        yield srv


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(params=["unary", "stream"])
def ledger(request: pytest.FixtureRequest, channel: grpc.Channel) -> Iterator[Any]:
    """The Ledger stub; with "stream", every command goes over Ledger.Execute
    instead (same messages, same errors), so behaviour tests cover both."""
    if request.param == "unary":
        yield ledger_pb2_grpc.LedgerStub(channel)
        return
    from _transport import StreamLedger  # tests/service

    stream = StreamLedger(channel)
    yield stream
    stream.close()


@pytest.fixture
def store(channel: grpc.Channel) -> run_store_pb2_grpc.RunStoreStub:
    return run_store_pb2_grpc.RunStoreStub(channel)
