"""lease.fenced() and lease.transaction(): engine-store writes that commit only
under the lease's fence, alone or all together; store.fenced(lock_key=...)
for keyed locks; the sync twins. Over the Execute stream and unary."""

from __future__ import annotations

import pytest

import fencepost
from fencepost import (
    LeaseLostError,
    LockLostError,
    LostReason,
    StoreTransaction,
    SyncClient,
    ValidationError,
)
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

BOTH_TRANSPORTS = True
TTL = 10_000


async def test_fenced_writes_commit_until_a_takeover(
    client: fencepost.Client, rival: fencepost.Client, clock: ManualClock
) -> None:
    lease = await client.acquire("run-1", ttl_ms=TTL)
    store = lease.fenced()
    assert await store.save_checkpoint("run-1", 1, {"step": 1})
    await store.put_effect("fx-1", {"ok": True})
    await store.kv_set("agent", "k", 1)
    assert (await client.store.latest_checkpoint("run-1")).step_index == 1  # type: ignore[union-attr]

    clock.advance(2 * TTL)
    taken = await rival.acquire("run-1", ttl_ms=TTL)
    with pytest.raises(LeaseLostError) as ei:
        await store.save_checkpoint("run-1", 2, {"step": 2, "stale": True})
    assert ei.value.record is not None and ei.value.record.fencing_token == taken.fencing_token
    assert lease.is_lost and lease.lost_reason is LostReason.TAKEN_OVER
    cp = await client.store.latest_checkpoint("run-1")
    assert cp is not None and cp.state == {"step": 1}  # the stale snapshot is not visible
    with pytest.raises(LeaseLostError):
        await store.put_artifact("a1", b"stale", run_id="run-1")
    assert await client.store.get_artifact("a1") is None
    # the new holder's view writes; an unfenced write still writes as before
    assert await taken.fenced().save_checkpoint("run-1", 2, {"step": 2})
    await client.store.kv_set("agent", "k", 2)
    await taken.release()


async def test_a_transaction_commits_everything_or_nothing(
    client: fencepost.Client, rival: fencepost.Client, clock: ManualClock
) -> None:
    lease = await client.acquire("run-2", ttl_ms=TTL)
    async with lease.transaction() as tx:
        assert isinstance(tx, StoreTransaction)
        assert await tx.save_checkpoint("run-2", 1, {"step": 1}) is None  # queued
        await tx.put_effect("fx-2", "charged")
        await tx.append_step("run-2", "charge", output={"id": 7})
        await tx.record_checkpoint("cp/run-2", 1)
        await tx.renew()
    saved, _, step, rec, renewed = tx.results
    assert saved is True and step.seq == 1 and step.output == {"id": 7}
    assert rec.checkpoint_ref.key == "cp/run-2" and renewed.version == rec.version + 1
    assert lease.record == renewed
    assert (await client.store.get_effect("fx-2")).value == "charged"

    clock.advance(2 * TTL)
    await rival.acquire("run-2", ttl_ms=TTL)
    with pytest.raises(LeaseLostError):
        async with lease.transaction() as tx:
            await tx.save_checkpoint("run-2", 2, {"step": 2})
            await tx.put_effect("fx-3", "charged twice")
    assert lease.is_lost
    assert (await client.store.latest_checkpoint("run-2")).state == {"step": 1}  # type: ignore[union-attr]
    assert not (await client.store.get_effect("fx-3")).found
    with pytest.raises(fencepost.UsageError, match="no results"):
        tx.results  # noqa: B018
    with pytest.raises(LeaseLostError):  # known lost: refused locally
        async with lease.transaction() as tx:
            await tx.kv_set("a", "k", 1)


