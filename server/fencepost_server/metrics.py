"""Prometheus metrics of one coordinator (served at ``/metrics`` by web/dashboard.py).

Each ``App`` owns its own registry (several servers may share a process in
tests). Counters end in ``_total``, durations are ``_seconds`` histograms,
no label carries a run id or an owner. docs/OPERATIONS.md lists exactly
what is exposed (tests/service/test_metrics.py compares the two).

Lease counts follow the committed state (``LeaseCounts``): a scrape moves
only the leases whose expiry passed since the last one. An expiry is counted
once per lease that reached its expiry unrenewed, whether a scrape saw it
expired or a later change or renewal ended it first.
"""

from __future__ import annotations

import asyncio
import heapq
import platform
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .clock import Clock
from .core import ledger as L
from .core.records import TERMINAL, Record
from .hub import FenceHub, LostReason
from .writer import ChangeEvent, Writer

disable_created_metrics()  # no *_created series: nothing here needs them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
COMMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Long-lived streams, by method name (the rest are calls, or listings that end).
STREAM_KINDS = {"KeepAlive": "keepalive", "WatchRuns": "watch", "Execute": "execute"}
HTTP_REFUSALS = ("host", "origin", "unauthenticated", "permission_denied", "too_many_streams")
EVENT_DROPS = ("queue_full", "write_timeout")
CLIENT_KINDS = ("connection", "principal")
STREAM_LIMITS = tuple(f"max_{what}_per_{per}" for what in ("queued", "tracked")
                      for per in ("stream", "connection", "principal"))
# Leases a scrape moves (or a first count places) between two yields to the
# event loop: counting 100 000 leases in one go stalled every call for ~50 ms
LEASE_SCAN_CHUNK = 4096
# ...and how long it pauses after each chunk. Not sleep(0): a loop that is
# never idle never releases the GIL but at the interpreter's switch interval,
# and the writer thread, starved of it, took ~100 ms per batch during every
# scrape of 200,000 leases; a real pause lets the loop block in epoll, and the
# writer runs.
LEASE_SCAN_PAUSE_S = 0.001
# Width of the buckets of expiries a scrape visits: it reads only the leases
# of the bucket holding its own time, not those of later ones.
LEASE_BUCKET_MS = 256


def _lease_key(rec: Record) -> tuple[int, int, int]:
    lease = rec.lease
    assert lease is not None
    return rec.fencing_token, lease.expires_at, lease.expires_at + lease.lock_delay_ms


