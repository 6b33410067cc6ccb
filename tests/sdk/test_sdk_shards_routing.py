"""The SDK sends each call to its shard's coordinator: two real servers (each
told by the test-only shard map which of the 4 shards it leads) and a client
given only one of them. It keeps sending everything there until the first
NOT_OWNER, then fetches the map and routes every call, renewal and store
write or read to the owner of its shard."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import fencepost
from fencepost._errors import from_rpc_error
from fencepost._placement import shard_keys
from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2, ledger_pb2_grpc, record_pb2
from fencepost_devtools.ports import free_port
from fencepost_server.core import placement
from fencepost_server.core.shards import compound_key, shard_of
from fencepost_server.rpc.commands import KINDS
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

pytestmark = [pytest.mark.sqlite_only, pytest.mark.timeout(60)]

SHARDS = 4
A_LEADS, B_LEADS = {0, 1}, {2, 3}


def _key_in(shards: set[int], prefix: str = "r") -> str:
    """A run id (or key) whose shard is one of ``shards``."""
    return next(f"{prefix}-{i}" for i in range(1000) if shard_of(f"{prefix}-{i}", SHARDS) in shards)


def _pair(tmp_path: Path, spec_a: str, spec_b: str, a: str, b: str
          ) -> tuple[ServerThread, ServerThread]:
    return (ServerThread(str(tmp_path / "a.db"), listen=a, shards=SHARDS, test_hooks=True,
                         test_shard_map=spec_a),
            ServerThread(str(tmp_path / "b.db"), listen=b, shards=SHARDS, test_hooks=True,
                         test_shard_map=spec_b))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ServerThread, ServerThread]]:
    """A leads shards 0-1, B leads 2-3; both know the whole map."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    spec = f"{a}=0-1;{b}=2,3"
    sa, sb = _pair(tmp_path, spec, spec, a, b)
    with sa, sb:
        yield sa, sb


