"""Prometheus metrics of one coordinator (served at ``/metrics`` by web/dashboard.py).

Each ``App`` owns its own registry (several servers may share a process in
tests). Counters end in ``_total``, durations are ``_seconds`` histograms,
no label carries a run id or an owner. docs/OPERATIONS.md lists exactly
what is exposed (tests/service/test_metrics.py compares the two).

Lease counts and expiries are read from the committed state when scraped;
an expiry is counted once per lease that reached its expiry unrenewed,
whether a scrape saw it expired or a later change (a takeover, a cancel)
ended it first.
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Callable, Iterable, Iterator

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
from .core.records import Record
from .hub import FenceHub, LostReason
from .writer import ChangeEvent, Writer

disable_created_metrics()  # no *_created series: nothing here needs them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
COMMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Long-lived streams, by method name (the rest are calls, or listings that end).
STREAM_KINDS = {"KeepAlive": "keepalive", "WatchRuns": "watch", "Execute": "execute"}
LEASE_STATES = ("live", "lock_delay", "expired")
HTTP_REFUSALS = ("host", "origin", "unauthenticated", "permission_denied", "too_many_streams")
EVENT_DROPS = ("queue_full", "write_timeout")
CLIENT_KINDS = ("connection", "principal")
STREAM_LIMITS = tuple(f"max_{what}_per_{per}" for what in ("queued", "tracked")
                      for per in ("stream", "connection", "principal"))
# Records a scrape counts between two yields to the event loop (render_async):
# counting 100 000 leases in one go stalled every call for ~50 ms
LEASE_SCAN_CHUNK = 4096
# ...and how long it pauses after each chunk. Not sleep(0): a loop that is
# never idle never releases the GIL but at the interpreter's switch interval,
# and the writer thread, starved of it, took ~100 ms per batch during every
# scrape of 200,000 leases; a real pause lets the loop block in epoll, and the
# writer runs.
LEASE_SCAN_PAUSE_S = 0.001


class Metrics:
    def __init__(self, writer: Writer, hub: FenceHub, clock: Clock, version: str, *,
                 leadership: Callable[[], tuple[int, int]] = lambda: (1, 0)) -> None:
        self.writer = writer
        self.hub = hub
        self.clock = clock
        # (serving as leader: 1 or 0, the leader epoch; 0 without PostgreSQL)
        self.leadership = leadership
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
        self.expiries = 0
        self._expired: dict[str, tuple[int, int]] = {}  # run -> (token, expires_at) seen expired
        # while render_async counts: expired leases that ended meanwhile (run -> key)
        self._ended_in_scan: dict[str, tuple[int, int]] | None = None
        self._counted: dict[str, int] | None = None  # render_async's counts, for its collect
        self._scraping = asyncio.Lock()  # one render_async at a time
        r.register(_StateCollector(self))
        self._unobserve = writer.observe_batches(self._on_batch)
        self._unsubscribe = writer.subscribe(self._on_changes)

    def close(self) -> None:
        self._unsubscribe()
        self._unobserve()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def render_async(self) -> bytes:
        """``render``, counting the leases a chunk at a time with the loop
        free in between: a scrape of a server holding many leases does not
        stall the calls it serves."""
        async with self._scraping:
            self._counted = await self._count_leases_async()
            try:
                return generate_latest(self.registry)
            finally:
                self._counted = None

    # -- feeds ----------------------------------------------------------------------

    def _on_batch(self, commands: int, seconds: float) -> None:
        self.commit_seconds.observe(seconds)
        self.batch_size.observe(commands)

    def _on_changes(self, events: list[ChangeEvent]) -> None:
        now = self.clock.now_ms()
        for ev in events:
            prev, rec = ev.previous, ev.record
            if prev is None or prev.lease is None:
                continue
            moved = rec is not None and rec.fencing_token != prev.fencing_token
            if ev.cause is L.Acquire and moved:
                self.takeovers.inc()
            if prev.lease.expires_at > now:
                continue
            key = (prev.fencing_token, prev.lease.expires_at)
            ended = rec is None or rec.lease is None or (
                rec.fencing_token, rec.lease.expires_at) != key
            if not ended:
                continue
            if self._ended_in_scan is not None:
                self._ended_in_scan[ev.run_id] = key
            if self._expired.pop(ev.run_id, None) != key:
                self.expiries += 1  # expired and ended before a scrape saw it

    def lease_counts(self) -> dict[str, int]:
        """Leases by state now; counts the expiries first seen here."""
        if self._counted is not None:
            return self._counted
        now = self.clock.now_ms()
        counts = dict.fromkeys(LEASE_STATES, 0)
        seen: dict[str, tuple[int, int]] = {}
        self._count(self.writer.state.runs.values(), now, counts, seen)
        self._settle_expired(seen, {})
        return counts

    async def _count_leases_async(self) -> dict[str, int]:
        """``lease_counts`` over the committed records as they were when it
        began (a snapshot: records are replaced, never changed in place), in
        chunks. Expired leases that a change ends meanwhile were counted by
        ``_on_changes``; they are not counted again."""
        now = self.clock.now_ms()
        records = list(self.writer.state.runs.values())
        counts = dict.fromkeys(LEASE_STATES, 0)
        seen: dict[str, tuple[int, int]] = {}
        ended: dict[str, tuple[int, int]] = {}
        self._ended_in_scan = ended
        try:
            for i in range(0, len(records), LEASE_SCAN_CHUNK):
                if i:
                    await asyncio.sleep(LEASE_SCAN_PAUSE_S)
                self._count(records[i:i + LEASE_SCAN_CHUNK], now, counts, seen)
        finally:
            self._ended_in_scan = None
        self._settle_expired(seen, ended)
        return counts

    @staticmethod
    def _count(records: Iterable[Record], now: int, counts: dict[str, int],
               seen: dict[str, tuple[int, int]]) -> None:
        for rec in records:
            lease = rec.lease
            if lease is None:
                continue
            if now < lease.expires_at:
                counts["live"] += 1
                continue
            counts["lock_delay" if now < lease.expires_at + lease.lock_delay_ms else "expired"] += 1
            seen[rec.run_id] = (rec.fencing_token, lease.expires_at)

    def _settle_expired(
        self, seen: dict[str, tuple[int, int]], ended: dict[str, tuple[int, int]]
    ) -> None:
        """Count the expired leases this scrape saw first; remember the rest."""
        still: dict[str, tuple[int, int]] = {}
        for run_id, key in seen.items():
            if ended.get(run_id) == key:
                continue  # ended during the scan: _on_changes settled it
            if self._expired.get(run_id) != key:
                self.expiries += 1
            still[run_id] = key
        self._expired = still


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