class LeaseCounts:
    """The leases of unfinished runs by state, kept as the writer's committed
    state moves: each change and each renewal from memory places its run's
    lease again (``reconcile``: against the committed record, so the order of
    the two feeds does not matter), and a count moves only the leases whose
    expiry or lock delay the time passed since the last one, found through
    buckets of expiries; a lease is counted in one dict of the three. The
    first count, and one after the committed state was replaced (a takeover's
    load) or the clock went back, builds them from every record. Loop thread."""

    def __init__(self, writer: Writer, clock: Clock) -> None:
        self.writer = writer
        self.clock = clock
        self.expiries = 0  # leases that reached their expiry unrenewed, each once
        self._state: object = None  # the committed state followed (None: not built)
        self._high = 0  # the latest time counted at
        self.live: dict[str, Record] = {}
        self.delay: dict[str, Record] = {}
        self.expired: dict[str, Record] = {}
        # bucket -> the live runs whose expiry is in it, and the buckets in a
        # heap; the same for the lock delays' ends of those in lock delay
        self._live_due: dict[int, set[str]] = {}
        self._live_keys: list[int] = []
        self._delay_due: dict[int, set[str]] = {}
        self._delay_keys: list[int] = []
        self._building: set[str] | None = None  # runs changed while a build runs
        # live leases a count saw expired before the clock went back: (token,
        # expiry) of each, not counted as expiries again
        self._again: dict[str, tuple[int, int]] = {}

    def counts(self) -> dict[str, int]:
        return {"live": len(self.live), "lock_delay": len(self.delay),
                "expired": len(self.expired)}

    # -- the feeds --------------------------------------------------------------

    def on_changes(self, events: list[ChangeEvent]) -> None:
        if self._building is not None or self.writer.state is self._state:
            for ev in events:
                self.reconcile(ev.run_id)
            return
        # not built yet (or the state was replaced): a change that ends a
        # lease past its expiry counts that expiry, as a built count would
        now = self.clock.now_ms()
        for ev in events:
            prev, rec = ev.previous, ev.record
            if prev is None or prev.lease is None or prev.status in TERMINAL:
                continue
            token, expires, _ = _lease_key(prev)
            if expires <= now and (rec is None or rec.lease is None
                                   or _lease_key(rec)[:2] != (token, expires)):
                self.expiries += 1

    def on_renewed(self, run_id: str, rec: Record) -> None:
        # the common case, once per renewal: a live lease renewed later stays
        # in its earlier bucket, which re-files it when due (``_drain``)
        old = self.live.get(run_id)
        if (old is not None and self._building is None and rec.lease is not None
                and old.fencing_token == rec.fencing_token
                and self.clock.now_ms() < old.lease.expires_at  # type: ignore[union-attr]
                <= rec.lease.expires_at  # type: ignore[union-attr]
                and self.writer.state.runs.get(run_id) is rec):
            self.live[run_id] = rec
            return
        self.reconcile(run_id)

    def reconcile(self, run_id: str) -> None:
        """Count ``run_id``'s lease as its committed record has it now. A lease
        that ended (a new token or expiry, or none) past its expiry, unseen by
        a count, counts as an expiry here."""
        if self._building is not None:
            self._building.add(run_id)
            return
        state = self.writer.state
        if state is not self._state:
            return  # not built, or replaced: the next count builds
        cur = state.runs.get(run_id)
        new = cur if cur is not None and cur.lease is not None and (
            cur.status not in TERMINAL) else None
        where = (self.live if run_id in self.live else self.delay if run_id in self.delay
                 else self.expired if run_id in self.expired else None)
        now = self.clock.now_ms()
        if where is not None:
            old = where[run_id]
            if new is not None and _lease_key(old) == _lease_key(new):
                where[run_id] = new  # the same lease on a new record
                return
            del where[run_id]
            token, expires, delay_end = _lease_key(old)
            if where is self.live:
                self._due_set(self._live_due, expires).discard(run_id)
                if expires <= now and (new is None or _lease_key(new)[:2] != (token, expires)):
                    self._expired_now(run_id, token, expires)
            elif where is self.delay:
                self._due_set(self._delay_due, delay_end).discard(run_id)
        if new is not None:
            self._place(run_id, new, now, None)

    def _place(self, run_id: str, rec: Record, now: int,
               counted: dict[str, Record] | None) -> None:
        """Count a lease in its state at ``now``; one already past its expiry
        counts as an expiry unless ``counted`` holds it (a build)."""
        token, expires, delay_end = _lease_key(rec)
        seen = counted.get(run_id) if counted is not None else None
        if seen is not None and _lease_key(seen)[:2] != (token, expires):
            seen = None
        if now < expires:
            self.live[run_id] = rec
            self._due(self._live_due, self._live_keys, expires, run_id)
            if seen is not None:
                self._again[run_id] = (token, expires)
            return
        if seen is None:
            self._expired_now(run_id, token, expires)
        if now < delay_end:
            self.delay[run_id] = rec
            self._due(self._delay_due, self._delay_keys, delay_end, run_id)
        else:
            self.expired[run_id] = rec

    def _expired_now(self, run_id: str, token: int, expires: int) -> None:
        """Count a lease that reached its expiry, unless it was counted before
        the clock went back."""
        if not self._again or self._again.pop(run_id, None) != (token, expires):
            self.expiries += 1

    @staticmethod
    def _due_set(due: dict[int, set[str]], at: int) -> set[str]:
        return due.get(at // LEASE_BUCKET_MS) or set()

    @staticmethod
    def _due(due: dict[int, set[str]], keys: list[int], at: int, run_id: str) -> None:
        bucket = at // LEASE_BUCKET_MS
        runs = due.get(bucket)
        if runs is None:
            runs = due[bucket] = set()
            heapq.heappush(keys, bucket)
        runs.add(run_id)

    # -- counting ---------------------------------------------------------------

    def count(self) -> Iterator[None]:
        """Bring the counts to now, yielding between chunks (the loop may run
        the feeds in between): a build, or the leases whose time passed."""
        now = self.clock.now_ms()
        if self._state is not self.writer.state or now < self._high:
            yield from self._build()
            return
        top = now // LEASE_BUCKET_MS
        yield from self._drain(self._live_keys, self._live_due, self.live, top, now, True)
        yield from self._drain(self._delay_keys, self._delay_due, self.delay, top, now, False)
        self._high = now

    def _drain(self, keys: list[int], due: dict[int, set[str]], held: dict[str, Record],
               top: int, now: int, live: bool) -> Iterator[None]:
        """Move the leases of ``held`` (live or in lock delay) whose expiry
        (or lock delay's end) is at or before ``now``: every one of the
        buckets before ``now``'s, those due of ``now``'s own."""
        while keys and keys[0] <= top:
            bucket = keys[0]
            runs = due.get(bucket)
            if not runs:
                heapq.heappop(keys)
                due.pop(bucket, None)
                continue
            ids = list(runs)
            for i in range(0, len(ids), LEASE_SCAN_CHUNK):
                for run_id in ids[i:i + LEASE_SCAN_CHUNK]:
                    if run_id not in runs:
                        continue  # moved by a feed meanwhile
                    rec = held.get(run_id)
                    if rec is None:  # left by a renewal's later bucket: gone since
                        runs.discard(run_id)
                        continue
                    _, expires, delay_end = _lease_key(rec)
                    if (expires if live else delay_end) > now:
                        if (expires if live else delay_end) // LEASE_BUCKET_MS != bucket:
                            runs.discard(run_id)  # renewed since it was filed here
                            self._due(due, keys, expires if live else delay_end, run_id)
                        continue
                    runs.discard(run_id)
                    del held[run_id]
                    if not live:
                        self.expired[run_id] = rec
                        continue
                    self._expired_now(run_id, rec.fencing_token, expires)
                    if now < delay_end:
                        self.delay[run_id] = rec
                        self._due(self._delay_due, self._delay_keys, delay_end, run_id)
                    else:
                        self.expired[run_id] = rec
                if i + LEASE_SCAN_CHUNK < len(ids):
                    yield
            if bucket == top:
                break
            yield

    def _build(self) -> Iterator[None]:
        """Count every lease of the committed records from scratch (those an
        earlier count saw expired are not counted as expiries again)."""
        state = self.writer.state
        now = self.clock.now_ms()
        records = list(state.runs.values())
        counted = {**self.delay, **self.expired}
        for run_id, (token, expires) in self._again.items():  # still not counted again
            rec = self.live.get(run_id)
            if rec is not None and _lease_key(rec)[:2] == (token, expires):
                counted[run_id] = rec
        self._again = {}
        self._state = None
        self.live, self.delay, self.expired = {}, {}, {}
        self._live_due, self._live_keys, self._delay_due, self._delay_keys = {}, [], {}, []
        changed: set[str] = set()
        self._building = changed
        try:
            for i in range(0, len(records), LEASE_SCAN_CHUNK):
                if i:
                    yield
                for rec in records[i:i + LEASE_SCAN_CHUNK]:
                    if rec.lease is not None and rec.status not in TERMINAL:
                        self._place(rec.run_id, rec, now, counted)
        finally:
            self._building = None
        self._state = state
        self._high = now
        for run_id in changed:  # changed while it ran: as they are now
            self.reconcile(run_id)


class Metrics:
    def __init__(self, writer: Writer, hub: FenceHub, clock: Clock, version: str, *,
                 leadership: Callable[[], tuple[int, int]] = lambda: (1, 0),
                 shards: Callable[[], tuple[int, int, int] | None] = lambda: None) -> None:
        self.writer = writer
        self.hub = hub
        self.clock = clock
        # (serving as leader: 1 or 0, the leader epoch; 0 without PostgreSQL)
        self.leadership = leadership
        # --lead-shards: (shards led, shards taken, shards given up) since the start
        self.shards = shards
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpc_seconds = Histogram(
            "fencepost_rpc_duration_seconds",
            "gRPC calls by service, method and status code (for streams: their lifetime)",
            ["service", "method", "code"], registry=r, buckets=RPC_BUCKETS,
        )
        self.commit_seconds = Histogram(
            "fencepost_writer_commit_duration_seconds",
            "Time from taking a batch to its durable commit", registry=r, buckets=COMMIT_BUCKETS,
        )
        self.batch_size = Histogram(
            "fencepost_writer_batch_size", "Commands per group commit",
            registry=r, buckets=BATCH_BUCKETS,
        )
        self.takeovers = Counter(
            "fencepost_takeovers", "Acquires that took over a lease (a new fencing token)",
            registry=r,
        )
        self.open_streams = Gauge(
            "fencepost_open_streams", "Open long-lived streams by kind", ["kind"], registry=r
        )
        for kind in (*STREAM_KINDS.values(), "dashboard_events"):
            self.open_streams.labels(kind)
        # The dashboard port (web/dashboard.py): requests it refused before any handler,
        # and event streams it dropped.
        self.http_refused = Counter(
            "fencepost_http_refused", "Dashboard requests refused, by reason",
            ["reason"], registry=r,
        )
        for reason in HTTP_REFUSALS:
            self.http_refused.labels(reason)
        self.events_dropped = Counter(
            "fencepost_dashboard_event_streams_dropped",
            "Dashboard event streams dropped for not reading, by reason", ["reason"], registry=r,
        )
        for reason in EVENT_DROPS:
            self.events_dropped.labels(reason)
        info = Gauge(
            "fencepost_build_info", "Always 1; the labels tell the build",
            ["version", "python"], registry=r,
        )
        info.labels(version, platform.python_version()).set(1)
        self.leases = LeaseCounts(writer, clock)
        self._counted: dict[str, int] | None = None  # render_async's counts, for its collect
        self._scraping = asyncio.Lock()  # one render_async at a time
        r.register(_StateCollector(self))
        self._unobserve = writer.observe_batches(self._on_batch)
        self._unsubscribe = writer.subscribe(self._on_changes)
        self._unrenewed = writer.subscribe_renewals(self.leases.on_renewed)

    def close(self) -> None:
        self._unrenewed()
        self._unsubscribe()
        self._unobserve()

    @property
    def expiries(self) -> int:
        return self.leases.expiries

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def render_async(self) -> bytes:
        """``render``, bringing the lease counts to now a chunk at a time with
        the loop free in between: a scrape of a server holding many leases
        does not stall the calls it serves."""
        async with self._scraping:
            for _ in self.leases.count():
                await asyncio.sleep(LEASE_SCAN_PAUSE_S)
            self._counted = self.leases.counts()
            try:
                return generate_latest(self.registry)
            finally:
                self._counted = None

    # -- feeds ----------------------------------------------------------------------

    def _on_batch(self, commands: int, seconds: float) -> None:
        self.commit_seconds.observe(seconds)
        self.batch_size.observe(commands)

    def _on_changes(self, events: list[ChangeEvent]) -> None:
        for ev in events:
            prev, rec = ev.previous, ev.record
            if (ev.cause is L.Acquire and prev is not None and prev.lease is not None
                    and rec is not None and rec.fencing_token != prev.fencing_token):
                self.takeovers.inc()
        self.leases.on_changes(events)

    def lease_counts(self) -> dict[str, int]:
        """Leases by state now (counted in one go unless a scrape is counting)."""
        if self._counted is not None:
            return self._counted
        if not self._scraping.locked():
            for _ in self.leases.count():
                pass
        return self.leases.counts()


class _StateCollector(Collector):
    """Values read from the writer and the hub when scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        w = self.m.writer
        yield GaugeMetricFamily(
            "fencepost_writer_queue_depth", "Commands waiting for the writer", value=w.queue_depth
        )
        yield CounterMetricFamily(
            "fencepost_writer_batches", "Group commits", value=w.stats.batches
        )
        yield CounterMetricFamily(
            "fencepost_writer_commands", "Commands committed", value=w.stats.commands
        )
        yield CounterMetricFamily(
            "fencepost_writer_failed_commits", "Commits that failed", value=w.stats.failed_commits
        )
        yield CounterMetricFamily(
            "fencepost_renewals_from_memory", "Lease renewals answered with no commit",
            value=w.stats.memory_renewals,
        )
        yield CounterMetricFamily(
            "fencepost_lease_expiries_flushed", "Renewed lease expiries copied to the database",
            value=w.stats.leases_flushed,
        )
        yield CounterMetricFamily(
            "fencepost_writer_held_batches", "Batches the commit delay held open",
            value=w.stats.held,
        )
        yield CounterMetricFamily(
            "fencepost_writer_held_in_vain",
            "Held batches that gathered nothing in the whole window",
            value=w.stats.held_in_vain,
        )
        leading, epoch = self.m.leadership()
        yield GaugeMetricFamily(
            "fencepost_leader", "1 while this coordinator leads and serves, 0 on a standby",
            value=leading,
        )
        yield GaugeMetricFamily(
            "fencepost_leader_epoch", "The epoch this coordinator leads in (0: SQLite, or none)",
            value=epoch,
        )
        sharded = self.m.shards()
        if sharded is not None:
            led, taken, given = sharded
            yield GaugeMetricFamily(
                "fencepost_shards_led", "Shards this coordinator leads (--lead-shards)", value=led)
            yield CounterMetricFamily(
                "fencepost_shard_takeovers", "Shards this coordinator took (at a join, a "
                "hand-over or another coordinator's failure)", value=taken)
            yield CounterMetricFamily(
                "fencepost_shard_moves", "Shards this coordinator gave up (handed over to a "
                "joining coordinator, or lost)", value=given)
            commands = CounterMetricFamily(
                "fencepost_shard_commands", "Commands this coordinator committed, per shard "
                "they touch", labels=["shard"])
            for shard, n in enumerate(w.shard_commands):
                if n:
                    commands.add_metric([str(shard)], n)
            yield commands
        yield GaugeMetricFamily("fencepost_revision", "Server revision", value=w.state.revision)
        yield GaugeMetricFamily("fencepost_runs", "Runs stored", value=len(w.state.index))
        leases = GaugeMetricFamily(
            "fencepost_leases",
            "Leases on records by state: live; lock_delay (expired, another owner must "
            "still wait); expired (nobody has taken it over yet)",
            labels=["state"],
        )
        for state, n in self.m.lease_counts().items():
            leases.add_metric([state], n)
        yield leases
        yield CounterMetricFamily(
            "fencepost_lease_expiries", "Leases that reached their expiry unrenewed",
            value=self.m.expiries,
        )
        lost = CounterMetricFamily(
            "fencepost_revocations",
            "lost pushed to KeepAlive streams, by reason", labels=["reason"],
        )
        pushed = self.m.hub.lost_pushed
        for reason in LostReason:
            lost.add_metric([reason.name.lower()], pushed.get(reason, 0))
        yield lost
        hub = self.m.hub
        queued, tracked = hub.totals()
        yield GaugeMetricFamily(
            "fencepost_stream_queued",
            "KeepAlive messages, WatchRuns events and Execute results queued for readers",
            value=queued,
        )
        yield GaugeMetricFamily(
            "fencepost_stream_tracked", "Leases tracked by KeepAlive streams", value=tracked
        )
        clients = GaugeMetricFamily(
            "fencepost_stream_clients", "Connections and principals with open streams",
            labels=["kind"],
        )
        for kind in CLIENT_KINDS:
            clients.add_metric([kind], sum(1 for k, _ in hub.budgets if k == kind))
        yield clients
        hits = CounterMetricFamily(
            "fencepost_stream_limit_refusals",
            "Tracks refused (STREAM_LIMIT_EXCEEDED) and streams dropped (STREAM_TOO_SLOW), "
            "by the limit reached", labels=["limit"],
        )
        for limit in STREAM_LIMITS:
            hits.add_metric([limit], hub.limit_hits.get(limit, 0))
        yield hits