def test_a_refusal_maps_to_not_owner_error_naming_the_owner(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    sa, sb = pair
    run = _key_in(A_LEADS)
    stub = ledger_pb2_grpc.LedgerStub(grpc.insecure_channel(sb.address))
    with pytest.raises(grpc.RpcError) as refused:
        stub.GetRun(ledger_pb2.GetRunRequest(run_id=run))
    err = from_rpc_error(refused.value, mutation=False)
    assert type(err) is fencepost.NotOwnerError
    assert isinstance(err, fencepost.UnavailableError)
    assert (err.shard, err.owner, err.epoch) == (shard_of(run, SHARDS), sa.address, 1)
    assert err.code == "NOT_OWNER"


class UnaryCalls(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Records the method of every unary call a client makes."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        self.methods.append(method.decode() if isinstance(method, bytes) else str(method))
        return await continuation(details, request)

    def count(self, name: str) -> int:
        return sum(m.endswith(f"/{name}") for m in self.methods)


def _run_at(srv: ServerThread, run_id: str) -> ledger_pb2.GetRunResponse | None:
    """The run as ``srv`` has it (None: not there), asked directly."""
    stub = ledger_pb2_grpc.LedgerStub(grpc.insecure_channel(srv.address))
    try:
        return stub.GetRun(ledger_pb2.GetRunRequest(run_id=run_id))
    except grpc.RpcError as err:
        if err.code() is grpc.StatusCode.NOT_FOUND:
            return None
        raise


def _runs_in_every_shard(prefix: str) -> dict[int, str]:
    return {shard: _key_in({shard}, prefix) for shard in range(SHARDS)}


def _owner(pair: tuple[ServerThread, ServerThread], shard: int) -> ServerThread:
    return pair[0] if shard in A_LEADS else pair[1]


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_calls_land_on_their_shards_owner(
    pair: tuple[ServerThread, ServerThread], transport: str
) -> None:
    """Given only B, the client acquires, renews, checkpoints and finishes a
    run in every shard; each is done at its shard's owner, and the other
    server never has it."""
    runs = _runs_in_every_shard(f"calls-{transport}")
    async with fencepost.Client(pair[1].address, owner="w", renewal="off",
                                transport=transport) as client:  # type: ignore[arg-type]
        for run in runs.values():
            lease = await client.acquire(run, ttl_ms=30_000)
            await lease.renew()
            await lease.record_checkpoint("cp", 1)
            assert (await client.validate_fence(run, lease.fencing_token)).current
            ref = (await client.get(run)).checkpoint_ref
            assert ref is not None and ref.key == "cp"
            await lease.finish()
            assert (await client.get(run)).status is fencepost.RunStatus.COMPLETED
        if transport == "stream":  # one Execute stream per coordinator, carrying most
            stats = client.statistics()
            assert stats.execute_streams_opened == 2
            assert stats.execute_commands_sent >= 3 * len(runs)
    for shard, run in runs.items():
        owner = _owner(pair, shard)
        other = pair[1] if owner is pair[0] else pair[0]
        got = _run_at(owner, run)
        assert got is not None and got.run.status == record_pb2.RUN_STATUS_COMPLETED
        assert got.run.checkpoint_ref.key == "cp"
        with pytest.raises(grpc.RpcError) as refused:
            _run_at(other, run)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE  # NOT_OWNER: not there


async def test_a_client_of_one_coordinator_never_asks_for_the_map(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    calls = UnaryCalls()
    async with fencepost.Client(pair[1].address, owner="w", renewal="off",
                                interceptors=[calls]) as client:
        for i in range(3):
            lease = await client.acquire(_key_in(B_LEADS, f"own-{i}"), ttl_ms=30_000)
            await lease.finish()
        assert calls.count("Shards") == 0
        # the first call keyed in A's shards switches routing on: one map
        lease = await client.acquire(_key_in(A_LEADS, "other"), ttl_ms=30_000)
        await lease.finish()
        assert calls.count("Shards") == 1


@pytest.fixture
def crossed(tmp_path: Path) -> Iterator[tuple[ServerThread, ServerThread]]:
    """An inconsistent map: A says B leads shard 0, B says A does."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sa, sb = _pair(tmp_path, f"{b}=0;{a}=1-3", f"{a}=0;{b}=1-3", a, b)
    with sa, sb:
        yield sa, sb


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_owners_naming_each_other_end_in_not_owner_error(
    crossed: tuple[ServerThread, ServerThread], transport: str
) -> None:
    sa, sb = crossed
    run = _key_in({0})
    calls = UnaryCalls()
    async with fencepost.Client(sb.address, owner="w", renewal="off", transport=transport,
                                interceptors=[calls]) as client:  # type: ignore[arg-type]
        with pytest.raises(fencepost.NotOwnerError) as refused:
            await asyncio.wait_for(client.acquire(run, ttl_ms=30_000), 5)
        assert refused.value.shard == 0
        assert refused.value.owner in {sa.address, sb.address}
        assert sa.address in str(refused.value) and sb.address in str(refused.value)
        started = time.monotonic()
        with pytest.raises(fencepost.NotOwnerError):
            await client.get(run)
        # tried again while a move could be under way, not the retry policy's 10 s
        assert calls.count("GetRun") >= 4
        assert time.monotonic() - started < 8
    assert sa.writer.state.revision == 0 and sb.writer.state.revision == 0  # nothing done


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_owners_naming_each_other_are_followed_until_one_leads(
    crossed: tuple[ServerThread, ServerThread], transport: str
) -> None:
    """Mid-move, the coordinator giving a shard up names the other, which names
    it back until it is told: the call goes on following the named owner, a
    moment apart each time, and lands where the shard ends up led."""
    sa, sb = crossed
    run = _key_in({0})

    async def told() -> None:  # A learns it leads shard 0 (B still names A)
        await asyncio.sleep(0.3)
        sa.writer.lead_only(placement.Ownership(SHARDS, range(SHARDS),
                                      dict.fromkeys(range(SHARDS), (sa.address, 2))))

    async with fencepost.Client(sa.address, owner="w", renewal="off",
                                transport=transport) as client:
        telling = asyncio.create_task(told())
        lease = await asyncio.wait_for(client.acquire(run, ttl_ms=30_000), 5)
        await telling
        assert lease.fencing_token == 1
    assert sa.writer.state.runs[run].lease is not None and run not in sb.writer.state.runs


async def test_a_watch_finds_a_shard_whose_owner_the_map_did_not_know(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    """A shard in transit when the watch asked the map (no owner named) is
    asked of a fresh map until its owner is known, then watched there."""
    sa, sb = pair
    both = {s: (sa.address if s in A_LEADS else sb.address, 1) for s in range(SHARDS)}
    unknown = {**both, 0: ("", 1)}  # both name no owner for shard 0
    sa.writer.lead_only(placement.Ownership(SHARDS, A_LEADS - {0}, unknown))
    sb.writer.lead_only(placement.Ownership(SHARDS, B_LEADS, unknown))
    run = _key_in({0}, "transit")
    async with fencepost.Client(sb.address, owner="w", renewal="off") as client:
        cursor = fencepost.WatchCursor()

        async def first() -> fencepost.WatchEvent:
            async for ev in client.watch(cursor=cursor):
                return ev
            raise AssertionError("the watch ended")

        watching = asyncio.create_task(first())
        for _ in range(200):  # until every shard but 0 is watched
            if len(cursor.revisions) == SHARDS - 1:
                break
            await asyncio.sleep(0.02)
        assert 0 not in cursor.revisions
        sa.writer.lead_only(placement.Ownership(SHARDS, A_LEADS, both))  # taken: led at A
        sb.writer.lead_only(placement.Ownership(SHARDS, B_LEADS, both))
        for _ in range(200):
            if 0 in cursor.revisions:
                break
            await asyncio.sleep(0.02)
        async with fencepost.Client(sa.address, owner="w", renewal="off") as writer:
            lease = await writer.acquire(run, ttl_ms=30_000)  # (not routed by the watch's client)
        ev = await asyncio.wait_for(watching, 5)
        assert (ev.run_id, ev.shard, ev.record and ev.record.fencing_token) == (
            run, 0, lease.fencing_token)


def _samples() -> dict[str, Any]:
    """A valid request of each command kind, fenced where it may be."""
    fence = epb.Fence(run_id="fr", fencing_token=1)
    lock_fence = epb.Fence(lock_key="l", fencing_token=1)
    one = epb.JsonValue(json="1")
    held = {"run_id": "r1", "owner": "o", "fencing_token": 1}
    samples: dict[str, Any] = {
        "acquire": ledger_pb2.AcquireRequest(run_id="r1", owner="o", lease_ttl_ms=30000),
        "renew": ledger_pb2.RenewRequest(**held, lease_ttl_ms=30000),
        "record_checkpoint": ledger_pb2.RecordCheckpointRequest(**held, key="k",
                                                                snapshot_version=1),
        "suspend": ledger_pb2.SuspendRequest(**held),
        "finish": ledger_pb2.FinishRequest(**held, status=record_pb2.RUN_STATUS_COMPLETED),
        "release": ledger_pb2.ReleaseRequest(**held),
        "cancel": ledger_pb2.CancelRequest(run_id="r1"),
        "request_resume": ledger_pb2.RequestResumeRequest(run_id="r1"),
        "delete_run": ledger_pb2.DeleteRunRequest(run_id="r1"),
        "create_run": epb.EngineCreateRunRequest(
            run=epb.EngineRun(id="r1", agent="a", status="queued"), fence=fence),
        "update_run": epb.EngineUpdateRunRequest(id="r1", fence=fence),
        "claim_run": epb.EngineClaimRunRequest(id="r1", owner="o", ttl_ms=1000),
        "renew_claim": epb.EngineRenewClaimRequest(id="r1", owner="o", ttl_ms=1000, fence=fence),
        "append_step": epb.EngineAppendStepRequest(step=epb.EngineStep(run_id="r1", name="s"),
                                                   fence=fence),
        "save_checkpoint": epb.EngineSaveCheckpointRequest(
            checkpoint=epb.EngineCheckpoint(run_id="r1", step_index=1, state=one)),
        "claim_key": epb.EngineClaimKeyRequest(scope="s", key="k", run_id="r1", ttl_ms=1000),
        "acquire_lock": epb.EngineAcquireLockRequest(key="k", owner="o", ttl_ms=1000,
                                                     fence=lock_fence),
        "release_lock": epb.EngineReleaseLockRequest(key="k", owner="o"),
        "put_effect": epb.EnginePutEffectRequest(key="k", result=one),
        "kv_set": epb.EngineKvSetRequest(agent="a", key="k", value=one, fence=fence),
        "doc_upsert": epb.EngineDocUpsertRequest(agent="a", collection="c", id="d",
                                                 doc=epb.JsonValue(json="{}")),
        "doc_delete": epb.EngineDocDeleteRequest(agent="a", collection="c", id="d"),
    }
    samples["transaction"] = ledger_pb2.TransactionRequest(
        fence=lock_fence, commands=[
            ledger_pb2.Command(id=1, kv_set=epb.EngineKvSetRequest(agent="a", key="k", value=one)),
            ledger_pb2.Command(id=2, append_step=epb.EngineAppendStepRequest(
                step=epb.EngineStep(run_id="r2", name="s"), fence=fence)),
        ])
    return samples


def test_the_client_places_every_command_as_the_server_does() -> None:
    samples = _samples()
    assert set(samples) == {k for k in KINDS if not k.startswith("raw_")}
    for kind, request in samples.items():
        assert shard_keys(request) == placement.shard_keys(KINDS[kind].to_command(request)), kind
    assert shard_keys(ledger_pb2.ListRunsRequest()) is None
    assert shard_keys(epb.EngineDeleteArtifactRequest(id="x")) is None


async def _renewed_past(lease: fencepost.Lease, until: float, limit_s: float = 10) -> None:
    """Wait until an answered renewal puts ``lease``'s safe-until past ``until``."""
    async with asyncio.timeout(limit_s):
        while lease.safe_until <= until:
            assert not lease.is_lost and lease.is_active
            await asyncio.sleep(0.02)


async def test_leases_are_renewed_on_their_owners_keepalive_stream(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    """Given only B, a lease in each shard is kept alive over KeepAlive: those
    in A's shards on a stream to A, the others on B's; each outlives its ttl
    several times over and then finishes at its owner."""
    ttl = 900
    runs = _runs_in_every_shard("kept")
    async with fencepost.Client(pair[1].address, owner="w") as client:
        leases = {shard: await client.acquire(run, ttl_ms=ttl) for shard, run in runs.items()}
        for lease in leases.values():
            await _renewed_past(lease, lease.safe_until + 2 * ttl / 1000)
        stats = client.statistics()
        assert stats.keepalive_streams_opened == 2 and stats.leases_kept == len(runs)
        assert not any(lease.at_risk for lease in leases.values())
        for lease in leases.values():
            await lease.finish()
    for shard, run in runs.items():
        got = _run_at(_owner(pair, shard), run)
        assert got is not None and got.run.status == record_pb2.RUN_STATUS_COMPLETED


async def test_a_renewal_refused_not_owner_moves_the_lease_to_the_owner(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    """A lease whose renewals go to a coordinator that does not lead its
    shard (the client's map was stale: the shard moved) is refused there
    NOT_OWNER, and is renewed at the owner named from then on: not lost."""
    sa, sb = pair
    ttl = 900
    run = _key_in(A_LEADS, "moved")
    async with fencepost.Client(sb.address, owner="w") as client:
        lease = await client.acquire(run, ttl_ms=ttl)  # routed: renewed on A's stream
        router = client._connection.router
        assert router is not None
        shard = shard_of(run, SHARDS)
        router.owners[shard] = sb.address  # the stale map: B led the shard once
        kept = fencepost._client.hooks_of(lease)
        await client._renewer.stop(kept)
        client._renewer.start(kept)  # onto B's stream, where it is refused
        before = client.statistics().keepalive_messages_sent
        await _renewed_past(lease, lease.safe_until + 2 * ttl / 1000)
        assert client.statistics().keepalive_messages_sent > before
        assert router.owners[shard] == sa.address  # learnt from the refusal
        assert not lease.is_lost
        await lease.finish()
    got = _run_at(sa, run)
    assert got is not None and got.run.status == record_pb2.RUN_STATUS_COMPLETED


def _agent_in(shards: set[int], key: str) -> str:
    """An agent whose (agent, key) state entry is in one of ``shards``."""
    return next(f"ag{i}" for i in range(1000)
                if shard_of(compound_key(f"ag{i}", key), SHARDS) in shards)


async def _use_the_store(store: fencepost.AsyncStore, tag: str) -> dict[int, str]:
    """Writes and keyed reads in every shard; the run id used per shard."""
    runs = _runs_in_every_shard(f"eng-{tag}")
    for shard, run in runs.items():
        assert (await store.create_run(run, agent="a", input={"n": shard})).created
        await store.append_step(run, "s1", output={"ok": True})
        assert await store.save_checkpoint(run, 1, {"at": 1})
        assert (await store.get_run(run)) is not None
        assert [s.name for s in await store.list_steps(run)] == ["s1"]
        cp = await store.latest_checkpoint(run)
        assert cp is not None and cp.state == {"at": 1}
        agent = _agent_in({shard}, "k")
        await store.kv_set(agent, "k", shard)
        got = await store.kv_get(agent, "k")
        assert got.found and got.value == shard
        async with store.transaction() as tx:
            await tx.kv_set(agent, "k", shard + 10)
            await tx.append_step(run, "s2")
        assert (await store.kv_get(agent, "k")).value == shard + 10
    return runs


def _engine_run_at(srv: ServerThread, run_id: str) -> bool:
    stub = engine_store_pb2_grpc.EngineStoreStub(grpc.insecure_channel(srv.address))
    return bool(stub.GetRun(epb.EngineGetRunRequest(id=run_id)).found)


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_the_engine_store_writes_and_reads_at_each_owner(
    pair: tuple[ServerThread, ServerThread], transport: str
) -> None:
    async with fencepost.Client(pair[1].address,
                                transport=transport) as client:  # type: ignore[arg-type]
        runs = await _use_the_store(client.store, transport)
    async with fencepost.AsyncStore.connect(pair[1].address) as store:
        runs_of_own = await _use_the_store(store, f"own-{transport}")
    for shard, run in (*runs.items(), *runs_of_own.items()):
        assert _engine_run_at(_owner(pair, shard), run)


def test_a_sync_client_routes_too(pair: tuple[ServerThread, ServerThread]) -> None:
    runs = _runs_in_every_shard("sync")
    ttl = 900
    with fencepost.SyncClient(pair[1].address, owner="w") as client:
        leases = [client.acquire(run, ttl_ms=ttl) for run in runs.values()]
        for lease in leases:
            lease.record_checkpoint("cp", 1)
        deadline = time.monotonic() + 10
        first = [lease.safe_until for lease in leases]
        while any(lease.safe_until <= was + 2 * ttl / 1000
                  for lease, was in zip(leases, first, strict=True)):
            assert time.monotonic() < deadline and not any(lease.is_lost for lease in leases)
            time.sleep(0.02)
        for lease in leases:
            lease.finish()
        agent = _agent_in(A_LEADS, "k")
        client.store.kv_set(agent, "k", 1)
        assert client.store.kv_get(agent, "k").value == 1
    for shard, run in runs.items():
        got = _run_at(_owner(pair, shard), run)
        assert got is not None and got.run.status == record_pb2.RUN_STATUS_COMPLETED


async def test_the_map_gathers_each_shards_counts_from_its_owner(tmp_path: Path) -> None:
    """Asked of B alone, the map names every shard's owner and has the runs
    and live leases of A's shards too, which only A can count."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    spec = f"{a}=0-1;{b}=2,3"
    servers = [ServerThread(str(tmp_path / f"{name}.db"), listen=addr, shards=SHARDS,
                            test_hooks=True, test_shard_map=spec, clock=ManualClock())
               for name, addr in (("a", a), ("b", b))]
    runs = _runs_in_every_shard("map")
    with servers[0], servers[1]:
        async with fencepost.Client(b, owner="w", renewal="off") as client:
            for run in runs.values():
                await client.acquire(run, ttl_ms=60_000)
            for srv in servers:  # past the second in which a count is answered again
                srv.clock.advance(1_500)
            got = await client.shards()
        assert got.shard_count == SHARDS
        for shard in range(SHARDS):
            info, owner = got.shards[shard], servers[0 if shard in A_LEADS else 1]
            assert owner.app is not None
            assert (info.owner, info.address) == (owner.app.identity, owner.address)
            assert (info.runs, info.leases) == (1, 1), shard


async def test_a_coordinator_that_goes_away_is_followed_by_its_shards(tmp_path: Path) -> None:
    """A stops; its database is served at another address and B's map says
    so. The client, given only B, renews its lease in A's shard at the new
    address by itself (never lost), and a call that got no answer from A
    goes there too."""
    a, a2, b = (f"127.0.0.1:{free_port()}" for _ in range(3))
    before, after = f"{a}=0-1;{b}=2,3", f"{a2}=0-1;{b}=2,3"

    def serve(name: str, addr: str, spec: str) -> ServerThread:
        return ServerThread(str(tmp_path / f"{name}.db"), listen=addr, shards=SHARDS,
                            test_hooks=True, test_shard_map=spec)

    leased, read = _key_in({0}, "gone"), _key_in({1}, "gone-read")
    first = [serve("a", a, before), serve("b", b, before)]
    running = list(first)
    for srv in first:
        srv.start()
    try:
        async with fencepost.Client(b, owner="w") as client:
            lease = await client.acquire(leased, ttl_ms=9_000)
            await (await client.acquire(read)).finish()
            for srv in first:
                running.remove(srv)
                srv.close()
            later = [serve("a", a2, after), serve("b", b, after)]
            running += later
            for srv in later:
                srv.start()
            moved = time.monotonic()
            await _renewed_past(lease, moved + 9.0 * 0.5, limit_s=20)
            assert lease.is_active and not lease.is_lost
            got = await client.get(read)
            assert got.status is fencepost.RunStatus.COMPLETED
            await lease.finish()
        with grpc.insecure_channel(a2) as ch:  # it was renewed and finished at A's new address
            run = ledger_pb2_grpc.LedgerStub(ch).GetRun(ledger_pb2.GetRunRequest(run_id=leased))
            assert run.run.status == record_pb2.RUN_STATUS_COMPLETED
    finally:
        for srv in running:
            srv.close()


async def test_listings_gather_every_owners_runs_in_run_id_order(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    """Given only B, which lists only its own shards' runs: a listing asks
    each owner and merges, in run id order and with the filters, for a
    client that has routed already and for one that never has."""
    runs = sorted({_key_in({s}, f"ls{i}") for s in range(SHARDS) for i in range(3)})
    async with fencepost.Client(pair[1].address, owner="w", renewal="off") as writer:
        for i, run in enumerate(runs):
            lease = await writer.acquire(run, ttl_ms=60_000)
            if i % 2:
                await lease.finish()
        listed = [r.run_id async for r in writer.list(page_size=2)]
        assert listed == runs
    done = runs[1::2]
    async with fencepost.Client(pair[1].address, owner="r") as fresh:  # never routed
        got = await fresh.list_all(statuses=["completed"], page_size=2)
        assert [r.run_id for r in got.runs] == done
        assert [r.run_id async for r in fresh.list(statuses=["running"])] == runs[0::2]


async def test_routing_asks_the_map_without_making_a_server_count(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    """The map a client routes by names owners only: neither server makes
    its pass over the runs (a second a million runs) for it."""
    async with fencepost.Client(pair[1].address, owner="w", renewal="off") as client:
        for run in _runs_in_every_shard("no-count").values():
            await (await client.acquire(run, ttl_ms=60_000)).finish()
        assert [r async for r in client.list()]
    for srv in pair:
        assert srv.app is not None and srv.app.reads is not None
        assert srv.app.reads._shard_counts is None


async def test_a_listing_while_routing_without_a_map_fetches_one(
    pair: tuple[ServerThread, ServerThread]
) -> None:
    """Routing began but its map fetch failed (an owner was unreachable):
    the listing fetches the map, rather than gathering from no owner."""
    from fencepost._connection import Router

    runs = sorted(_runs_in_every_shard("nomap").values())
    async with fencepost.Client(pair[1].address, owner="w", renewal="off") as client:
        for run in runs:
            await client.acquire(run, ttl_ms=60_000)
        client._connection.router = Router()  # routing, with no map
        assert [r.run_id async for r in client.list()] == runs
