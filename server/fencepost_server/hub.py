"""KeepAlive sessions and WatchRuns subscriptions over the writer's change feed.

The hub knows no protobuf: it tells each KeepAlive session what happened to
the leases it tracks (``renewed``, ``lost`` with a reason, ``expiring``) and
offers each watch the changes (``Watch.offer``); rpc/keepalive.py and
rpc/watch.py turn those into messages.

Streams never touch the write path's database connection and never make the
writer wait: the writer calls ``FenceHub.on_changes`` after each commit, which
only looks up in-memory maps and puts messages on per-stream bounded queues.
A stream that cannot keep up is dropped with a clear status (its leases live
by their ttl; the client reconnects and re-tracks).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .clock import Clock
from .core import ledger as L
from .core.fence import fences
from .core.records import Record, Status, is_terminal
from .core.shards import shard_of
from .writer import ChangeEvent, Reads, Writer

log = logging.getLogger("fencepost.streams")

SESSION_QUEUE_LIMIT = 65_536


@dataclass(frozen=True)
class ClientLimits:
    """What one client may hold in the server through its streams
    (docs/SECURITY.md "Limits"): per connection and, with identities on,
    per principal over all of its connections."""

    max_queued_per_connection: int = 131_072
    max_queued_per_principal: int = 262_144
    max_tracked_per_connection: int = 100_000
    max_tracked_per_principal: int = 1_000_000


class LostReason(enum.IntEnum):
    """Why a tracked lease's fence is gone (ledger.proto's LostReason)."""

    TAKEN_OVER = 1
    CANCELLED = 2
    DELETED = 3
    FENCE_MOVED = 4
    FINISHED = 5


def lost_reason(record: Record | None, token: int, cause: type | None = None) -> LostReason:
    """Why the fence of a tracked (run, token) is gone, given the record now."""
    if record is None or cause in (L.DeleteRun, L.RawDelete, L.Retire):
        return LostReason.DELETED
    if cause is L.Cancel:
        return LostReason.CANCELLED
    if cause is L.Acquire:
        return LostReason.TAKEN_OVER
    if cause is L.Finish:
        return LostReason.FINISHED
    if cause in (L.RawCompareAndSet, L.RawCreate, L.Release, L.Suspend, L.RequestResume):
        return LostReason.FENCE_MOVED
    # learned late (track after the fact): derive from the record
    if record.status is Status.CANCELLED and record.fencing_token > token:
        return LostReason.CANCELLED
    if is_terminal(record.status):
        return LostReason.FINISHED
    if record.fencing_token != token and record.lease is not None:
        return LostReason.TAKEN_OVER
    return LostReason.FENCE_MOVED


# How a session tracks one run: (token, the lease owner at that token, the
# lease's expiry, whether `expiring` was sent for it, the deadline of its entry
# in the expiry heap, 0: none). A plain tuple of ints and strings, which the
# garbage collector stops tracking: with 100 000 leases, an object per lease
# would add 100 000 objects to every full collection's walk.
Tracked = tuple[int, str, int, bool, int]


class Stop:
    """Why a stream must end: set once, awaited by the stream's handler, which
    cancels its pump even when that pump is blocked on a full HTTP/2 window.
    An overflow names the limit it passed (``limit``: name, value)."""

    OVERFLOW = "overflow"
    SHUTDOWN = "shutdown"
    MOVED = "moved"  # a watched shard moved away (limit: ("shard", its index))

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: str | None = None
        self.limit: tuple[str, int] | None = None

    def set(self, reason: str, limit: tuple[str, int] | None = None) -> None:
        if self.reason is None:
            self.reason = reason
            self.limit = limit
            self.event.set()


class Budget:
    """What the open streams of one client hold: a connection (its gRPC peer)
    or, with identities on, a principal over all its connections. Every
    stream is charged to its connection's budget and its principal's."""

    __slots__ = ("key", "kind", "max_queued", "max_tracked", "queued", "streams", "tracked")

    def __init__(self, kind: str, key: str, max_queued: int, max_tracked: int) -> None:
        self.kind = kind  # "connection" or "principal"
        self.key = key
        self.max_queued = max_queued
        self.max_tracked = max_tracked
        self.queued = 0  # messages, events and results waiting for the client to read
        self.tracked = 0  # leases its KeepAlive streams track (renewals in flight too)
        self.streams: set[Buffered] = set()

    def overflow(self) -> None:
        """More queued than allowed: drop the stream that has queued the most
        (the slowest reader), not the one that happened to add the last item."""
        victim = max(self.streams, key=lambda s: s.queued)
        victim.overflow((f"max_queued_per_{self.kind}", self.max_queued))


class Buffered:
    """A stream's count of what it has queued for its client, charged to its
    own limit and to its budgets; past any of them the stream is dropped
    (STREAM_TOO_SLOW) and what it had queued is let go at once."""

    limit: int
    stop: Stop
    queued: int = 0
    budgets: tuple[Budget, ...] = ()
    hits: collections.Counter[str] | None = None  # the hub's: limits reached, by name

    def charge(self, n: int) -> bool:
        """Count ``n`` more queued items; False (the stream is stopped) past a limit."""
        if self.stop.reason is not None:
            return False
        if self.queued and self.queued + n > self.limit:
            # an empty queue takes one message, however many results it holds:
            # a reader that keeps up is never dropped for one commit's answers
            self.overflow(("max_queued_per_stream", self.limit))
            return False
        self.queued += n
        for b in self.budgets:
            b.queued += n
        for b in self.budgets:
            if b.queued > b.max_queued:
                b.overflow()
        return self.stop.reason is None

    def uncharge(self, n: int) -> None:
        """``n`` items left the queue for the client."""
        self.queued -= n
        for b in self.budgets:
            b.queued -= n

    def overflow(self, limit: tuple[str, int]) -> None:
        if self.stop.reason is None:
            if self.hits is not None:
                self.hits[limit[0]] += 1
            self.stop.set(Stop.OVERFLOW, limit)
        self.release()

    def release(self) -> None:
        """Let go of everything queued (the stream ends without sending it)."""
        self.uncharge(self.queued)
        self.clear()

    def clear(self) -> None:
        """Empty the stream's queue (each kind of stream its own)."""

    def drain(self) -> None:
        """The server is stopping: end the stream (a KeepAlive session or a
        watch at once, an Execute stream once it has answered what it took)."""
        raise NotImplementedError


