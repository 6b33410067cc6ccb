"""The blocking facade: ``SyncClient`` drives an async ``Client`` on a private
event-loop thread (anyio's blocking-portal habit), with the same method names
and signatures. It refuses to be used from inside a running event loop, where
blocking would stall that loop: use ``fencepost.Client`` there.

Leases are kept alive by the async client on the loop thread (one KeepAlive
stream), so a worker thread busy in a long computation does not stop its
renewals. A thread cannot be cancelled, though: ``SyncLease.guard()`` and
``check()`` are how threaded code learns that it must stop.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import threading
import weakref
from collections.abc import (
    AsyncGenerator,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from ._client import (
    AT_RISK,
    DEFAULT_ADDRESS,
    DEFAULT_RETRY,
    DEFAULT_TTL_MS,
    LOST,
    SAFE,
    Client,
    ClientStatistics,
    Lease,
    Renewal,
    Transport,
    hooks_of,
)
from ._errors import (
    ClientClosedError,
    EventLoopError,
    LeaseAtRiskError,
    LeaseLostError,
    UsageError,
)
from ._records import (
    DeleteResult,
    FenceStatus,
    LostReason,
    RunListing,
    RunRecord,
    RunStatus,
    WatchEvent,
    parse_status,
)
from ._retry import RetryPolicy
from ._security import TLS, sync_channel
from ._shards import ShardInfo, ShardMap
from ._store import (
    ABSENT,
    AsyncStore,
    CreateRunResult,
    EngineArtifact,
    EngineCheckpoint,
    EngineDoc,
    EngineRun,
    EngineStep,
    KeyClaim,
    LockGrant,
    Lookup,
    PutArtifactResult,
    RunList,
    status_list,
)
from ._watch import WatchCursor
from .v1 import ledger_pb2_grpc, run_store_pb2_grpc

if TYPE_CHECKING:
    from ._transaction import StoreTransaction

T = TypeVar("T")
log = logging.getLogger("fencepost")

# What ``SyncClient(on_lost=...)`` is called with, on the client's callback thread.
SyncOnLost = Callable[["SyncLease", LostReason], object]
_END = object()  # the watch ended


def _refuse_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise EventLoopError(
        "fencepost.SyncClient blocks, so it cannot be used inside a running event loop; "
        "use fencepost.Client (async) there"
    )


_CLOSE_WAIT_S = 2.0  # how long close() waits for the private loop's tasks


class LeaseHooks(Protocol):
    """What a ``SyncLease`` needs of its ``Lease`` beyond the public API."""

    @property
    def risk_epoch(self) -> int: ...
    def add_listener(self, listener: Callable[[str], None]) -> None: ...
    def lost_error(self) -> LeaseLostError: ...
    def at_risk_error(self) -> LeaseAtRiskError: ...
    async def exit_block(self, failed: bool) -> None: ...


class _Portal:
    """An event loop on a private daemon thread, and a way to run coroutines on it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="fencepost-sync", daemon=True)
        self._closed = False
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            _refuse_running_loop()
            if self._closed:
                raise ClientClosedError("the client is closed")
        except BaseException:
            coro.close()
            raise
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt while waiting
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                _, stuck = await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)
                if stuck:
                    log.warning("%d task(s) ignored cancellation at close: %s", len(stuck),
                                ", ".join(t.get_name() for t in stuck))

        try:
            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(_CLOSE_WAIT_S + 1)
        except Exception:  # never let close() hang or raise: the thread is a daemon
            log.warning("the client's event loop did not shut down cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self._loop.close()


@dataclass(frozen=True, slots=True)
class SyncStubs:
    """The raw generated blocking stubs (escape hatch of ``SyncClient``)."""

    ledger: ledger_pb2_grpc.LedgerStub
    run_store: run_store_pb2_grpc.RunStoreStub


class SyncLease:
    """The blocking twin of ``Lease``; also a context manager that releases the
    lease on exit unless it was finished, suspended, released or lost.
    ``lost`` and ``at_risk_event`` are ``threading.Event`` objects."""

    def __init__(self, portal: _Portal, lease: Lease, hooks: LeaseHooks) -> None:
        # Built on the portal's loop thread (SyncClient does), where the
        # lease's state changes happen.
        self._portal = portal
        self._lease = lease
        self._hooks = hooks
        self._lost = threading.Event()
        self._at_risk = threading.Event()
        if lease.is_lost:
            self._lost.set()
        if lease.at_risk_event.is_set():
            self._at_risk.set()
        hooks.add_listener(self._changed)

    def _changed(self, change: str) -> None:
        if change == LOST:
            self._at_risk.set()
            self._lost.set()
        elif change == AT_RISK:
            self._at_risk.set()
        elif change == SAFE:
            self._at_risk.clear()

    def __repr__(self) -> str:
        return repr(self._lease).replace("<Lease", "<SyncLease", 1)

    def __enter__(self) -> SyncLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._portal.run(self._hooks.exit_block(failed=exc_type is not None))

    def fenced(self) -> SyncStore:
        """``Lease.fenced``: the engine store with every write fenced by this lease."""
        return SyncStore(self._lease.fenced(), self._portal.run)

    def transaction(self) -> SyncStoreTransaction:
        """``with lease.transaction() as tx:`` (see ``Lease.transaction``)."""
        return SyncStoreTransaction(self._lease.transaction(), self._portal.run)

    @property
    def run_id(self) -> str:
        return self._lease.run_id

    @property
    def owner(self) -> str:
        return self._lease.owner

    @property
    def fencing_token(self) -> int:
        return self._lease.fencing_token

    @property
    def ttl_ms(self) -> int:
        return self._lease.ttl_ms

    @property
    def record(self) -> RunRecord:
        return self._lease.record

    @property
    def lost(self) -> threading.Event:
        return self._lost

    @property
    def is_lost(self) -> bool:
        return self._lease.is_lost

    @property
    def is_active(self) -> bool:
        return self._lease.is_active

    @property
    def lost_reason(self) -> LostReason | None:
        return self._lease.lost_reason

    @property
    def safe_until(self) -> float:
        """A ``time.monotonic()`` reading; see ``Lease.safe_until``."""
        return self._lease.safe_until

    @property
    def at_risk(self) -> bool:
        return self._lease.at_risk

    @property
    def at_risk_event(self) -> threading.Event:
        """Set when the lease becomes at risk or lost; see ``Lease.at_risk_event``."""
        return self._at_risk

    def check(self) -> None:
        """Raise ``LeaseLostError`` if lost, ``LeaseAtRiskError`` if at risk.
        Call it between side effects in a long-running thread."""
        self._lease.check()

    def guard(self) -> _SyncGuard:
        """``with lease.guard():`` for a worker thread. A thread cannot be
        cancelled, so on loss this does what it can: ``lost`` /
        ``at_risk_event`` are set at once (poll them, or call ``check()``,
        between side effects), and when the block exits normally after the
        lease was lost or at risk at any moment during it, ``LeaseLostError``
        (``LeaseAtRiskError`` for at-risk) is raised from the ``with``. An
        exception raised by the block propagates unchanged. Entering raises at
        once when the lease is already lost or at risk."""
        return _SyncGuard(self._lease, self._hooks)

    def renew(self, ttl_ms: int | None = None) -> RunRecord:
        return self._portal.run(self._lease.renew(ttl_ms))

    def record_checkpoint(self, key: str, snapshot_version: int) -> RunRecord:
        return self._portal.run(self._lease.record_checkpoint(key, snapshot_version))

    def suspend(self, pending_approval_ids: Sequence[str] = ()) -> RunRecord:
        return self._portal.run(self._lease.suspend(pending_approval_ids))

    def finish(
        self,
        status: RunStatus | str = RunStatus.COMPLETED,
        outcome_code: str | None = None,
        message: str | None = None,
    ) -> RunRecord:
        return self._portal.run(self._lease.finish(status, outcome_code, message))

    def release(self) -> RunRecord:
        return self._portal.run(self._lease.release())


class _SyncGuard:
    """What ``SyncLease.guard()`` returns (see there)."""

    def __init__(self, lease: Lease, hooks: LeaseHooks) -> None:
        self._lease = lease
        self._hooks = hooks
        self._epoch: int | None = None

    def __enter__(self) -> None:
        if self._epoch is not None:
            raise UsageError("this guard() is already in use")
        self._lease.check()
        self._epoch = self._hooks.risk_epoch

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            return  # the block's own exception wins
        lease, hooks = self._lease, self._hooks
        if lease.is_lost:
            raise hooks.lost_error()
        if hooks.risk_epoch != self._epoch or lease.at_risk:
            raise hooks.at_risk_error()


class SyncClient:
    """Blocking client with the same methods as ``Client``. ``acquire``
    acquires at once and returns a ``SyncLease`` (also a context manager).

    ``on_lost(sync_lease, reason)`` runs on a dedicated callback thread (so it
    may call this client); ``watch`` returns a blocking iterator. Mutations
    travel as ``Client``'s do (``transport``, ``command_window_ms``): calls
    made from several threads at about the same time can share one message.
    ``address`` is one endpoint or several, and the leader is followed, as
    for ``Client``.
    """

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        owner: str | None = None,
        default_ttl_ms: int = DEFAULT_TTL_MS,
        retry: RetryPolicy = DEFAULT_RETRY,
        channel_options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        on_lost: SyncOnLost | None = None,
        renewal: Renewal = "stream",
        transport: Transport = "stream",
        command_window_ms: float = 0.0,
        tls: TLS | None = None,
        token: str | None = None,
    ) -> None:
        _refuse_running_loop()
        self._on_lost = on_lost
        self._client = Client(
            address, owner=owner, default_ttl_ms=default_ttl_ms, retry=retry,
            channel_options=channel_options, interceptors=interceptors,
            on_lost=self._lost_on_loop if on_lost is not None else None, renewal=renewal,
            transport=transport, command_window_ms=command_window_ms, tls=tls, token=token,
        )
        self._tls, self._token = tls, token
        self._channel_options = builtins.list(channel_options)
        self._sync_channel: grpc.Channel | None = None
        self._sync_stubs: SyncStubs | None = None
        self._lock = threading.Lock()
        self._leases: weakref.WeakValueDictionary[Lease, SyncLease] = (
            weakref.WeakValueDictionary())
        self._callbacks: ThreadPoolExecutor | None = None
        if on_lost is not None:
            self._callbacks = ThreadPoolExecutor(1, thread_name_prefix="fencepost-callbacks")
        self._portal = _Portal()
        self._store: SyncStore | None = None

    @property
    def store(self) -> SyncStore:
        """The engine store (docs/SPEC.md §11), blocking."""
        if self._store is None:
            self._store = SyncStore(self._client.store, self._portal.run)
        return self._store

    def __repr__(self) -> str:
        return repr(self._client).replace("<Client", "<SyncClient", 1)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop background renewals, close the channels and the loop thread."""
        _refuse_running_loop()
        if self._client.closed:
            return
        try:
            self._portal.run(self._client.aclose())
        finally:
            self._portal.close()
            with self._lock:
                if self._sync_channel is not None:
                    self._sync_channel.close()
            if self._callbacks is not None:
                in_callback = threading.current_thread().name.startswith("fencepost-callbacks")
                self._callbacks.shutdown(wait=not in_callback)

    @property
    def address(self) -> str:
        """The endpoint calls go to now (see ``Client.address``)."""
        return self._client.address

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._client.endpoints

    @property
    def owner(self) -> str:
        return self._client.owner

    @property
    def default_ttl_ms(self) -> int:
        return self._client.default_ttl_ms

    @property
    def retry(self) -> RetryPolicy:
        return self._client.retry

    @property
    def closed(self) -> bool:
        return self._client.closed

    @property
    def renewal(self) -> Renewal:
        return self._client.renewal

    @property
    def stubs(self) -> SyncStubs:
        """Raw blocking stubs on a separate channel to the endpoint believed to
        lead when first used (no following)."""
        with self._lock:
            if self._client.closed:
                raise ClientClosedError("the client is closed")
            if self._sync_stubs is None:
                self._sync_channel = sync_channel(
                    self._client.address, tls=self._tls, token=self._token,
                    options=self._channel_options,
                )
                self._sync_stubs = SyncStubs(
                    ledger=ledger_pb2_grpc.LedgerStub(self._sync_channel),
                    run_store=run_store_pb2_grpc.RunStoreStub(self._sync_channel),
                )
            return self._sync_stubs

    def acquire(
        self, run_id: str, *, ttl_ms: int | None = None, lock_delay_ms: int = 0
    ) -> SyncLease:
        return self._portal.run(self._acquire(run_id, ttl_ms, lock_delay_ms))

    async def _acquire(self, run_id: str, ttl_ms: int | None, lock_delay_ms: int) -> SyncLease:
        return self._wrap(await self._client.acquire(run_id, ttl_ms=ttl_ms,
                                                     lock_delay_ms=lock_delay_ms))

    def statistics(self) -> ClientStatistics:
        """``Client.statistics``: what this client has sent and keeps alive now."""
        return self._client.statistics()

    def _wrap(self, lease: Lease) -> SyncLease:
        """The SyncLease of a lease (on the loop thread)."""
        sync = self._leases.get(lease)
        if sync is None:
            sync = SyncLease(self._portal, lease, hooks_of(lease))
            self._leases[lease] = sync
        return sync

    def _lost_on_loop(self, lease: Lease, reason: LostReason) -> None:
        callbacks = self._callbacks
        if callbacks is None or self._on_lost is None:
            return
        try:
            callbacks.submit(self._call_on_lost, self._on_lost, self._wrap(lease), reason)
        except RuntimeError:  # shut down: the client is closing
            pass

    @staticmethod
    def _call_on_lost(callback: SyncOnLost, lease: SyncLease, reason: LostReason) -> None:
        try:
            callback(lease, reason)
        except Exception:
            log.exception("on_lost callback failed")

    def get(self, run_id: str) -> RunRecord:
        return self._portal.run(self._client.get(run_id))

    def list(
        self,
        *,
        statuses: Iterable[RunStatus | str] = (),
        owner: str | None = None,
        page_size: int = 100,
    ) -> Iterator[RunRecord]:
        wanted = tuple(parse_status(s) for s in statuses)  # bad input raises here, not later
        return self._blocking(self._client.list(statuses=wanted, owner=owner,
                                                page_size=page_size))

    def list_all(
        self,
        *,
        statuses: Iterable[RunStatus | str] = (),
        owner: str | None = None,
        page_size: int = 1000,
    ) -> RunListing:
        """``Client.list_all``: every matching run and the revision to watch from."""
        return self._portal.run(
            self._client.list_all(statuses=statuses, owner=owner, page_size=page_size)
        )

    def _blocking(self, agen: AsyncGenerator[T, None]) -> Generator[T, None, None]:
        """An async generator of the client's, stepped on its loop."""

        async def step() -> Any:
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return _END

        try:
            while True:
                item = self._portal.run(step())
                if item is _END:
                    return
                yield item
        finally:
            try:
                self._portal.run(agen.aclose())
            except RuntimeError:
                pass  # the client is closed, or the step was interrupted and still unwinds

    def cancel(self, run_id: str, message: str | None = None) -> RunRecord:
        return self._portal.run(self._client.cancel(run_id, message))

    def request_resume(self, run_id: str) -> RunRecord:
        return self._portal.run(self._client.request_resume(run_id))

    def delete(self, run_id: str) -> DeleteResult:
        return self._portal.run(self._client.delete(run_id))

    def validate_fence(self, run_id: str, fencing_token: int) -> FenceStatus:
        return self._portal.run(self._client.validate_fence(run_id, fencing_token))

    def shards(self) -> ShardMap:
        return self._portal.run(self._client.shards())

    def move_shard(self, shard: int, to: str) -> ShardInfo:
        return self._portal.run(self._client.move_shard(shard, to))

    def shard_of(self, key: str) -> int:
        return self._portal.run(self._client.shard_of(key))

    def watch(
        self, run_ids: Iterable[str] = (), from_revision: int = 0, *,
        cursor: WatchCursor | None = None,
    ) -> Generator[WatchEvent, None, None]:
        """A blocking iterator over ``Client.watch`` (same behaviour: resumes by
        itself, follows shards, keeps ``cursor`` current, raises
        ``RevisionCompactedError``). ``close()`` it, or break out of the loop,
        to end the watch; closing the client ends it too."""
        if from_revision < 0:
            raise ValueError(f"from_revision must be >= 0 (got {from_revision})")
        if cursor is not None and from_revision:
            raise ValueError("from_revision: must be 0 with a cursor (it says where each "
                             "shard resumes)")
        return self._events(builtins.list(run_ids), from_revision, cursor)

    def _events(
        self, run_ids: builtins.list[str], from_revision: int, cursor: WatchCursor | None
    ) -> Generator[WatchEvent, None, None]:
        return self._blocking(self._client.watch(run_ids, from_revision, cursor=cursor))


