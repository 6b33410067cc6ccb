"""Contract tests: the public surface is pinned, the sync facade mirrors the
async client, and the lifecycle helpers agree with the server's core."""

from __future__ import annotations

import asyncio
import inspect
import itertools

import pytest

import fencepost
from fencepost import (
    AsyncStore,
    Client,
    Lease,
    RunStatus,
    StoreTransaction,
    SyncClient,
    SyncLease,
    SyncStore,
    SyncStoreTransaction,
)
from fencepost_server.core import records as core
from fencepost_server.testing.server import ServerThread

BOTH_TRANSPORTS = True  # tests using `transport` run over the Execute stream and unary

PUBLIC_API = {
    "ABSENT", "AsyncStore", "InvalidRunState", "Lookup", "RunNotFound", "SyncStore",
    "AcquireContext", "AlreadyTerminalError", "AtomicStoreRequiredError", "ChangeKind",
    "CheckpointRef", "Client", "ConflictError", "DeleteResult", "FenceStatus", "FencepostError",
    "IntegrityError", "InvalidRunStateError", "InvalidTransitionError", "Lease",
    "LeaseAtRiskError", "LeaseHeldError", "LeaseInfo", "LeaseLostError", "LostReason",
    "Outcome", "OutcomeUnknownError", "OwnerNotPermittedError", "PermissionDeniedError",
    "RetryPolicy", "TLS",
    "RevisionCompactedError", "RpcError", "RunListing", "RunNotFoundError", "RunRecord",
    "RunStatus",
    "RunSuspendedError", "ShuttingDownError", "StorageFullError", "StorageUnavailableError",
    "StreamTooSlowError",
    "Stubs", "Suspension", "SyncClient", "SyncLease", "SyncStubs", "UnauthenticatedError",
    "UnavailableError", "ValidationError", "WatchCursor", "WatchEvent",
    "__version__", "can_transition", "is_terminal",
    "LockLostError", "StoreTransaction", "SyncStoreTransaction", "NotLeaderError", "NotOwnerError",
    # the middle layers of the error tree, and misuse (fencepost._errors)
    "InvalidInputError", "RefusedError", "UsageError", "ClientClosedError", "EventLoopError",
    "ClientStatistics",
    "shard_of", "ShardInfo", "ShardMap",
}

CLIENT_API = {
    "acquire", "address", "cancel", "closed", "default_ttl_ms", "delete", "endpoints", "get",
    "list",
    "list_all", "move_shard",
    "owner", "renewal", "request_resume", "retry", "shard_of", "shards", "statistics", "store",
    "stubs",
    "validate_fence", "watch",
}

LEASE_API = {
    "at_risk", "at_risk_event", "check", "fenced", "finish", "fencing_token", "guard",
    "is_active", "transaction",
    "is_lost", "lost", "lost_reason", "owner", "record", "record_checkpoint", "release",
    "renew", "run_id", "safe_until", "suspend", "ttl_ms",
}

