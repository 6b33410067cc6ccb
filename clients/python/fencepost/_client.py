"""The async client, the lease handle a worker holds, and the object
``Client.acquire`` returns (awaitable and an async context manager)."""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from ._errors import (
    FencepostError,
    LeaseLostError,
    OutcomeUnknownError,
)
from ._records import (
    DeleteResult,
    FenceStatus,
    RunRecord,
    RunStatus,
    parse_status,
    record_from_pb,
    status_from_pb,
    status_to_pb,
)
from ._renewal import Renewer, UnaryRenewer
from ._retry import RetryPolicy, call_with_retry
from .v1 import ledger_pb2, ledger_pb2_grpc, record_pb2, run_store_pb2_grpc

if TYPE_CHECKING:
    from .v1.ledger_pb2_grpc import LedgerAsyncStub
    from .v1.run_store_pb2_grpc import RunStoreAsyncStub

log = logging.getLogger("fencepost")

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TTL_MS = 60_000
DEFAULT_RETRY = RetryPolicy()
# Time a lease release gets when it runs as cleanup (block exit, cancellation).
CLEANUP_TIMEOUT_S = 5.0

# Reconnect quickly after a coordinator restart, so retries (bounded at ~10 s
# by default) land on the new process. The caller's channel_options win.
_DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)

# A unary multi-callable of a generated async stub: rpc(request, timeout=...).
_UnaryRpc = Callable[..., Any]


def default_owner() -> str:
    """``{hostname}-{pid}-{random}``: two live processes never share one."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def new_request_id() -> str:
    return uuid.uuid4().hex


def merge_channel_options(options: Iterable[tuple[str, Any]]) -> builtins.list[tuple[str, Any]]:
    merged = dict(_DEFAULT_CHANNEL_OPTIONS)
    merged.update(dict(options))
    return builtins.list(merged.items())


@dataclass(frozen=True, slots=True)
class Stubs:
    """The raw generated async stubs on the client's channel (escape hatch)."""

    ledger: LedgerAsyncStub
    run_store: RunStoreAsyncStub