_session_keys = itertools.count(1)


@dataclass(eq=False)
class Session(Buffered):
    """One KeepAlive stream, as the hub sees it: the leases it tracks, and
    the events it is told about them (rpc/keepalive.py says how each is sent)."""

    owner: str
    limit: int = SESSION_QUEUE_LIMIT
    tracked: dict[str, Tracked] = field(default_factory=dict)
    stop: Stop = field(default_factory=Stop)
    # runs not yet tracked whose renewal is with the writer (count toward the limit)
    renewing: set[str] = field(default_factory=set)
    # names the session in the expiry heap (an int: the heap's entries hold no object)
    key: int = field(default_factory=lambda: next(_session_keys))
    # the client's name for the stream (KeepAliveHello.stream_name), or ""
    name: str = ""

    def drain(self) -> None:
        self.stop.set(Stop.SHUTDOWN)

    # -- the events, each sent to the client as the transport says ----------------

    def renewed(self, run_id: str, token: int, expires_at: int, ttl_remaining_ms: int) -> None:
        """The session's renewal of (run, token) committed; the lease now
        expires at ``expires_at``."""
        raise NotImplementedError

    def lost(self, run_id: str, token: int, reason: LostReason, record: Record | None) -> None:
        """The fence of tracked (run, token) is gone; the run is no longer tracked."""
        raise NotImplementedError

    def expiring(self, run_id: str, token: int, expires_at: int) -> None:
        """Tracked (run, token) passed its expiry unrenewed (still tracked)."""
        raise NotImplementedError

    def count_tracked(self, n: int) -> None:
        """``n`` more (or fewer) runs tracked or being renewed, for the budgets."""
        for b in self.budgets:
            b.tracked += n

    def start_renewing(self, run_id: str) -> None:
        if run_id not in self.renewing:
            self.renewing.add(run_id)
            self.count_tracked(1)

    def done_renewing(self, run_id: str) -> None:
        if run_id in self.renewing:
            self.renewing.discard(run_id)
            self.count_tracked(-1)