# -- the engine store -------------------------------------------------------------------------


class SyncStore:
    """The blocking twin of ``AsyncStore``, with the same names and signatures.

    ``SyncStore(async_store, run)``: ``run(coro)`` runs a coroutine on the
    event loop the async store's channel belongs to and returns its result
    (``SyncClient`` passes its private loop's runner). Uploads take bytes or
    a plain iterable of bytes; ``iter_artifact`` is a plain iterator.
    """

    def __init__(self, store: AsyncStore, run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self._store = store
        self._run_coro = run

    @property
    def async_store(self) -> AsyncStore:
        return self._store

    def fenced(
        self,
        *,
        fencing_token: int,
        run_id: str | None = None,
        lock_key: str | None = None,
    ) -> SyncStore:
        """``AsyncStore.fenced``: a view whose every write carries the fence."""
        view = self._store.fenced(fencing_token=fencing_token, run_id=run_id, lock_key=lock_key)
        return SyncStore(view, self._run_coro)

    def transaction(
        self,
        *,
        fencing_token: int | None = None,
        run_id: str | None = None,
        lock_key: str | None = None,
    ) -> SyncStoreTransaction:
        """``with store.transaction(...) as tx:`` (see ``AsyncStore.transaction``)."""
        tx = self._store.transaction(fencing_token=fencing_token, run_id=run_id,
                                     lock_key=lock_key)
        return SyncStoreTransaction(tx, self._run_coro)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._run_coro(coro)  # type: ignore[no-any-return]

    def create_run(
        self,
        id: str,
        *,
        agent: str,
        status: str = "queued",
        input: Any = ABSENT,
        output: Any = ABSENT,
        error: Any = ABSENT,
        metadata: Any = ABSENT,
        concurrency_key: str | None = None,
    ) -> CreateRunResult:
        return self._run(
            self._store.create_run(
                id,
                agent=agent,
                status=status,
                input=input,
                output=output,
                error=error,
                metadata=metadata,
                concurrency_key=concurrency_key,
            )
        )

    def get_run(self, id: str) -> EngineRun | None:
        return self._run(self._store.get_run(id))

    def update_run(
        self,
        id: str,
        *,
        status: str | None = None,
        concurrency_key: str | None = None,
        input: Any = ABSENT,
        output: Any = ABSENT,
        error: Any = ABSENT,
        metadata: Any = ABSENT,
        clear: Iterable[str] = (),
        expect_status: str | Iterable[str] | None = None,
        expect_owner: str | None = None,
    ) -> EngineRun:
        return self._run(
            self._store.update_run(
                id,
                status=status,
                concurrency_key=concurrency_key,
                input=input,
                output=output,
                error=error,
                metadata=metadata,
                clear=builtins.list(clear),
                expect_status=status_list(expect_status) if expect_status is not None else None,
                expect_owner=expect_owner,
            )
        )

    def list_runs(
        self,
        *,
        agent: str | None = None,
        statuses: str | Iterable[str] | None = None,
        concurrency_key: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> RunList:
        return self._run(
            self._store.list_runs(
                agent=agent,
                statuses=status_list(statuses),
                concurrency_key=concurrency_key,
                limit=limit,
                offset=offset,
            )
        )

    def claim_run(self, id: str, owner: str, ttl_ms: int) -> bool:
        return self._run(self._store.claim_run(id, owner, ttl_ms))

    def renew_claim(self, id: str, owner: str, ttl_ms: int) -> bool:
        return self._run(self._store.renew_claim(id, owner, ttl_ms))

    def append_step(
        self,
        run_id: str,
        name: str,
        *,
        status: str | None = None,
        input: Any = ABSENT,
        output: Any = ABSENT,
        error: Any = ABSENT,
        metadata: Any = ABSENT,
    ) -> EngineStep:
        return self._run(
            self._store.append_step(
                run_id,
                name,
                status=status,
                input=input,
                output=output,
                error=error,
                metadata=metadata,
            )
        )

    def list_steps(self, run_id: str) -> builtins.list[EngineStep]:
        return self._run(self._store.list_steps(run_id))

    def save_checkpoint(self, run_id: str, step_index: int, state: Any) -> bool:
        return self._run(self._store.save_checkpoint(run_id, step_index, state))

    def latest_checkpoint(self, run_id: str) -> EngineCheckpoint | None:
        return self._run(self._store.latest_checkpoint(run_id))

    def claim_key(self, scope: str, key: str, run_id: str, ttl_ms: int) -> KeyClaim:
        return self._run(self._store.claim_key(scope, key, run_id, ttl_ms))

    def acquire_lock(self, key: str, owner: str, ttl_ms: int) -> LockGrant:
        return self._run(self._store.acquire_lock(key, owner, ttl_ms))

    def release_lock(self, key: str, owner: str) -> bool:
        return self._run(self._store.release_lock(key, owner))

    def get_effect(self, key: str) -> Lookup:
        return self._run(self._store.get_effect(key))

    def put_effect(self, key: str, result: Any) -> None:
        self._run(self._store.put_effect(key, result))

    def kv_get(self, agent: str, key: str) -> Lookup:
        return self._run(self._store.kv_get(agent, key))

    def kv_set(self, agent: str, key: str, value: Any) -> None:
        self._run(self._store.kv_set(agent, key, value))

    def doc_list(
        self,
        agent: str,
        collection: str,
        *,
        where: dict[str, Any] | None = None,
        limit: int | None = None,
    ) -> builtins.list[EngineDoc]:
        return self._run(self._store.doc_list(agent, collection, where=where, limit=limit))

    def doc_upsert(self, agent: str, collection: str, id: str, doc: dict[str, Any]) -> bool:
        return self._run(self._store.doc_upsert(agent, collection, id, doc))

    def doc_delete(self, agent: str, collection: str, id: str) -> bool:
        return self._run(self._store.doc_delete(agent, collection, id))

    def put_artifact(
        self,
        id: str,
        data: bytes | bytearray | memoryview | Iterable[bytes],
        *,
        run_id: str,
        size_bytes: int | None = None,
        name: str = "",
        content_type: str = "",
        metadata: Any = ABSENT,
        sha256: str | None = None,
    ) -> PutArtifactResult:
        return self._run(
            self._store.put_artifact(
                id,
                data,
                run_id=run_id,
                size_bytes=size_bytes,
                name=name,
                content_type=content_type,
                metadata=metadata,
                sha256=sha256,
            )
        )

    def get_artifact(self, id: str) -> EngineArtifact | None:
        return self._run(self._store.get_artifact(id))

    def read_artifact(self, id: str) -> bytes:
        return self._run(self._store.read_artifact(id))

    def iter_artifact(self, id: str) -> Iterator[bytes]:
        agen = self._store.iter_artifact(id)

        async def step() -> tuple[bool, bytes]:
            try:
                return True, await agen.__anext__()
            except StopAsyncIteration:
                return False, b""

        try:
            while True:
                more, chunk = self._run(step())
                if not more:
                    return
                yield chunk
        finally:
            self._run(agen.aclose())  # type: ignore[attr-defined]

    def list_artifacts(self, run_id: str) -> builtins.list[EngineArtifact]:
        return self._run(self._store.list_artifacts(run_id))

    def delete_artifact(self, id: str) -> bool:
        return self._run(self._store.delete_artifact(id))


# -- store transactions -------------------------------------------------------------------


class SyncStoreTransaction:
    """The blocking twin of ``StoreTransaction``: ``with ... as tx:``."""

    def __init__(
        self, tx: StoreTransaction, run: Callable[[Coroutine[Any, Any, Any]], Any]
    ) -> None:
        self._tx = tx
        self._run_coro = run

    def __repr__(self) -> str:
        return repr(self._tx).replace("<StoreTransaction", "<SyncStoreTransaction", 1)

    def __enter__(self) -> SyncStoreTransaction:
        self._run_coro(self._tx.__aenter__())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._run_coro(self._tx.__aexit__(exc_type, exc, tb))

    @property
    def results(self) -> builtins.list[Any]:
        return self._tx.results

    def renew(self, ttl_ms: int | None = None) -> None:
        self._run_coro(self._tx.renew(ttl_ms))

    def record_checkpoint(self, key: str, snapshot_version: int) -> None:
        self._run_coro(self._tx.record_checkpoint(key, snapshot_version))

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._tx, name)  # AttributeError for anything but a write
        return lambda *args, **kwargs: self._run_coro(method(*args, **kwargs))
