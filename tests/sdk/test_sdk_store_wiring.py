"""client.store and SyncClient.store reach the engine store on the client's
channel, over both transports: with "stream" the store's mutations share the
client's Execute stream, with "unary" there is none."""

from __future__ import annotations

import asyncio
import time

import fencepost

BOTH_TRANSPORTS = True  # tests using `transport` run over the Execute stream and unary


async def test_async_client_store(server, transport: str) -> None:  # type: ignore[no-untyped-def]
    async with fencepost.Client(server.address, owner="w",
                                transport=transport) as client:  # type: ignore[arg-type]
        created = await client.store.create_run("e1", agent="a", input={"n": 2**60})
        assert created.created
        got = await client.store.get_run("e1")
        assert got is not None and got.input == {"n": 2**60}
        assert client.store is client.store
        if transport == "unary":
            assert client.statistics().execute_streams_opened == 0
            return
        deadline = time.monotonic() + 5
        while not client.statistics().execute_stream_open:
            assert time.monotonic() < deadline, "the Execute stream did not open"
            await asyncio.sleep(0.005)
        before = client.statistics().execute_commands_sent
        await client.store.kv_set("a", "k", 1)  # on the client's own stream
        assert client.statistics().execute_commands_sent == before + 1


def test_sync_client_store(server, transport: str) -> None:  # type: ignore[no-untyped-def]
    with fencepost.SyncClient(server.address, owner="w",
                              transport=transport) as client:  # type: ignore[arg-type]
        assert client.store.create_run("e2", agent="a", input=None).created
        got = client.store.get_run("e2")
        assert got is not None and got.input is None
        if transport == "unary":
            assert client.statistics().execute_streams_opened == 0
            return
        deadline = time.monotonic() + 5
        while not client.statistics().execute_stream_open:
            assert time.monotonic() < deadline, "the Execute stream did not open"
            time.sleep(0.005)
        before = client.statistics().execute_commands_sent
        client.store.kv_set("a", "k", 1)
        assert client.statistics().execute_commands_sent == before + 1
