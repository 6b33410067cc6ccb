"""Background lease renewal, behind a small seam.

The client talks to a ``Renewer`` only through ``start(lease)``,
``stop(lease)`` and ``aclose()``; a renewer sees a lease only as a
``KeptLease`` (what it reads of it and tells it), and the stream renewer
sees the client's connection only as a ``Route`` (where to open its stream,
and how to follow the leader). Three implementations:

- ``StreamRenewer`` (the default): one KeepAlive stream per client carries
  the renewals of all its leases, each at a third of its ttl, and brings back
  ``renewed`` (safe-until), ``lost`` and ``expiring`` pushes (docs/SPEC.md §6.1,
  docs/STREAMS.md). When the stream drops it reconnects with jittered
  exponential backoff, sends ``hello`` and renews (or tracks) every lease it
  keeps: the answers tell which are still held, and ``lost`` what was missed.
  While it is down nothing is sent: leases live by their ttl, and each
  lease's safe-until keeps counting down. With several endpoints the new
  stream goes to the leader: a standby's NOT_LEADER names it (reconnected at
  once), a stream that could not be opened or broke moves to the next
  endpoint (``_endpoints``), and so does one whose renewals go unanswered
  for a third of their ttl (a coordinator frozen, or cut off without its
  connection closing); the leader a takeover made has kept (extended) every
  live lease, and the renewals sent on reconnect say so.
- ``RoutedRenewer`` (what a ``Client`` uses for "stream"): the
  ``StreamRenewer`` of the client's endpoints, and once the connection
  routes (a coordinator answered NOT_OWNER: it leads only some shards), one
  more per shard owner, each lease on the stream of its shard's owner. A
  renewal refused with NOT_OWNER (its shard moved) takes the lease off that
  stream and onto the owner named; the lease is not lost.
- ``UnaryRenewer``: one task per lease calling the unary ``Renew`` every ttl/3
  (etcd's habit). Loss is learned from a refused renewal.
- ``NoRenewer`` (``Client(renewal="off")``): renews nothing; the caller
  renews its leases itself (``lease.renew()``).

Every task has an owner: the renewer keeps it until ``stop`` or ``aclose``
cancels and awaits it.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from ._errors import (
    FencepostError,
    LeaseLostError,
    NotOwnerError,
    StorageUnavailableError,
    UnavailableError,
    from_rpc_error,
)
from ._records import LostReason, RunRecord, lost_reason_from_pb, record_from_pb, time_from_pb
from ._retry import RetryPolicy
from .v1 import ledger_pb2 as pb
from .v1 import ledger_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._connection import Connection
    from ._endpoints import Endpoint

log = logging.getLogger("fencepost.renewal")

# Per-run stream errors worth retrying at the next interval; any other one
# stops the renewals of that lease (it is still tracked for `lost`).
_TRANSIENT_CODES = frozenset({"STORAGE_UNAVAILABLE", "STORAGE_FULL"})
# Floor of the reconnect delay, whatever the ttls (seconds).
_MIN_RECONNECT_S = 0.01


class KeptLease(Protocol):
    """What a renewer reads of a lease, and what it tells it."""

    @property
    def run_id(self) -> str: ...
    @property
    def fencing_token(self) -> int: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def is_active(self) -> bool: ...
    @property
    def is_lost(self) -> bool: ...
    @property
    def safe_until(self) -> float: ...

    def renewed(self, sent_at: float, ttl_remaining_ms: float, expires_at: datetime) -> None:
        """A renewal sent at ``sent_at`` (monotonic) was answered."""

    def expiring(self, expires_at: datetime) -> None:
        """The server says the lease passed ``expires_at`` with no renewal."""

    def mark_lost(self, record: RunRecord | None, reason: LostReason | None) -> None:
        """The fence moved (a ``lost`` answer or push)."""

    async def renew_once(self, policy: RetryPolicy) -> None:
        """One unary Renew at the lease's ttl (``LeaseLostError`` when refused so)."""


class Route(Protocol):
    """What the stream renewer needs of the client's connection: the
    endpoint to open its stream on, and how to follow the leader."""

    @property
    def current(self) -> Endpoint: ...
    def __len__(self) -> int: ...
    async def reachable(self, endpoint: Endpoint, timeout_s: float | None) -> float | None: ...
    def answered(self, endpoint: Endpoint) -> None: ...
    def after_failure(self, endpoint: Endpoint, exc: FencepostError) -> bool: ...