class Lease:
    """A worker's handle on a run: ``(run_id, owner, fencing_token)``.

    Fenced calls (``renew``, ``record_checkpoint``, ``suspend``, ``finish``,
    ``release``) carry the token; when the fence has moved they raise
    ``LeaseLostError`` and set ``lost``. While active, the lease is renewed in
    the background at a third of its ttl; ``suspend``, ``finish``,
    ``release`` and closing the client stop that.
    """

    def __init__(self, client: Client, record: RunRecord, ttl_ms: int) -> None:
        assert record.lease is not None, "an acquired run has a lease"
        self._client = client
        self._record = record
        self._run_id = record.run_id
        self._owner = record.lease.owner
        self._token = record.fencing_token
        self._ttl_ms = ttl_ms
        self._lost = asyncio.Event()
        self._lost_callbacks: builtins.list[Callable[[], None]] = []
        self._done = False  # suspended, finished or released by this handle

    def __repr__(self) -> str:
        state = "lost" if self.is_lost else "active" if self.is_active else "done"
        return f"<Lease {self._run_id!r} owner={self._owner!r} token={self._token} {state}>"

    # -- state ---------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def fencing_token(self) -> int:
        """The token to pass to downstream writes (see ``validate_fence``)."""
        return self._token

    @property
    def ttl_ms(self) -> int:
        """The ttl background renewals ask for (the last one given)."""
        return self._ttl_ms

    @property
    def record(self) -> RunRecord:
        """The latest record this handle has seen."""
        return self._record

    @property
    def lost(self) -> asyncio.Event:
        """Set once the server reports the fence moved (RUN_LEASE_LOST)."""
        return self._lost

    @property
    def is_lost(self) -> bool:
        return self._lost.is_set()

    @property
    def is_active(self) -> bool:
        """Neither lost nor given up (suspended, finished, released)."""
        return not self._done and not self.is_lost

    # -- fenced calls --------------------------------------------------------------

    async def renew(self, ttl_ms: int | None = None) -> RunRecord:
        """Extend the lease to server-now + ttl (default: ``ttl_ms``, the ttl
        of the acquire or of the last renew that gave one). A ttl given here
        is also used by later background renewals."""
        ttl = self._ttl_ms if ttl_ms is None else ttl_ms
        req = ledger_pb2.RenewRequest(run_id=self._run_id, owner=self._owner,
                                      fencing_token=self._token, lease_ttl_ms=ttl)
        rec = await self._fenced(self._client._ledger.Renew, req)
        self._ttl_ms = ttl
        return rec

    async def record_checkpoint(self, key: str, snapshot_version: int) -> RunRecord:
        """Point the record at a durable checkpoint; renews the lease too."""
        req = ledger_pb2.RecordCheckpointRequest(
            run_id=self._run_id, owner=self._owner, fencing_token=self._token, key=key,
            snapshot_version=snapshot_version,
        )
        return await self._fenced(self._client._ledger.RecordCheckpoint, req)

    async def suspend(self, pending_approval_ids: Sequence[str] = ()) -> RunRecord:
        """Park the run (-> suspended) and give up the lease."""
        req = ledger_pb2.SuspendRequest(
            run_id=self._run_id, owner=self._owner, fencing_token=self._token,
            pending_approval_ids=builtins.list(pending_approval_ids),
        )
        return await self._fenced(self._client._ledger.Suspend, req, drops_lease=True)

    async def finish(
        self,
        status: RunStatus | str = RunStatus.COMPLETED,
        outcome_code: str | None = None,
        message: str | None = None,
    ) -> RunRecord:
        """End the run as completed, failed or cancelled and give up the lease.
        ``outcome_code`` defaults to "ok" (completed) or "cancelled"; a failed
        run needs one."""
        st = parse_status(status)
        req = ledger_pb2.FinishRequest(
            run_id=self._run_id, owner=self._owner, fencing_token=self._token,
            status=status_to_pb(st),  # type: ignore[arg-type]
        )
        if outcome_code is not None or message is not None:
            code = outcome_code
            if code is None:
                code = {RunStatus.COMPLETED: "ok", RunStatus.CANCELLED: "cancelled"}.get(st, "")
            outcome = record_pb2.Outcome(code=code)
            if message is not None:
                outcome.message = message
            req.outcome.CopyFrom(outcome)
        return await self._fenced(self._client._ledger.Finish, req, drops_lease=True)

    async def release(self) -> RunRecord:
        """Give the run back unfinished (-> queued); it is acquirable at once."""
        req = ledger_pb2.ReleaseRequest(run_id=self._run_id, owner=self._owner,
                                        fencing_token=self._token)
        return await self._fenced(self._client._ledger.Release, req, drops_lease=True)

    # -- internals -----------------------------------------------------------------

    def _on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on the client's loop) when the lease is lost."""
        if self.is_lost:
            callback()
        else:
            self._lost_callbacks.append(callback)

    def _mark_lost(self, record: RunRecord | None) -> None:
        if record is not None:
            self._record = record
        if self.is_lost:
            return
        self._lost.set()
        callbacks, self._lost_callbacks = self._lost_callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:
                log.exception("lease-lost callback failed")

    async def _fenced(
        self,
        rpc: _UnaryRpc,
        request: Any,
        *,
        drops_lease: bool = False,
        policy: RetryPolicy | None = None,
    ) -> RunRecord:
        renewer = self._client._renewer
        if drops_lease:
            # No renewal may race the command that drops the lease: it would
            # be refused with RUN_LEASE_LOST and flag a lease we gave up.
            await renewer.stop(self)
        try:
            resp = await self._client._call(rpc, request, mutation=True, policy=policy)
        except LeaseLostError as exc:
            self._mark_lost(exc.record)
            raise
        except OutcomeUnknownError:
            raise  # may have been applied: do not renew a lease we may have dropped
        except FencepostError:
            if drops_lease and self.is_active:
                renewer.start(self)  # refused: we still hold it
            raise
        rec = record_from_pb(resp.run)
        self._record = rec
        if drops_lease:
            self._done = True
        return rec

    async def _renew_in_background(self, policy: RetryPolicy) -> None:
        req = ledger_pb2.RenewRequest(run_id=self._run_id, owner=self._owner,
                                      fencing_token=self._token, lease_ttl_ms=self._ttl_ms)
        await self._fenced(self._client._ledger.Renew, req, policy=policy)

    async def _exit_block(self, failed: bool) -> None:
        """Leaving ``async with client.acquire(...)``: release unless finished,
        suspended, released or lost. Never masks the block's exception."""
        if not self.is_active or self._client.closed:
            await self._client._renewer.stop(self)
            return
        try:
            await self._client._cleanup(self.release(), CLEANUP_TIMEOUT_S)
        except LeaseLostError:
            pass  # nothing of ours to release; ``lost`` is set
        except (FencepostError, TimeoutError) as exc:
            if not failed:
                raise
            log.warning("could not release %r while leaving a failed block: %s",
                        self._run_id, exc)
        finally:
            await self._client._renewer.stop(self)


