"""client.store and SyncClient.store reach the engine store on the client's channel."""

from __future__ import annotations

import fencepost


async def test_async_client_store(server) -> None:  # type: ignore[no-untyped-def]
    async with fencepost.Client(server.address, owner="w") as client:
        created = await client.store.create_run("e1", agent="a", input={"n": 2**60})
        assert created.created
        got = await client.store.get_run("e1")
        assert got is not None and got.input == {"n": 2**60}
        assert client.store is client.store


def test_sync_client_store(server) -> None:  # type: ignore[no-untyped-def]
    with fencepost.SyncClient(server.address, owner="w") as client:
        assert client.store.create_run("e2", agent="a", input=None).created
        got = client.store.get_run("e2")
        assert got is not None and got.input is None
