"""Contract tests: the public surface is pinned, the sync facade mirrors the
async client, and the lifecycle helpers agree with the server's core."""

from __future__ import annotations

import asyncio
import inspect
import itertools

import pytest

import fencepost
from fencepost import Client, Lease, RunStatus, SyncClient, SyncLease
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
    "UnavailableError", "ValidationError", "WatchEvent",
    "__version__", "can_transition", "is_terminal",
    "LockLostError", "StoreTransaction", "SyncStoreTransaction", "NotLeaderError",
}

CLIENT_API = {
    "acquire", "address", "cancel", "closed", "default_ttl_ms", "delete", "endpoints", "get",
    "list",
    "list_all",
    "owner", "renewal", "request_resume", "retry", "store", "stubs", "validate_fence", "watch",
}

LEASE_API = {
    "at_risk", "at_risk_event", "check", "fenced", "finish", "fencing_token", "guard",
    "is_active", "transaction",
    "is_lost", "lost", "lost_reason", "owner", "record", "record_checkpoint", "release",
    "renew", "run_id", "safe_until", "suspend", "ttl_ms",
}

# Methods that are plain (not coroutine) functions on the async side too.
SYNC_ON_BOTH_SIDES = {"acquire", "check", "fenced", "guard", "transaction"}


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


@pytest.mark.parametrize(("async_cls", "sync_cls"), [(Client, SyncClient), (Lease, SyncLease)])
def test_sync_facade_has_the_same_signatures(async_cls: type, sync_cls: type) -> None:
    names = (public(async_cls) & public(sync_cls)) | {"__init__"}
    if async_cls is Client:
        # on_lost is called with the Lease by Client, with the SyncLease by SyncClient
        a_params, s_params = params(Client), params(SyncClient)
        assert [p[:3] for p in a_params] == [p[:3] for p in s_params]
        assert [p for p in a_params if p[0] != "on_lost"] == [
            p for p in s_params if p[0] != "on_lost"]
    else:
        names.discard("__init__")
    for name in sorted(names):
        a, s = inspect.getattr_static(async_cls, name), inspect.getattr_static(sync_cls, name)
        assert isinstance(a, property) == isinstance(s, property), name
        if isinstance(a, property) or name == "__init__":
            continue
        if name in SYNC_ON_BOTH_SIDES:
            assert not inspect.iscoroutinefunction(a), name
        else:
            assert inspect.iscoroutinefunction(a) or inspect.isasyncgenfunction(a), name
        assert not inspect.iscoroutinefunction(s), name
        assert not inspect.isasyncgenfunction(s), name
        assert params(a) == params(s), name
    assert inspect.iscoroutinefunction(Client.aclose)
    assert inspect.isasyncgenfunction(Client.watch)


async def test_sync_client_refuses_a_running_loop(server: ServerThread) -> None:
    with pytest.raises(RuntimeError, match="running event loop"):
        SyncClient(server.address)


def test_sync_client_refuses_to_block_inside_a_loop(server: ServerThread, transport: str) -> None:
    with SyncClient(server.address, owner="worker-a",
                    transport=transport) as client:  # type: ignore[arg-type]
        lease = client.acquire("run-1")

        async def misuse() -> None:
            client.get("run-1")

        with pytest.raises(RuntimeError, match="running event loop"):
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
