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
from fencepost_server.harness import ServerThread

PUBLIC_API = {
    "AcquireContext", "AlreadyTerminalError", "AtomicStoreRequiredError", "CheckpointRef",
    "Client", "ConflictError", "DeleteResult", "FenceStatus", "FencepostError",
    "IntegrityError", "InvalidRunStateError", "InvalidTransitionError", "Lease",
    "LeaseHeldError", "LeaseInfo", "LeaseLostError", "Outcome", "OutcomeUnknownError",
    "PermissionDeniedError", "RetryPolicy", "RpcError",
    "RunNotFoundError", "RunRecord", "RunStatus", "RunSuspendedError", "StorageFullError",
    "StorageUnavailableError", "Stubs", "Suspension", "SyncClient", "SyncLease", "SyncStubs",
    "UnauthenticatedError", "UnavailableError", "ValidationError",
    "__version__", "can_transition", "is_terminal",
}

CLIENT_API = {
    "acquire", "address", "cancel", "closed", "default_ttl_ms", "delete", "get", "list",
    "owner", "request_resume", "retry", "stubs", "validate_fence",
}

LEASE_API = {
    "finish", "fencing_token", "is_active", "is_lost", "lost", "owner", "record",
    "record_checkpoint", "release", "renew", "run_id", "suspend", "ttl_ms",
}


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
        assert params(Client) == params(SyncClient)
    else:
        names.discard("__init__")
    for name in sorted(names):
        a, s = inspect.getattr_static(async_cls, name), inspect.getattr_static(sync_cls, name)
        assert isinstance(a, property) == isinstance(s, property), name
        if isinstance(a, property) or name == "__init__":
            continue
        assert inspect.iscoroutinefunction(a) or inspect.isasyncgenfunction(a) or name == "acquire"
        assert not inspect.iscoroutinefunction(s), name
        assert params(a) == params(s), name
    assert inspect.iscoroutinefunction(Client.aclose)


async def test_sync_client_refuses_a_running_loop(server: ServerThread) -> None:
    with pytest.raises(RuntimeError, match="running event loop"):
        SyncClient(server.address)


def test_sync_client_refuses_to_block_inside_a_loop(server: ServerThread) -> None:
    with SyncClient(server.address, owner="worker-a") as client:
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