class Line(Protocol):
    """What the stream renewer is handed: a connection with its ``Route``."""

    @property
    def endpoints(self) -> Route: ...


def open_keepalive(endpoint: Endpoint) -> Any:
    """A new KeepAlive call (write()/read() style) on ``endpoint``."""
    return endpoint.stub(ledger_pb2_grpc.LedgerStub).KeepAlive()  # type: ignore[call-arg]


class Renewer(Protocol):
    def start(self, lease: KeptLease, *, tracked_on: str = "") -> None:
        """Begin keeping ``lease`` alive (idempotent). ``tracked_on``: the
        server already tracks it on the KeepAlive stream of that name."""

    def stream_name(self, run_id: str = "") -> str:
        """The name of the open KeepAlive stream ``run_id``'s lease would be
        renewed on, for AcquireRequest.track_on (empty: none is open)."""

    async def stop(self, lease: KeptLease, *, untrack: bool = True) -> None:
        """Stop renewing ``lease`` and wait until no renewal is in flight.
        ``untrack=False``: the caller is about to drop the lease with a command
        of its own (finish, release, suspend), whose commit ends the server's
        tracking by itself, so no message need say so."""

    async def aclose(self) -> None:
        """Stop every renewal; ``start`` does nothing afterwards."""

    def statistics(self) -> tuple[int, int, int, int]:
        """(streams opened, messages sent, scheduler passes, leases kept)."""


class NoRenewer:
    """``renewal="off"``: keeps nothing alive; the caller renews by itself."""

    def stream_name(self, run_id: str = "") -> str:
        return ""

    def start(self, lease: KeptLease, *, tracked_on: str = "") -> None:
        pass

    async def stop(self, lease: KeptLease, *, untrack: bool = True) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def statistics(self) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0)


class UnaryRenewer:
    """One task per lease, calling the unary ``Renew`` every ttl/3.

    - RUN_LEASE_LOST: the lease's ``lost`` event is set (by the fenced call)
      and renewal stops.
    - No answer (UNAVAILABLE, deadline, STORAGE_UNAVAILABLE): keep trying,
      with backoff bounded by ttl/3, until told to stop.
    - Any other refusal (terminal, not running...): renewal stops.
    """

    def __init__(self, retry: RetryPolicy) -> None:
        self._retry = retry
        self._tasks: dict[KeptLease, asyncio.Task[None]] = {}
        self._closed = False

    def stream_name(self, run_id: str = "") -> str:
        return ""  # no KeepAlive stream: nothing to track on

    def statistics(self) -> tuple[int, int, int, int]:
        return (0, 0, 0, len(self._tasks))

    def start(self, lease: KeptLease, *, tracked_on: str = "") -> None:
        if self._closed or lease in self._tasks:
            return
        self._tasks[lease] = asyncio.create_task(
            self._run(lease), name=f"fencepost-renew:{lease.run_id}"
        )

    async def stop(self, lease: KeptLease, *, untrack: bool = True) -> None:
        task = self._tasks.pop(lease, None)
        if task is not None:
            task.cancel()
            # asyncio.wait does not raise the task's cancellation into us, but
            # our own cancellation still propagates.
            await asyncio.wait({task})

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self, lease: KeptLease) -> None:
        interval = lease.ttl_ms / 3000
        backoff = self._retry.backoffs()
        delay = interval
        while True:
            await asyncio.sleep(delay)
            if lease.is_lost or not lease.is_active:
                return
            interval = lease.ttl_ms / 3000
            try:
                await lease.renew_once(RetryPolicy.no_retry(max(interval, 0.1)))
            except LeaseLostError:
                log.warning("lease on %r lost (token %d)", lease.run_id, lease.fencing_token)
                return
            except (UnavailableError, StorageUnavailableError) as exc:
                delay = min(backoff.next(), interval)
                log.info("renewal of %r got no answer (%s); retrying", lease.run_id, exc)
                continue
            except FencepostError as exc:
                log.warning("renewal of %r stopped: %s", lease.run_id, exc)
                return
            except Exception:
                log.exception("renewal of %r crashed", lease.run_id)
                return
            backoff = self._retry.backoffs()
            delay = interval


Key = tuple[str, int]  # (run_id, fencing_token): one handle


