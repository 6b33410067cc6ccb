"""client.store and SyncClient.store reach the engine store on the client's
channel, over both transports: with "stream" the store's mutations share the
client's Execute dispatcher, with "unary" there is none."""

from __future__ import annotations

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
        assert client.store._dispatcher is client._dispatcher
        assert (client._dispatcher is None) == (transport == "unary")


def test_sync_client_store(server, transport: str) -> None:  # type: ignore[no-untyped-def]
    with fencepost.SyncClient(server.address, owner="w",
                              transport=transport) as client:  # type: ignore[arg-type]
        assert client.store.create_run("e2", agent="a", input=None).created
        got = client.store.get_run("e2")
        assert got is not None and got.input is None
        dispatcher = client._client._dispatcher
        assert client.store.async_store._dispatcher is dispatcher
        assert (dispatcher is None) == (transport == "unary")
