"""The blocking facade: ``SyncClient`` drives an async ``Client`` on a private
event-loop thread (anyio's blocking-portal habit), with the same method names
and signatures. It refuses to be used from inside a running event loop, where
blocking would stall that loop: use ``fencepost.Client`` there.
"""

from __future__ import annotations

import asyncio
import builtins
import threading
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc

from ._client import (
    DEFAULT_ADDRESS,
    DEFAULT_RETRY,
    DEFAULT_TTL_MS,
    Client,
    Lease,
    merge_channel_options,
)
from ._records import DeleteResult, FenceStatus, RunRecord, RunStatus, parse_status
from ._retry import RetryPolicy
from .v1 import ledger_pb2_grpc, run_store_pb2_grpc

T = TypeVar("T")


def _refuse_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        "fencepost.SyncClient blocks, so it cannot be used inside a running event loop; "
        "use fencepost.Client (async) there"
    )


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
                raise RuntimeError("the client is closed")
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
                await asyncio.wait(tasks)

        asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@dataclass(frozen=True, slots=True)
class SyncStubs:
    """The raw generated blocking stubs (escape hatch of ``SyncClient``)."""

    ledger: ledger_pb2_grpc.LedgerStub
    run_store: run_store_pb2_grpc.RunStoreStub


class SyncLease:
    """The blocking twin of ``Lease``; also a context manager that releases the
    lease on exit unless it was finished, suspended, released or lost.
    ``lost`` is a ``threading.Event``."""

    def __init__(self, portal: _Portal, lease: Lease) -> None:
        self._portal = portal
        self._lease = lease
        self._lost = threading.Event()
        portal.run(self._watch_lost())

    async def _watch_lost(self) -> None:
        self._lease._on_lost(self._lost.set)

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


class SyncClient:
    """Blocking client with the same methods as ``Client``. ``acquire``
    acquires at once and returns a ``SyncLease`` (also a context manager)."""

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
        _refuse_running_loop()
        self._client = Client(
            address, owner=owner, default_ttl_ms=default_ttl_ms, retry=retry,
            channel_options=channel_options, interceptors=interceptors,
        )
        self._channel_options = merge_channel_options(channel_options)
        self._sync_channel: grpc.Channel | None = None
        self._sync_stubs: SyncStubs | None = None
        self._lock = threading.Lock()
        self._portal = _Portal()

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

    @property
    def address(self) -> str:
        return self._client.address

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
    def stubs(self) -> SyncStubs:
        """Raw blocking stubs on a separate channel to the same address."""
        with self._lock:
            if self._client.closed:
                raise RuntimeError("the client is closed")
            if self._sync_stubs is None:
                self._sync_channel = grpc.insecure_channel(
                    self._client.address, options=self._channel_options
                )
                self._sync_stubs = SyncStubs(
                    ledger=ledger_pb2_grpc.LedgerStub(self._sync_channel),
                    run_store=run_store_pb2_grpc.RunStoreStub(self._sync_channel),
                )
            return self._sync_stubs

    def acquire(
        self, run_id: str, *, ttl_ms: int | None = None, lock_delay_ms: int = 0
    ) -> SyncLease:
        lease = self._portal.run(self._client._acquire(run_id, ttl_ms, lock_delay_ms))
        return SyncLease(self._portal, lease)

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

    def _pages(
        self, statuses: tuple[RunStatus, ...], owner: str | None, page_size: int
    ) -> Iterator[RunRecord]:
        token = ""
        while True:
            records: builtins.list[RunRecord]
            records, token = self._portal.run(
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