@dataclass(eq=False)
class _Entry:
    lease: KeptLease
    next_renew: float = 0.0  # monotonic time the next renewal is due
    renewing: bool = True  # False: only tracked (renewal refused for good)
    sent: bool = False  # has been on a stream: renew it on reconnect

    @property
    def key(self) -> Key:
        return (self.lease.run_id, self.lease.fencing_token)


class _Stalled(Exception):
    """The stream's coordinator stopped answering renewals (``_check_stalled``)."""


_MAX_RENEWS_PER_MESSAGE = 2048
_COALESCE_S = 0.05  # renewals due within this window are sent together


class StreamRenewer:
    """Every lease of one client over one KeepAlive stream (see the module docs).

    One manager task owns the stream; each connection runs three tasks that
    the manager awaits: a reader (dispatches the server's messages), a
    writer (the only one to call ``write``, fed by a queue, which stamps each
    renewal with its send time) and a scheduler (renewals due at ttl/3, kept
    in a heap).
    """

    def __init__(
        self,
        connection: Line,
        owner: str,
        retry: RetryPolicy,
        *,
        on_moved: Callable[[KeptLease, NotOwnerError], None] | None = None,
    ) -> None:
        self._route = connection.endpoints
        # told of a lease whose renewal was refused NOT_OWNER (taken off here)
        self._on_moved = on_moved
        self._owner = owner
        self._retry = retry
        self._entries: dict[Key, _Entry] = {}
        # Send times of this stream's renewals not answered yet, per handle,
        # oldest first: the server answers each renew once (renewed, lost or
        # error), in the order sent. Kept apart from the entries so that a
        # handle stopped and started again still pairs each answer with its
        # own send time.
        self._pending: dict[Key, collections.deque[float]] = {}
        self._per_run: collections.Counter[str] = collections.Counter()
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = itertools.count()
        self._outbox: asyncio.Queue[tuple[pb.KeepAliveRequest, _Entry | None]] | None = None
        self._wake = asyncio.Event()  # the scheduler: something is due earlier
        # when the scheduler wakes (-inf while it is not waiting), and the
        # timer that wakes it: a lease due earlier moves the timer, one due
        # later needs nothing (a wake-up per acquire, in a process of many
        # clients, was a task switch per client per run)
        self._sleep_until = -math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._has_entries = asyncio.Event()  # the manager: something to keep alive
        self._task: asyncio.Task[None] | None = None
        self._answered = False
        self._closed = False
        self.sessions = 0  # streams opened so far (diagnostics, tests)
        self.messages = 0  # messages written on them (diagnostics, tests)
        self.passes = 0  # the scheduler's passes over due leases (diagnostics, tests)
        # each stream's name (KeepAliveHello.stream_name): this client's prefix
        # and the stream's number, so that an acquire names the very stream
        self._name_prefix = os.urandom(12).hex()
        self._name = ""  # the open stream's, or ""

    # -- the Renewer seam ---------------------------------------------------------------

    def stream_name(self, run_id: str = "") -> str:
        return self._name

    def statistics(self) -> tuple[int, int, int, int]:
        return (self.sessions, self.messages, self.passes, len(self._entries))

    def start(self, lease: KeptLease, *, tracked_on: str = "") -> None:
        if self._closed or not lease.is_active:
            return
        entry = _Entry(lease)
        if entry.key in self._entries:
            return
        self._entries[entry.key] = entry
        self._per_run[lease.run_id] += 1
        # a third of the ttl after the send of the renewal that set safe-until
        ttl_s = lease.ttl_ms / 1000
        now = time.monotonic()
        due = lease.safe_until - 2 * ttl_s / 3
        entry.next_renew = min(max(due, now), now + ttl_s / 3)
        heapq.heappush(self._heap, (entry.next_renew, next(self._seq), entry.key))
        if tracked_on and tracked_on == self._name:
            entry.sent = True  # the acquire's commit tracked it on this very stream
        elif self._outbox is not None:
            self._send_track(entry)
        if entry.next_renew < self._sleep_until:
            self._sleep(entry.next_renew)
        self._has_entries.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fencepost-keepalive")

    async def stop(self, lease: KeptLease, *, untrack: bool = True) -> None:
        """Stop renewing and tracking ``lease``. Renewals already sent may still
        be committed before a command that drops the lease, never after it (the
        fence refuses them); their answers are ignored.

        ``untrack=False`` before the holder's own finish, release or suspend:
        the server stops tracking a lease its holder drops (without a `lost`
        push) in the commit that drops it, so the `untrack` message would only
        cost both sides a message per run. Until that commit the server may
        still push about the lease; pushes for a lease no longer here are
        ignored. If the command is refused, ``start`` tracks it again."""
        entry = self._entries.pop((lease.run_id, lease.fencing_token), None)
        if entry is None:
            return
        self._forget_run(lease.run_id)
        if self._outbox is None:
            return
        if self._per_run[lease.run_id]:
            # another handle of this client on the same run (the server tracks
            # one per run and stream): keep that one tracked
            for other in self._entries.values():
                if other.lease.run_id == lease.run_id:
                    self._send_track(other)
        elif untrack:
            self._outbox.put_nowait(
                (pb.KeepAliveRequest(untrack=pb.KeepAliveUntrack(run_id=lease.run_id)), None)
            )

    async def aclose(self) -> None:
        """Drop the stream (which revokes nothing) and stop every renewal."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        self._entries.clear()
        self._per_run.clear()
        self._heap.clear()

    # -- bookkeeping ---------------------------------------------------------------------

    def _forget_run(self, run_id: str) -> None:
        self._per_run[run_id] -= 1
        if self._per_run[run_id] <= 0:
            del self._per_run[run_id]
        if not self._entries:
            self._has_entries.clear()

    def _drop(self, key: Key) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._forget_run(key[0])
        return entry

    def _send_renew(self, entry: _Entry, now: float) -> None:
        assert self._outbox is not None
        lease = entry.lease
        msg = pb.KeepAliveRequest(renew=pb.KeepAliveRenew(
            run_id=lease.run_id, fencing_token=lease.fencing_token, lease_ttl_ms=lease.ttl_ms))
        self._outbox.put_nowait((msg, entry))
        entry.sent = True
        entry.next_renew = now + lease.ttl_ms / 3000
        heapq.heappush(self._heap, (entry.next_renew, next(self._seq), entry.key))

    def _send_track(self, entry: _Entry) -> None:
        assert self._outbox is not None
        lease = entry.lease
        msg = pb.KeepAliveRequest(track=pb.KeepAliveTrack(
            run_id=lease.run_id, fencing_token=lease.fencing_token))
        self._outbox.put_nowait((msg, None))
        entry.sent = True

    def _reconnect_delay_cap(self) -> float:
        """Reconnect well within the shortest ttl kept alive."""
        cap = self._retry.max_backoff_s
        if self._entries:
            shortest = min(e.lease.ttl_ms for e in self._entries.values()) / 1000
            cap = min(cap, shortest / 4)
        return max(cap, _MIN_RECONNECT_S)

    # -- the manager -----------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = self._retry.backoffs()
        hops = 0  # reconnects straight to a named leader, in a row
        while True:
            await self._has_entries.wait()
            started = time.monotonic()
            self._answered = False
            endpoint = self._route.current
            failure: FencepostError | None = None
            try:
                await self._session(endpoint)
                log.info("KeepAlive stream closed by the server; reconnecting")
            except grpc.RpcError as err:
                failure = from_rpc_error(err, mutation=False)
                log.info("KeepAlive stream dropped (%s); reconnecting", failure)
            except FencepostError as exc:  # no connection to it (``Endpoints.reachable``)
                failure = exc
                log.info("KeepAlive stream not opened (%s); trying elsewhere", exc)
            except _Stalled as exc:
                failure = UnavailableError(str(exc), code="UNAVAILABLE",
                                           grpc_code=grpc.StatusCode.UNAVAILABLE)
                log.warning("KeepAlive stream stalled (%s); reconnecting elsewhere", exc)
            except (OSError, RuntimeError, asyncio.InvalidStateError) as exc:
                log.info("KeepAlive stream failed (%r); reconnecting", exc)
            except Exception:
                log.exception("KeepAlive stream crashed; reconnecting")
            # a standby, or an endpoint gone: the next stream goes elsewhere
            at_once = failure is not None and self._route.after_failure(endpoint, failure)
            if at_once and hops < len(self._route):
                hops += 1
                await asyncio.sleep(_MIN_RECONNECT_S)
                continue
            hops = 0
            if self._answered or time.monotonic() - started > self._retry.max_backoff_s:
                backoff = self._retry.backoffs()  # it had worked: start over
            await asyncio.sleep(min(backoff.next(), self._reconnect_delay_cap()))

    async def _session(self, endpoint: Endpoint) -> None:
        """One stream to ``endpoint``: hello, renew or track every lease, then
        run until it ends."""
        await self._route.reachable(endpoint, None)
        call: Any = open_keepalive(endpoint)  # write()/read()
        self.sessions += 1
        outbox: asyncio.Queue[tuple[pb.KeepAliveRequest, _Entry | None]] = asyncio.Queue()
        name = f"{self._name_prefix}-{self.sessions}"
        outbox.put_nowait((pb.KeepAliveRequest(
            hello=pb.KeepAliveHello(owner=self._owner, stream_name=name)), None))
        self._outbox = outbox
        self._name = name
        self._pending.clear()  # answers of a dead stream never come
        now = time.monotonic()
        for entry in list(self._entries.values()):
            if not entry.lease.is_active:
                self._drop(entry.key)
            elif entry.renewing and (entry.sent or entry.next_renew <= now):
                self._send_renew(entry, now)  # a reconnect: which do we still hold?
            else:
                self._send_track(entry)
        tasks = [
            asyncio.create_task(self._read(call, endpoint), name="fencepost-keepalive-read"),
            asyncio.create_task(self._write(call, outbox), name="fencepost-keepalive-write"),
            asyncio.create_task(self._schedule(), name="fencepost-keepalive-schedule"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._outbox = None
            self._name = ""
            call.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)
        # Take every task's exception (a standby's refusal ends the reader and
        # the writer together), and raise the first to end.
        failures = [exc for t in (*done, *tasks)
                    if not t.cancelled() and (exc := t.exception()) is not None]
        if failures:
            raise failures[0]

    async def _write(
        self, call: Any, outbox: asyncio.Queue[tuple[pb.KeepAliveRequest, _Entry | None]]
    ) -> None:
        """Send the outbox in order. Renewals queued together (all those due in
        one scheduling pass) go out as one message's `renews`: a message costs
        the server far more than a renewal does."""
        while True:
            queued = [await outbox.get()]
            while not outbox.empty() and len(queued) < _MAX_RENEWS_PER_MESSAGE:
                queued.append(outbox.get_nowait())
            renews: list[pb.KeepAliveRenew] = []
            for msg, entry in queued:
                if entry is not None:
                    key = entry.key
                    if self._entries.get(key) is not entry:
                        continue  # stopped or lost since it was queued
                    # t_sent, taken before the renewal can possibly be answered
                    self._pending.setdefault(key, collections.deque()).append(time.monotonic())
                if msg.WhichOneof("kind") == "renew":
                    renews.append(msg.renew)
                    continue
                if renews:  # keep the order: renewals queued before this message
                    await self._send(call, pb.KeepAliveRequest(renews=renews))
                    renews = []
                await self._send(call, msg)
            if len(renews) == 1:
                await self._send(call, pb.KeepAliveRequest(renew=renews[0]))
            elif renews:
                await self._send(call, pb.KeepAliveRequest(renews=renews))

    async def _send(self, call: Any, msg: pb.KeepAliveRequest) -> None:
        self.messages += 1
        await call.write(msg)

    async def _schedule(self) -> None:
        heap = self._heap
        while True:
            now = time.monotonic()
            self.passes += 1
            # renew what falls due within the next moment too: a little early is
            # harmless and lets scattered leases share one message. Each lease is
            # looked at once per pass, and early by at most half its interval:
            # a ttl shorter than the window must not be renewed again and again
            # in one pass (that pass would never yield to the loop).
            handled: set[Key] = set()
            later: list[tuple[float, int, Key]] = []
            while heap and heap[0][0] <= now + _COALESCE_S:
                item = heapq.heappop(heap)
                when, _, key = item
                entry = self._due(item)
                if entry is None:
                    continue  # stale heap item
                if not entry.lease.is_active:
                    self._drop(key)  # lost through a fenced call, say
                    continue
                if key in handled or when > now + min(_COALESCE_S, entry.lease.ttl_ms / 6000):
                    later.append(item)  # not this pass
                    continue
                handled.add(key)
                if self._pending.get(key):
                    # the last renewal is still unanswered: another would only
                    # queue behind it on a busy server; look again shortly
                    self._check_stalled(entry, now - self._pending[key][0])
                    entry.next_renew = now + min(entry.lease.ttl_ms / 12_000, 0.25)
                    heapq.heappush(heap, (entry.next_renew, next(self._seq), key))
                    continue
                self._send_renew(entry, now)
            for item in later:
                heapq.heappush(heap, item)
            # no wake-up for a lease stopped since (most are, in a process that
            # runs many short runs): sleep until the first one still held
            while heap and self._due(heap[0]) is None:
                heapq.heappop(heap)
            self._wake.clear()
            self._sleep(heap[0][0] if heap else math.inf)
            try:
                await self._wake.wait()
            finally:
                self._sleep_until = -math.inf
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None

    def _sleep(self, until: float) -> None:
        """Have the waiting scheduler woken at ``until`` (monotonic; inf: only
        by a lease started since)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._sleep_until = until
        if until != math.inf:
            delay = max(until - time.monotonic(), 0.0)
            self._timer = asyncio.get_running_loop().call_later(delay, self._wake.set)

    def _due(self, item: tuple[float, int, Key]) -> _Entry | None:
        """The entry a heap item schedules, None when the item is stale (its
        lease stopped, or rescheduled since)."""
        entry = self._entries.get(item[2])
        if entry is None or entry.next_renew != item[0] or not entry.renewing:
            return None
        return entry

    def _check_stalled(self, entry: _Entry, waited_s: float) -> None:
        """With several endpoints, a renewal unanswered for a third of its
        ttl means the stream's coordinator stopped answering without closing
        the connection (a frozen process, packets dropped on the way): end
        the stream, so the next one goes to another endpoint while the lease
        is still safe. A lone endpoint keeps its stream (reconnecting to the
        same server would only queue the renewals again)."""
        if len(self._route) > 1 and waited_s >= entry.lease.ttl_ms / 3000:
            raise _Stalled(f"a renewal of {entry.lease.run_id!r} got no answer for "
                           f"{waited_s:.1f} s")

    async def _read(self, call: Any, endpoint: Endpoint) -> None:
        while True:
            resp = await call.read()
            if resp is grpc.aio.EOF:  # type: ignore[attr-defined]
                return
            if not self._answered:
                self._answered = True
                self._route.answered(endpoint)
            for one in resp.batch or (resp,):  # the server coalesces answers
                try:
                    self._dispatch(one)
                except Exception:
                    log.exception("could not handle %s", one.WhichOneof("kind"))

    def _answered_renewal(self, key: Key) -> float | None:
        """The send time of the oldest unanswered renewal of ``key``, now answered."""
        sent = self._pending.get(key)
        if not sent:
            return None
        sent_at = sent.popleft()
        if not sent:
            del self._pending[key]
        return sent_at

    def _moved_off(self, e: pb.KeepAliveError) -> None:
        """A renewal or track refused NOT_OWNER: the run's shard is led
        elsewhere. Its leases leave this stream (still held) for the owner."""
        assert self._on_moved is not None
        for key in [k for k in self._entries if k[0] == e.run_id]:
            self._pending.pop(key, None)  # those renewals are all refused here
            entry = self._drop(key)
            if entry is None:
                continue
            log.info("renewal of %r: %s; renewing it there", e.run_id, e.message)
            self._on_moved(entry.lease, NotOwnerError(
                e.message, metadata=dict(e.metadata), grpc_code=grpc.StatusCode.UNAVAILABLE))

    def _dispatch(self, resp: pb.KeepAliveResponse) -> None:
        kind = resp.WhichOneof("kind")
        if kind == "renewed":
            r = resp.renewed
            key = (r.run_id, r.fencing_token)
            sent_at = self._answered_renewal(key)
            entry = self._entries.get(key)
            if entry is not None and sent_at is not None:
                entry.lease.renewed(sent_at, r.ttl_remaining_ms, time_from_pb(r.expires_at))
        elif kind == "lost":
            m = resp.lost
            key = (m.run_id, m.fencing_token)
            self._answered_renewal(key)  # a lost may answer a renew, or be pushed
            gone = self._drop(key)  # the server untracked it
            if gone is not None:
                record = record_from_pb(m.record) if m.HasField("record") else None
                gone.lease.mark_lost(record, lost_reason_from_pb(m.reason))
        elif kind == "expiring":
            x = resp.expiring
            entry = self._entries.get((x.run_id, x.fencing_token))
            if entry is not None:
                entry.lease.expiring(time_from_pb(x.expires_at))
        elif kind == "error":
            e = resp.error
            if e.code == NotOwnerError.code and self._on_moved is not None:
                self._moved_off(e)
                return
            for key in [k for k in self._pending if k[0] == e.run_id]:
                self._answered_renewal(key)  # that renewal was refused
                entry = self._entries.get(key)
                if entry is None:
                    break
                if e.code in _TRANSIENT_CODES:
                    log.info("renewal of %r not committed (%s: %s); retrying at the next "
                             "interval", e.run_id, e.code, e.message)
                else:
                    log.warning("renewal of %r refused (%s: %s); tracking it only",
                                e.run_id, e.code, e.message)
                    entry.renewing = False
                    if self._outbox is not None:
                        self._send_track(entry)
                break
            else:
                log.warning("KeepAlive error for %r: %s: %s", e.run_id, e.code, e.message)