class AcquireContext:
    """What ``Client.acquire`` returns: ``await`` it for a ``Lease``, or use
    ``async with`` to release the lease when the block ends without finishing."""

    def __init__(self, client: Client, run_id: str, ttl_ms: int | None,
                 lock_delay_ms: int) -> None:
        self._client = client
        self._run_id = run_id
        self._ttl_ms = ttl_ms
        self._lock_delay_ms = lock_delay_ms
        self._lease: Lease | None = None

    def __await__(self) -> Generator[Any, None, Lease]:
        return self._client._acquire(self._run_id, self._ttl_ms, self._lock_delay_ms).__await__()

    async def __aenter__(self) -> Lease:
        if self._lease is not None:
            raise RuntimeError("this acquire() context is already in use")
        self._lease = await self._client._acquire(self._run_id, self._ttl_ms,
                                                  self._lock_delay_ms)
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease._exit_block(failed=exc_type is not None)


class Client:
    """Async client for a fencepost coordinator.

    Use as ``async with Client(...) as client`` or call ``aclose()``. The
    channel is opened on first use and binds the client to that event loop.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        owner: str | None = None,
        default_ttl_ms: int = DEFAULT_TTL_MS,
        retry: RetryPolicy = DEFAULT_RETRY,
        channel_options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        self._address = address
        self._owner = owner if owner is not None else default_owner()
        self._default_ttl_ms = default_ttl_ms
        self._retry = retry
        self._channel_options = merge_channel_options(channel_options)
        self._interceptors = builtins.list(interceptors)
        self._channel: grpc.aio.Channel | None = None
        self._stubs: Stubs | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._renewer: Renewer = UnaryRenewer(retry)
        self._cleanups: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Client {self._address} owner={self._owner!r}>"

    async def __aenter__(self) -> Client:
        self.stubs  # noqa: B018 - open the channel on this loop
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop background renewals, wait for pending cleanups, close the
        channel. Leases not released stay until their ttl runs out."""
        if self._closed:
            return
        self._closed = True
        await self._renewer.aclose()
        if self._cleanups:
            await asyncio.wait(builtins.list(self._cleanups))
        if self._channel is not None:
            await self._channel.close(None)

    # -- configuration ---------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._address

    @property
    def owner(self) -> str:
        """The identity this client acquires leases as."""
        return self._owner

    @property
    def default_ttl_ms(self) -> int:
        return self._default_ttl_ms

    @property
    def retry(self) -> RetryPolicy:
        return self._retry

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stubs(self) -> Stubs:
        """The raw generated stubs on this client's channel (no retries, no
        error mapping). Opens the channel on first use."""
        if self._closed:
            raise RuntimeError("the client is closed")
        loop = asyncio.get_running_loop()
        if self._stubs is None:
            self._channel = grpc.aio.insecure_channel(
                self._address, options=self._channel_options,
                interceptors=self._interceptors or None,
            )
            self._loop = loop
            self._stubs = Stubs(
                ledger=ledger_pb2_grpc.LedgerStub(self._channel),
                run_store=run_store_pb2_grpc.RunStoreStub(self._channel),
            )
        elif loop is not self._loop:
            raise RuntimeError("a fencepost Client is bound to the event loop it was first "
                               "used on")
        return self._stubs

    @property
    def _ledger(self) -> LedgerAsyncStub:
        return self.stubs.ledger

    # -- worker calls ------------------------------------------------------------------

    def acquire(
        self, run_id: str, *, ttl_ms: int | None = None, lock_delay_ms: int = 0
    ) -> AcquireContext:
        """Become the run's single owner (creating it when new).

        ``lease = await client.acquire(...)``, or ``async with
        client.acquire(...) as lease:`` to have the lease released when the
        block ends (also on error) unless it was finished, suspended,
        released or lost. Raises ``LeaseHeldError``, ``RunSuspendedError``,
        ``AlreadyTerminalError``, ``ValidationError``.
        """
        return AcquireContext(self, run_id, ttl_ms, lock_delay_ms)

    # -- operator calls ----------------------------------------------------------------

    async def get(self, run_id: str) -> RunRecord:
        """The run's record; ``RunNotFoundError`` when there is none."""
        resp = await self._call(self._ledger.GetRun, ledger_pb2.GetRunRequest(run_id=run_id),
                                mutation=False)
        return record_from_pb(resp.run)

    async def list(
        self,
        *,
        statuses: Iterable[RunStatus | str] = (),
        owner: str | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[RunRecord]:
        """Every run (ordered by run_id) matching the filters, fetching pages of
        ``page_size`` as the iteration proceeds."""
        wanted = tuple(parse_status(s) for s in statuses)
        token = ""
        while True:
            records, token = await self._list_page(wanted, owner, page_size, token)
            for rec in records:
                yield rec
            if not token:
                return

    async def cancel(self, run_id: str, message: str | None = None) -> RunRecord:
        """Operator cancel: moves the fencing token (fencing the worker). An
        already cancelled run is returned unchanged."""
        req = ledger_pb2.CancelRequest(run_id=run_id)
        if message is not None:
            req.message = message
        resp = await self._call(self._ledger.Cancel, req, mutation=True)
        return record_from_pb(resp.run)

    async def request_resume(self, run_id: str) -> RunRecord:
        """Make a suspended run (or one whose lease expired) queued again."""
        resp = await self._call(self._ledger.RequestResume,
                                ledger_pb2.RequestResumeRequest(run_id=run_id), mutation=True)
        return record_from_pb(resp.run)

    async def delete(self, run_id: str) -> DeleteResult:
        """Hard-delete a run, fencing any holder."""
        resp = await self._call(self._ledger.DeleteRun,
                                ledger_pb2.DeleteRunRequest(run_id=run_id), mutation=True)
        return DeleteResult(fencing_token=resp.fencing_token, revision=resp.revision)

    async def validate_fence(self, run_id: str, fencing_token: int) -> FenceStatus:
        """Whether ``fencing_token`` is still the run's current one (for a
        downstream resource that must refuse stale writers)."""
        req = ledger_pb2.ValidateFenceRequest(run_id=run_id, fencing_token=fencing_token)
        resp = await self._call(self._ledger.ValidateFence, req, mutation=False)
        return FenceStatus(
            current=resp.current,
            found=resp.found,
            fencing_token=resp.fencing_token,
            status=status_from_pb(resp.status),
            revision=resp.revision,
        )

    # -- internals (shared with SyncClient) ----------------------------------------------

    async def _acquire(self, run_id: str, ttl_ms: int | None, lock_delay_ms: int) -> Lease:
        ttl = self._default_ttl_ms if ttl_ms is None else ttl_ms
        req = ledger_pb2.AcquireRequest(run_id=run_id, owner=self._owner, lease_ttl_ms=ttl,
                                        lock_delay_ms=lock_delay_ms)
        resp = await self._call(self._ledger.Acquire, req, mutation=True)
        lease = Lease(self, record_from_pb(resp.run), ttl)
        self._renewer.start(lease)
        return lease

    async def _list_page(
        self,
        statuses: tuple[RunStatus, ...],
        owner: str | None,
        page_size: int,
        page_token: str,
    ) -> tuple[builtins.list[RunRecord], str]:
        req = ledger_pb2.ListRunsRequest(
            statuses=[status_to_pb(s) for s in statuses],  # type: ignore[misc]
            owner=owner or "",
            page_size=page_size,
            page_token=page_token,
        )
        resp = await self._call(self._ledger.ListRuns, req, mutation=False)
        return [record_from_pb(r) for r in resp.runs], resp.next_page_token

    async def _call(
        self,
        rpc: _UnaryRpc,
        request: Any,
        *,
        mutation: bool,
        policy: RetryPolicy | None = None,
    ) -> Any:
        """One logical call: a mutation gets one request id, reused by every
        retry; only UNAVAILABLE is retried; errors are mapped once."""
        if self._closed:
            raise RuntimeError("the client is closed")
        if mutation and not request.request_id:
            request.request_id = new_request_id()

        async def attempt(deadline_s: float | None) -> Any:
            return await rpc(request, timeout=deadline_s)

        return await call_with_retry(attempt, policy or self._retry, mutation=mutation)

    async def _cleanup(self, coro: Any, limit_s: float) -> Any:
        """Run cleanup work shielded from the caller's cancellation and bounded
        in time. The client owns the task and awaits it on close."""
        task: asyncio.Task[Any] = asyncio.create_task(self._bounded(coro, limit_s))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanup_done)
        return await asyncio.shield(task)

    @staticmethod
    async def _bounded(coro: Any, limit_s: float) -> Any:
        async with asyncio.timeout(limit_s):
            return await coro

    def _cleanup_done(self, task: asyncio.Task[Any]) -> None:
        self._cleanups.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("cleanup finished with %r", task.exception())