# Methods that are plain (not coroutine) functions on the async side too.
SYNC_ON_BOTH_SIDES = {"acquire", "check", "fenced", "guard", "transaction", "statistics"}


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def params(fn: object) -> list[tuple[str, object, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]


def test_public_api_is_pinned() -> None:
    assert set(fencepost.__all__) == PUBLIC_API
    for name in fencepost.__all__:
        assert hasattr(fencepost, name), name
    assert public(Client) == CLIENT_API | {"aclose"}
    assert public(SyncClient) == CLIENT_API | {"close"}
    assert public(Lease) == LEASE_API
    assert public(SyncLease) == LEASE_API


# Every async class and its blocking twin (all twins live in fencepost._sync).
TWINS = [(Client, SyncClient), (Lease, SyncLease), (AsyncStore, SyncStore),
         (StoreTransaction, SyncStoreTransaction)]
# What one side has and the other has not, and why.
ONLY_ASYNC = {
    Client: {"aclose"},  # SyncClient.close
    AsyncStore: {"aclose", "connect", "stub"},  # a SyncStore wraps a store it does not own
}
ONLY_SYNC = {SyncClient: {"close"}, SyncStore: {"async_store"}}
# Parameters whose annotation differs on purpose: (class, method, parameter).
OWN_TYPES = {
    (Client, "__init__", "on_lost"),  # called with the Lease, with the SyncLease
    (AsyncStore, "put_artifact", "data"),  # a SyncStore uploads no async iterable
}


@pytest.mark.parametrize(("async_cls", "sync_cls"), TWINS)
def test_every_async_method_has_a_sync_twin_with_the_same_signature(
    async_cls: type, sync_cls: type
) -> None:
    assert sync_cls.__module__ == "fencepost._sync", sync_cls  # the twins in one place
    mine, theirs = public(async_cls), public(sync_cls)
    assert mine - theirs == ONLY_ASYNC.get(async_cls, set())
    assert theirs - mine == ONLY_SYNC.get(sync_cls, set())
    names = mine & theirs
    if async_cls in (Client, AsyncStore):
        names.add("__init__")  # Lease and transactions are made by the SDK
    for name in sorted(names):
        a, s = inspect.getattr_static(async_cls, name), inspect.getattr_static(sync_cls, name)
        assert isinstance(a, property) == isinstance(s, property), name
        if isinstance(a, property):
            continue
        if name != "__init__":
            if name in SYNC_ON_BOTH_SIDES:
                assert not inspect.iscoroutinefunction(a), name
            else:
                assert inspect.iscoroutinefunction(a) or inspect.isasyncgenfunction(a), name
            assert not inspect.iscoroutinefunction(s), name
            assert not inspect.isasyncgenfunction(s), name
        if async_cls is AsyncStore and name == "__init__":
            continue  # SyncStore(async_store, run) wraps one
        a_params, s_params = params(a), params(s)
        assert [p[:3] for p in a_params] == [p[:3] for p in s_params], name
        own = {p for c, m, p in OWN_TYPES if c is async_cls and m == name}
        assert [p for p in a_params if p[0] not in own] == [
            p for p in s_params if p[0] not in own], name
    assert inspect.iscoroutinefunction(Client.aclose)
    assert inspect.isasyncgenfunction(Client.watch)


async def test_sync_client_refuses_a_running_loop(server: ServerThread) -> None:
    with pytest.raises(fencepost.EventLoopError, match="running event loop"):
        SyncClient(server.address)


def test_sync_client_refuses_to_block_inside_a_loop(server: ServerThread, transport: str) -> None:
    with SyncClient(server.address, owner="worker-a",
                    transport=transport) as client:  # type: ignore[arg-type]
        lease = client.acquire("run-1")

        async def misuse() -> None:
            client.get("run-1")

        with pytest.raises(fencepost.EventLoopError, match="running event loop"):
            asyncio.run(misuse())
        assert client.get("run-1").status is RunStatus.RUNNING  # still usable outside
        lease.release()


def test_lifecycle_agrees_with_the_server_core() -> None:
    pairs = list(itertools.product(RunStatus, RunStatus))
    assert len(pairs) == 36
    for src, dst in pairs:
        want = core.can_transition(core.Status[src.name], core.Status[dst.name])
        assert fencepost.can_transition(src, dst) is want, (src, dst)
        assert fencepost.can_transition(src.value, dst.value) is want
    for st in RunStatus:
        assert fencepost.is_terminal(st) is core.is_terminal(core.Status[st.name])
    assert not fencepost.can_transition("running", "running")
    assert fencepost.can_transition("running", "queued")
    assert [s for s in RunStatus if fencepost.is_terminal(s)] == [
        RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED,
    ]
    with pytest.raises(ValueError):
        fencepost.is_terminal("finished")


def test_status_is_a_string_enum() -> None:
    assert str(RunStatus.RUNNING) == "running"
    assert RunStatus("cancelled") is RunStatus.CANCELLED
    assert [s.value for s in RunStatus] == [s.name.lower() for s in core.Status]


def test_default_owner_is_unique_per_client() -> None:
    a, b = Client(), Client()
    assert a.owner != b.owner and a.owner.split("-")[-2].isdigit()
    assert a.address == "127.0.0.1:50051" and a.default_ttl_ms == 60_000