class FenceHub:
    """Maps tracked (run, token) pairs to KeepAlive sessions; pushes `lost` on
    commits that move a fence and `expiring` when a tracked lease passes its
    expiry unrenewed."""

    def __init__(
        self,
        writer: Writer,
        clock: Clock,
        *,
        reads: Reads,
        expiry_poll_s: float = 0.02,
        queue_limit: int = SESSION_QUEUE_LIMIT,
        limits: ClientLimits | None = None,
    ) -> None:
        self.writer = writer
        self.reads = reads
        self.queue_limit = queue_limit
        self.limits = limits or ClientLimits()
        # (kind, key) -> the budget of a connection or principal with open streams
        self.budgets: dict[tuple[str, str], Budget] = {}
        # limits reached (a refused track, a dropped stream), by limit name (metrics.py)
        self.limit_hits: collections.Counter[str] = collections.Counter()
        self.clock = clock
        self.expiry_poll_s = expiry_poll_s
        # run id -> the session tracking it, or a set when several do (rare:
        # one set per run would be one more collected object per lease)
        self.by_run: dict[str, Session | set[Session]] = {}
        # (deadline, seq, run id, session key): at most one live entry per
        # tracked run (see _arm); the sessions with entries, by key
        self._deadlines: list[tuple[int, int, str, int]] = []
        self._armed: dict[int, Session] = {}
        self._seq = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._unsubscribe: list[Callable[[], None]] = []
        self.sessions: set[Session] = set()
        # KeepAliveHello.stream_name -> the open session it names
        self.named: dict[str, Session] = {}
        self.watchers: set[Watch] = set()
        # every open stream (KeepAlive, WatchRuns, Execute), drained at shutdown
        self.streams: set[Buffered] = set()
        # set by shutdown(): a stream opened after it ends at once too
        self.shut = False
        self._cold_reads: set[asyncio.Task[None]] = set()
        # `lost` pushes sent, by reason (metrics.py)
        self.lost_pushed: collections.Counter[LostReason] = collections.Counter()

    def start(self) -> None:
        self._unsubscribe = [self.writer.subscribe(self.on_changes),
                             self.writer.subscribe_renewals(self.on_renewed)]
        self._task = asyncio.create_task(self._expiry_loop(), name="fencepost-expiry")

    def shutdown(self) -> None:
        """End every stream with UNAVAILABLE (clients reconnect elsewhere/later)."""
        self.shut = True
        for stream in list(self.streams):
            stream.drain()

    def opened(self, stream: Buffered) -> None:
        """A stream just registered: one the server took as it began to stop
        (after shutdown() ended the open ones) ends at once too."""
        if self.shut:
            stream.drain()

    # -- budgets ----------------------------------------------------------------------

    def enter(self, stream: Buffered, peer: str, principal: str) -> None:
        """Charge ``stream`` to its connection's budget (``peer``: gRPC's
        ``context.peer()``) and, with identities on, its principal's."""
        lim = self.limits
        wanted = [("connection", peer, lim.max_queued_per_connection,
                   lim.max_tracked_per_connection)]
        if principal:
            wanted.append(("principal", principal, lim.max_queued_per_principal,
                           lim.max_tracked_per_principal))
        budgets = []
        for kind, key, max_queued, max_tracked in wanted:
            b = self.budgets.get((kind, key))
            if b is None:
                b = self.budgets[(kind, key)] = Budget(kind, key, max_queued, max_tracked)
            b.streams.add(stream)
            budgets.append(b)
        stream.budgets = tuple(budgets)
        stream.hits = self.limit_hits
        self.streams.add(stream)

    def leave(self, stream: Buffered) -> None:
        """The stream ended: let go of what it queued and tracked; a budget
        left without streams goes (its client's memory with it)."""
        self.streams.discard(stream)
        stream.release()
        if isinstance(stream, Session):
            stream.count_tracked(-len(stream.renewing) - len(stream.tracked))
        for b in stream.budgets:
            b.streams.discard(stream)
            if not b.streams:
                del self.budgets[(b.kind, b.key)]
        stream.budgets = ()

    def totals(self) -> tuple[int, int]:
        """(items queued for readers, leases tracked) over every open stream."""
        queued = tracked = 0
        for (kind, _), b in self.budgets.items():
            if kind == "connection":
                queued += b.queued
                tracked += b.tracked
        return queued, tracked

    async def close(self) -> None:
        self.shutdown()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # -- sessions ---------------------------------------------------------------------

    def track(self, session: Session, run_id: str, token: int) -> None:
        """Track (run, token) for the session, or push `lost` at once when the
        fence already moved."""
        rec = self.writer.state.runs.get(run_id)
        if not fences(rec, token):
            self.untrack(session, run_id)
            if rec is None and self.reads.is_cold(run_id):
                # a finished run memory no longer holds: say why once it is read
                task = asyncio.get_running_loop().create_task(
                    self._lost_cold(session, run_id, token)
                )
                self._cold_reads.add(task)
                task.add_done_callback(self._cold_reads.discard)
                return
            self.push_lost(session, run_id, token, lost_reason(rec, token), rec)
            return
        assert rec is not None and rec.lease is not None
        self._arm(session, run_id, token, rec.lease.owner, rec.lease.expires_at)

    async def _lost_cold(self, session: Session, run_id: str, token: int) -> None:
        try:
            rec = await self.reads.read_run(run_id)
        except Exception:  # the read failed: the fence is gone all the same
            log.exception("could not read run %r", run_id)
            rec = None
        if fences(rec, token):  # changed back meanwhile (cannot hold a token it had lost)
            self.track(session, run_id, token)
            return
        self.push_lost(session, run_id, token, lost_reason(rec, token), rec)

    def _arm(self, session: Session, run_id: str, token: int, owner: str, expires_at: int) -> None:
        """Track (run, token, owner) until ``expires_at``. The expiry heap gets
        an entry only when the run has none due at or before that time: a
        renewal moves the expiry later, and the earlier entry, when it comes
        due, re-arms at the expiry then current (check_expiry). So the heap
        holds one entry per tracked run however often it is renewed."""
        entry = session.tracked.get(run_id)
        scheduled = 0
        if entry is None:
            self._add_session(run_id, session)
            session.count_tracked(1)
        else:
            was_token, was_owner, was_expiry, _, was_scheduled = entry
            if was_token == token and was_owner == owner:
                if was_expiry == expires_at:
                    return  # already armed for this expiry (the change feed saw it first)
                scheduled = was_scheduled
        if not scheduled or scheduled > expires_at:
            scheduled = expires_at
            heapq.heappush(self._deadlines, (expires_at, next(self._seq), run_id, session.key))
            self._armed[session.key] = session
        session.tracked[run_id] = (token, owner, expires_at, False, scheduled)

    def _add_session(self, run_id: str, session: Session) -> None:
        have = self.by_run.get(run_id)
        if have is None:
            self.by_run[run_id] = session
        elif isinstance(have, set):
            have.add(session)
        elif have is not session:
            self.by_run[run_id] = {have, session}

    def untrack(self, session: Session, run_id: str) -> None:
        if session.tracked.pop(run_id, None) is not None:
            session.count_tracked(-1)
            have = self.by_run.get(run_id)
            if have is session:
                del self.by_run[run_id]
            elif isinstance(have, set):
                have.discard(session)
                if len(have) == 1:
                    self.by_run[run_id] = next(iter(have))

    def add(self, session: Session, name: str) -> None:
        """A new KeepAlive session; ``name`` (may be empty) lets acquires find it."""
        self.sessions.add(session)
        if name:
            session.name = name
            self.named[name] = session  # a reconnect takes the name over
        self.opened(session)

    def drop(self, session: Session) -> None:
        self.sessions.discard(session)
        if session.name and self.named.get(session.name) is session:
            del self.named[session.name]
        self._armed.pop(session.key, None)
        for run_id in list(session.tracked):
            self.untrack(session, run_id)

    def moved(self, shards: frozenset[int], run_ids: list[str]) -> None:
        """These shards, holding these runs, moved to another coordinator: every
        stream stops tracking the runs here without a word of loss (the lease
        moved with its shard; the client's next renewal is answered NOT_OWNER
        and follows it), and every watch of one of the shards ends NOT_OWNER."""
        for watch in list(self.watchers):
            if watch.shards is not None and not shards.isdisjoint(watch.shards):
                watch.stop.set(Stop.MOVED, ("shard", min(shards & watch.shards)))
        by_run = self.by_run
        for run_id in run_ids:
            sessions = by_run.get(run_id)
            if sessions is None:
                continue
            for session in list(sessions) if isinstance(sessions, set) else (sessions,):
                self.untrack(session, run_id)

    def renewed(self, session: Session, run_id: str, token: int) -> None:
        """A stream renewal's answer: tell the session `renewed`, unless a later
        commit already moved the fence (then `lost`). A lease the session did
        not track yet is tracked from here; a tracked lease's new expiry comes
        the one way every renewal's does: the writer's publication
        (``on_changes`` after a commit, ``on_renewed`` from memory)."""
        rec = self.writer.state.runs.get(run_id)
        if not fences(rec, token, session.owner):
            self.track(session, run_id, token)  # pushes lost
            return
        assert rec is not None and rec.lease is not None
        entry = session.tracked.get(run_id)
        if entry is None or entry[0] != token or entry[1] != session.owner:
            self._arm(session, run_id, token, session.owner, rec.lease.expires_at)
        expires_at = rec.lease.expires_at
        session.renewed(run_id, token, expires_at, max(0, expires_at - self.clock.now_ms()))

    # -- the change feed --------------------------------------------------------------

    def on_changes(self, events: list[ChangeEvent]) -> None:
        by_run = self.by_run
        for ev in events:
            sessions = by_run.get(ev.run_id)
            if sessions is not None:
                self._fence_event(ev, sessions)
        for watch in list(self.watchers):
            watch.offer(events)

    def on_renewed(self, run_id: str, rec: Record) -> None:
        """A renewal answered from memory makes no change event: every stream
        tracking the lease is re-armed for its new expiry here."""
        sessions = self.by_run.get(run_id)
        if sessions is None or rec.lease is None:
            return
        for session in list(sessions) if isinstance(sessions, set) else (sessions,):
            token, owner, expires_at, _, _ = session.tracked[run_id]
            if rec.lease.expires_at != expires_at and fences(rec, token, owner):
                self._arm(session, run_id, token, owner, rec.lease.expires_at)

    def _fence_event(self, ev: ChangeEvent, sessions: Session | set[Session]) -> None:
        rec = ev.record
        for session in list(sessions) if isinstance(sessions, set) else (sessions,):
            token, owner, expires_at, _, _ = session.tracked[ev.run_id]
            if fences(rec, token, owner):
                assert rec is not None and rec.lease is not None
                if rec.lease.expires_at != expires_at:
                    self._arm(session, ev.run_id, token, owner, rec.lease.expires_at)
                continue
            self.untrack(session, ev.run_id)
            own_drop = (
                rec is not None
                and rec.fencing_token == token
                and ev.cause in (L.Finish, L.Release, L.Suspend)
                and ev.previous is not None
                and ev.previous.lease is not None
                and ev.previous.lease.owner == session.owner
            )
            if own_drop:
                continue  # this worker's own handle finished/released/suspended it
            self.push_lost(session, ev.run_id, token, lost_reason(rec, token, ev.cause), rec)

    def push_lost(
        self, session: Session, run_id: str, token: int, reason: LostReason, rec: Record | None
    ) -> None:
        self.lost_pushed[reason] += 1
        session.lost(run_id, token, reason, rec)

    # -- expiry -------------------------------------------------------------------------

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.expiry_poll_s)
            try:
                self.check_expiry()
            except Exception:  # never let the loop die
                log.exception("expiry check failed")

    def check_expiry(self) -> None:
        now = self.clock.now_ms()
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            deadline, _, run_id, key = heapq.heappop(dl)
            session = self._armed.get(key)
            entry = session.tracked.get(run_id) if session is not None else None
            if session is None or entry is None:
                continue  # stale: the stream ended, or the run is no longer tracked
            token, owner, expires_at, sent, scheduled = entry
            if scheduled != deadline:
                continue  # stale: re-armed for an earlier deadline
            rec = self.writer.state.runs.get(run_id)
            if fences(rec, token, owner) and rec.lease.expires_at > expires_at:  # type: ignore[union-attr]
                expires_at = rec.lease.expires_at  # type: ignore[union-attr]  # renewed from memory
            if expires_at > now:  # renewed since: due again at the new expiry
                heapq.heappush(dl, (expires_at, next(self._seq), run_id, key))
                session.tracked[run_id] = (token, owner, expires_at, sent, expires_at)
                continue
            session.tracked[run_id] = (token, owner, expires_at, True, 0)
            if sent:
                continue
            session.expiring(run_id, token, expires_at)


