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
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ._client import (
    AT_RISK,
    DEFAULT_ADDRESS,
    DEFAULT_RETRY,
    DEFAULT_TTL_MS,
    LOST,
    SAFE,
    Client,
    Lease,
    Renewal,
    Transport,
)
from ._errors import ClientClosedError, EventLoopError, UsageError
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
from ._store import SyncStore
from .v1 import ledger_pb2_grpc, run_store_pb2_grpc

if TYPE_CHECKING:
    from ._transaction import SyncStoreTransaction

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

    def __init__(self, portal: _Portal, lease: Lease) -> None:
        # Built on the portal's loop thread (SyncClient does), where the
        # lease's state changes happen.
        self._portal = portal
        self._lease = lease
        self._lost = threading.Event()
        self._at_risk = threading.Event()
        if lease.is_lost:
            self._lost.set()
        if lease.at_risk_event.is_set():
            self._at_risk.set()
        lease._add_listener(self._changed)

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
        self._portal.run(self._lease._exit_block(failed=exc_type is not None))

    def fenced(self) -> SyncStore:
        """``Lease.fenced``: the engine store with every write fenced by this lease."""
        return SyncStore(self._lease.fenced(), self._portal.run)

    def transaction(self) -> SyncStoreTransaction:
        """``with lease.transaction() as tx:`` (see ``Lease.transaction``)."""
        from ._transaction import SyncStoreTransaction

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
        return _SyncGuard(self._lease)

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

    def __init__(self, lease: Lease) -> None:
        self._lease = lease
        self._epoch: int | None = None

    def __enter__(self) -> None:
        if self._epoch is not None:
            raise UsageError("this guard() is already in use")
        self._lease.check()
        self._epoch = self._lease._risk_epoch

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            return  # the block's own exception wins
        lease = self._lease
        if lease.is_lost:
            raise lease._lost_error()
        if lease._risk_epoch != self._epoch or lease.at_risk:
            raise lease._at_risk_error()


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
        return self._wrap(await self._client._acquire(run_id, ttl_ms, lock_delay_ms))

    def _wrap(self, lease: Lease) -> SyncLease:
        """The SyncLease of a lease (on the loop thread)."""
        sync = self._leases.get(lease)
        if sync is None:
            sync = SyncLease(self._portal, lease)
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
        wanted = tuple(parse_status(s) for s in statuses)
        return self._pages(wanted, owner, page_size)

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

    def _pages(
        self, statuses: tuple[RunStatus, ...], owner: str | None, page_size: int
    ) -> Iterator[RunRecord]:
        token = ""
        while True:
            records: builtins.list[RunRecord]
            records, token, _ = self._portal.run(
                self._client._list_page(statuses, owner, page_size, token)
            )
            yield from records
            if not token:
                return

    def cancel(self, run_id: str, message: str | None = None) -> RunRecord:
        return self._portal.run(self._client.cancel(run_id, message))

    def request_resume(self, run_id: str) -> RunRecord:
        return self._portal.run(self._client.request_resume(run_id))

    def delete(self, run_id: str) -> DeleteResult:
        return self._portal.run(self._client.delete(run_id))

    def validate_fence(self, run_id: str, fencing_token: int) -> FenceStatus:
        return self._portal.run(self._client.validate_fence(run_id, fencing_token))

    def watch(
        self, run_ids: Iterable[str] = (), from_revision: int = 0
    ) -> Generator[WatchEvent, None, None]:
        """A blocking iterator over ``Client.watch`` (same behaviour: resumes by
        itself, raises ``RevisionCompactedError``). ``close()`` it, or break out
        of the loop, to end the watch; closing the client ends it too."""
        if from_revision < 0:
            raise ValueError(f"from_revision must be >= 0 (got {from_revision})")
        return self._events(builtins.list(run_ids), from_revision)

    def _events(
        self, run_ids: builtins.list[str], from_revision: int
    ) -> Generator[WatchEvent, None, None]:
        agen = self._client.watch(run_ids, from_revision)

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
