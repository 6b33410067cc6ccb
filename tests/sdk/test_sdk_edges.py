"""Rough edges of the SDK a newcomer meets first: which error a call that
never left raises, the default owner, leaving a guarded block while the
coordinator is unreachable, and JSON integers longer than Python converts."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from _proxy import Proxy

import fencepost
from fencepost.v1 import ledger_pb2_grpc
from fencepost_devtools.ports import free_port
from fencepost_server.storage.sqlite import Durability
from fencepost_server.testing.server import ServerThread

BOTH_TRANSPORTS = True

FAST = fencepost.RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.1, total_timeout_s=0.5,
                             attempt_timeout_s=2.0)


def _refusing_address() -> str:
    """An address where nothing listens: every connection is refused."""
    return f"127.0.0.1:{free_port()}"


async def test_a_call_that_never_left_is_unavailable_not_outcome_unknown(
    transport: str,
) -> None:
    address = _refusing_address()
    async with fencepost.Client(address, retry=FAST,
                                transport=transport) as client:  # type: ignore[arg-type]
        started = time.monotonic()
        for call in (client.acquire("run-1"), client.cancel("run-1"),
                     client.store.create_run("run-1", agent="a")):
            with pytest.raises(fencepost.UnavailableError) as info:
                await call
            assert type(info.value) is fencepost.UnavailableError, info.value
            assert info.value.grpc_code is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5  # bounded by the retry policy


class _Silent(ledger_pb2_grpc.LedgerServicer):
    """A Ledger that takes every Acquire and never answers it."""

    async def Acquire(self, request: Any, context: Any) -> Any:
        await asyncio.Event().wait()


@pytest.fixture
async def silent_server() -> AsyncIterator[str]:
    server = grpc.aio.server()
    ledger_pb2_grpc.add_LedgerServicer_to_server(_Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_a_call_that_was_sent_and_got_no_answer_is_outcome_unknown(
    silent_server: str, transport: str
) -> None:
    policy = fencepost.RetryPolicy.no_retry(attempt_timeout_s=0.5)
    async with fencepost.Client(silent_server, retry=policy,
                                transport=transport) as client:  # type: ignore[arg-type]
        with pytest.raises(fencepost.OutcomeUnknownError):
            await client.acquire("run-1")


class _SilentStream(_Silent):
    """A Ledger whose Execute stream takes every command and answers none."""

    async def DeleteRun(self, request: Any, context: Any) -> Any:  # the warm-up
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such run")

    async def Execute(self, request_iterator: Any, context: Any) -> Any:
        async for _ in request_iterator:
            pass
        await asyncio.Event().wait()


async def test_a_command_unanswered_on_the_stream_fails_at_its_attempt_deadline() -> None:
    """The attempt's deadline holds on the Execute stream as on a unary call:
    the command fails as an unknown outcome once it passes, and the stream
    carries on (the next command meets the same deadline on it)."""
    server = grpc.aio.server()
    ledger_pb2_grpc.add_LedgerServicer_to_server(_SilentStream(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    policy = fencepost.RetryPolicy.no_retry(attempt_timeout_s=0.3)
    try:
        async with fencepost.Client(f"127.0.0.1:{port}", retry=policy,
                                    transport="stream") as client:
            with pytest.raises(fencepost.FencepostError, match="no such run"):
                await client.delete("warm-up")  # unary: the stream opens meanwhile
            dispatcher = client._connection.dispatcher
            assert dispatcher is not None
            deadline = time.monotonic() + 5
            while not dispatcher.is_open:
                assert time.monotonic() < deadline, "the Execute stream did not open"
                await asyncio.sleep(0.005)
            for run_id in ("run-1", "run-2"):
                started = time.monotonic()
                with pytest.raises(fencepost.OutcomeUnknownError):
                    await client.acquire(run_id)
                took = time.monotonic() - started
                assert 0.25 < took < 2.0, f"{run_id} failed after {took:.2f} s"
                assert dispatcher.is_open and dispatcher.streams_opened == 1
            assert dispatcher.commands_sent == 0  # counted when a stream ends
    finally:
        await server.stop(None)


def test_the_default_owner_names_this_host_this_process_and_a_random_part() -> None:
    prefix = f"{socket.gethostname()}-{os.getpid()}-"
    owners = {fencepost.Client().owner for _ in range(20)}
    assert len(owners) == 20 and all(o.startswith(prefix) for o in owners)
    sync = fencepost.SyncClient()
    try:
        assert sync.owner.startswith(prefix) and sync.owner not in owners
    finally:
        sync.close()


async def test_leaving_a_guarded_block_during_an_outage_is_bounded_and_explained(
    make_server: Any, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fencepost")
    with make_server(durability=Durability.NORMAL) as server, \
            Proxy(server.address) as proxy:
        async with fencepost.Client(proxy.address, owner="w-outage",
                                    transport=transport) as client:  # type: ignore[arg-type]
            with pytest.raises(fencepost.LeaseAtRiskError):
                async with client.acquire("run-x", ttl_ms=1000) as lease, lease.guard():
                    proxy.cut()
                    await asyncio.sleep(30)  # cancelled once the lease is at risk
            left = time.monotonic()
            at_risk_for = left - lease.safe_until
            assert at_risk_for < 2.5, f"leaving the block took {at_risk_for:.1f} s"
    [warning] = [r for r in caplog.records if "could not release" in r.getMessage()]
    text = warning.getMessage()
    assert "'run-x'" in text and "UNAVAILABLE" in text and "w-outage" in text
    assert "until it expires" in text


@pytest.mark.parametrize("digits", [4301, 5000, 20_000])
async def test_json_integers_of_any_length_round_trip_exactly(
    server: ServerThread, digits: int
) -> None:
    n = (10**digits - 1) // 9 * 7  # 77...7: int("7" * digits) is itself refused
    value = {"n": n, "neg": -n, "list": [n, 1, 2.5], "nested": {"k": [n]}}
    async with fencepost.Client(server.address, owner="w") as client:
        store = client.store
        await store.create_run("big", agent="a", input=value)
        assert (await store.get_run("big")).input == value  # type: ignore[union-attr]
        await store.kv_set("a", "k", value)
        assert (await store.kv_get("a", "k")).value == value
        await store.doc_upsert("a", "c", "d1", value)
        docs = await store.doc_list("a", "c", where={"n": n})
        assert [d.doc for d in docs] == [value]
        await store.put_effect("e", n)
        assert (await store.get_effect("e")).value == n


async def test_an_artifact_upload_that_never_left_is_unavailable() -> None:
    async with fencepost.AsyncStore.connect(_refusing_address(), retry=FAST) as store:
        with pytest.raises(fencepost.UnavailableError) as info:
            await store.put_artifact("a-1", b"bytes", run_id="r")
        assert type(info.value) is fencepost.UnavailableError