async def test_a_failed_block_sends_nothing_and_a_refusal_rolls_back(
    client: fencepost.Client,
) -> None:
    lease = await client.acquire("run-3", ttl_ms=TTL)
    with pytest.raises(KeyError):
        async with lease.transaction() as tx:
            await tx.kv_set("a", "k", 1)
            raise KeyError("boom")
    assert not (await client.store.kv_get("a", "k")).found
    with pytest.raises(fencepost.RunNotFoundError) as ei:
        async with lease.transaction() as tx:
            await tx.kv_set("a", "k", 1)
            await tx.update_run("no-such-run", status="x")
    assert ei.value.metadata["command_index"] == "1"
    assert not (await client.store.kv_get("a", "k")).found
    assert lease.is_active  # a refusal that is not the fence's leaves the lease alone
    async with lease.transaction() as tx:
        pass
    assert tx.results == []
    await lease.release()


async def test_a_transaction_offers_writes_only(client: fencepost.Client) -> None:
    lease = await client.acquire("run-4", ttl_ms=TTL)
    async with lease.transaction() as tx:
        with pytest.raises(AttributeError, match="read before the block"):
            await tx.get_run("run-4")
        with pytest.raises(AttributeError):
            tx.put_artifact  # noqa: B018
        with pytest.raises(ValidationError):  # validated as the store validates
            await tx.kv_set("a", "k", float("nan"))
    with pytest.raises(fencepost.UsageError, match="committed"):
        await tx.kv_set("a", "k", 1)
    with pytest.raises(fencepost.UsageError, match="used once"):
        async with tx:
            pass
    store_tx = client.store.transaction()  # no fence: still all or nothing
    with pytest.raises(fencepost.UsageError, match="lease"):
        async with store_tx as t:
            await t.renew()
    await lease.release()


async def test_a_lock_fence(client: fencepost.Client, rival: fencepost.Client,
                            clock: ManualClock) -> None:
    grant = await client.store.acquire_lock("invoice-9", "worker-a", TTL)
    mine = client.store.fenced(lock_key="invoice-9", fencing_token=grant.fencing_token)
    await mine.doc_upsert("billing", "invoices", "9", {"state": "sent"})
    clock.advance(2 * TTL)
    theirs = await rival.store.acquire_lock("invoice-9", "worker-b", TTL)
    with pytest.raises(LockLostError) as ei:
        await mine.doc_upsert("billing", "invoices", "9", {"state": "stale"})
    err = ei.value
    assert (err.lock_key, err.fencing_token, err.owner) == (
        "invoice-9", theirs.fencing_token, "worker-b")
    with pytest.raises(LockLostError):
        async with mine.transaction() as tx:
            await tx.doc_delete("billing", "invoices", "9")
    docs = await client.store.doc_list("billing", "invoices")
    assert [d.doc for d in docs] == [{"state": "sent"}]
    with pytest.raises(ValidationError, match="exactly one"):
        client.store.fenced(fencing_token=1)


def test_the_sync_twins(server: ServerThread, clock: ManualClock, transport: str) -> None:
    with SyncClient(server.address, owner="worker-a",
                    transport=transport) as a, SyncClient(  # type: ignore[arg-type]
                        server.address, owner="worker-b",
                        transport=transport) as b:  # type: ignore[arg-type]
        lease = a.acquire("run-5", ttl_ms=TTL)
        assert lease.fenced().save_checkpoint("run-5", 1, "s1")
        with lease.transaction() as tx:
            tx.put_effect("fx", 1)
            tx.record_checkpoint("cp", 1)
        assert tx.results[1].checkpoint_ref.key == "cp"
        clock.advance(2 * TTL)
        b.acquire("run-5", ttl_ms=TTL)
        with pytest.raises(LeaseLostError):
            lease.fenced().save_checkpoint("run-5", 2, "stale")
        with pytest.raises(LeaseLostError), lease.transaction() as tx:
            tx.put_effect("fx", 2)
        assert a.store.latest_checkpoint("run-5").state == "s1"  # type: ignore[union-attr]
        assert a.store.get_effect("fx").value == 1
        assert lease.lost.is_set()