class RoutedRenewer:
    """Leases over one KeepAlive stream per coordinator (module docs): the
    client's endpoints' ``StreamRenewer`` alone until the connection routes,
    then each lease on the ``StreamRenewer`` of its shard owner's line
    (made on first use, each with its own stream and task)."""

    def __init__(self, connection: Connection, owner: str, retry: RetryPolicy) -> None:
        self._connection = connection
        self._owner = owner
        self._retry = retry
        self._default = StreamRenewer(connection.line, owner, retry, on_moved=self._moved)
        self._others: dict[Any, StreamRenewer] = {}  # by line, once routing
        self._where: dict[KeptLease, StreamRenewer] = {}  # leases started once routing
        self._moving: dict[KeptLease, StreamRenewer] = {}  # refused NOT_OWNER, on the way
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def _renewer_for(self, run_id: str) -> StreamRenewer:
        line = self._connection.line_for(run_id)
        if line is self._connection.line:
            return self._default
        renewer = self._others.get(line)
        if renewer is None:
            renewer = self._others[line] = StreamRenewer(line, self._owner, self._retry,
                                                         on_moved=self._moved)
        return renewer

    def stream_name(self, run_id: str = "") -> str:
        if self._connection.router is None:
            return self._default.stream_name()
        return self._renewer_for(run_id).stream_name()

    def statistics(self) -> tuple[int, int, int, int]:
        totals = list(self._default.statistics())
        for renewer in self._others.values():
            totals = [a + b for a, b in zip(totals, renewer.statistics(), strict=True)]
        return totals[0], totals[1], totals[2], totals[3]

    def start(self, lease: KeptLease, *, tracked_on: str = "") -> None:
        if self._closed:
            return
        if self._connection.router is None:
            self._default.start(lease, tracked_on=tracked_on)
            return
        renewer = self._where.get(lease) or self._renewer_for(lease.run_id)
        self._where[lease] = renewer
        renewer.start(lease, tracked_on=tracked_on)

    async def stop(self, lease: KeptLease, *, untrack: bool = True) -> None:
        self._moving.pop(lease, None)
        renewer = self._where.pop(lease, None) or self._default
        await renewer.stop(lease, untrack=untrack)

    def _moved(self, lease: KeptLease, refusal: NotOwnerError) -> None:
        """A renewal of ``lease`` was refused NOT_OWNER (its renewer has let
        it go): learn the owner, and renew it there."""
        if self._closed:
            return
        was = self._where.pop(lease, None) or self._default
        self._moving[lease] = was
        task = asyncio.create_task(self._follow(lease, refusal, was),
                                   name=f"fencepost-keepalive-move:{lease.run_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _follow(self, lease: KeptLease, refusal: NotOwnerError,
                      was: StreamRenewer) -> None:
        try:
            await self._connection.learn(refusal)
        except Exception:
            log.exception("could not learn where %r is led", lease.run_id)
        renewer = self._renewer_for(lease.run_id)
        if renewer is was:  # nobody knows better yet: not again at once
            await asyncio.sleep(min(max(lease.ttl_ms / 12_000, _MIN_RECONNECT_S), 1.0))
        if self._moving.pop(lease, None) is None or self._closed or not lease.is_active:
            return  # stopped meanwhile (finished, released, the client closed)
        self._where[lease] = renewer
        renewer.start(lease)

    async def aclose(self) -> None:
        self._closed = True
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self._default.aclose()
        for renewer in self._others.values():
            await renewer.aclose()