# -- WatchRuns ------------------------------------------------------------------------------


class Watch(Buffered):
    """One WatchRuns subscriber: a bounded queue fed by the change feed. When
    the queue is full the watch is stopped (never the writer)."""

    def __init__(self, run_ids: frozenset[str], limit: int,
                 shards: frozenset[int] | None = None, count: int = 0) -> None:
        """``shards``: a watch by shards, of these among ``count`` (None: every run)."""
        self.run_ids = run_ids
        self.limit = limit
        self.shards = shards
        self.count = count
        self.queue: asyncio.Queue[ChangeEvent] = asyncio.Queue()
        # a watch by shards: each queued event's shard, in the queue's order
        self.shard_of: collections.deque[int] = collections.deque()
        self.stop = Stop()

    def drain(self) -> None:
        self.stop.set(Stop.SHUTDOWN)

    def offer(self, events: list[ChangeEvent]) -> None:
        if self.stop.reason is not None:
            return
        for ev in events:
            if self.run_ids and ev.run_id not in self.run_ids:
                continue
            shard = -1
            if self.shards is not None:
                shard = shard_of(ev.run_id, self.count)
                if shard not in self.shards:
                    continue
            if not self.charge(1):
                return
            if self.shards is not None:
                self.shard_of.append(shard)
            self.queue.put_nowait(ev)

    def clear(self) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
        self.shard_of.clear()

