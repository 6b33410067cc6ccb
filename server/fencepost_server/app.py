"""Composition root: builds every part from one frozen Settings, runs their
tasks under one ``asyncio.TaskGroup`` and owns the shutdown order (health
NOT_SERVING -> server.stop(grace) -> writer drains and commits -> leadership
handed over -> database closes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from . import version
from .auth import Authenticator
from .clock import Clock, OffsetClock, SystemClock
from .config import Settings, duration_ms, parse_duration_ms
from .ha.coordinator import Coordinator
from .hub import ClientLimits, FenceHub
from .metrics import Metrics
from .rpc.engine_store import EngineStoreService, sweep_uploads
from .rpc.interceptors import instrumented
from .rpc.ledger import LedgerService
from .rpc.run_store import RunStoreService
from .rpc.server import Health, add_test_hooks, server
from .storage import is_url
from .storage.engine_sql import EngineReader, WriterHooks
from .storage.sql import SqlStorage
from .storage.sqlite import Durability, SqliteStorage
from .testing import hooks
from .tls import security
from .upkeep import gcpolicy
from .upkeep.retention import Retention
from .web.dashboard import Dashboard
from .writer import History, Reads, Writer

if TYPE_CHECKING:
    from .ha.leadership import Leadership

log = logging.getLogger("fencepost")

# TEST-ONLY broken builds (``--fault``, testing/hooks.py), honoured only with ``--test-hooks``.
FAULTS = hooks.FAULTS
EXIT_DEPOSED = 3  # fencepost serve: this coordinator lost leadership (restart it)


@dataclass
class App:
    """A running coordinator: gRPC server + writer + database."""

    settings: Settings
    clock: Clock = field(default_factory=SystemClock)
    # process-wide, so only ``serve`` hands one in (not an App in a test's process)
    collections: gcpolicy.FullCollections | None = None
    writer: Writer | None = None
    reads: Reads | None = None
    server: grpc.aio.Server | None = None
    health: Health = field(default_factory=Health)
    hub: FenceHub | None = None
    port: int = 0
    _history: History | None = None
    engine_store: EngineStoreService | None = None
    _engine_reader: EngineReader | None = None
    retention: Retention | None = None
    metrics: Metrics | None = None
    dashboard: Dashboard | None = None
    authn: Authenticator | None = None  # None: no identities (the dashboard shares it)
    identity: str = ""
    coordinator: Coordinator = field(init=False)
    _lead_task: asyncio.Task[None] | None = None
    _retain_ms: int = 0
    _db: str = ""  # the database, as the log names it
    _run: asyncio.Task[None] | None = None
    _stopping: asyncio.Future[float] | None = None
    _tasks: asyncio.TaskGroup = field(init=False)

    def __post_init__(self) -> None:
        self.coordinator = Coordinator(
            self.clock, prepare=self._prepare, serving=self._serving, deposed=self._deposed)

    @property
    def leadership(self) -> Leadership | None:
        """PostgreSQL: who leads (ha/leadership.py); None on SQLite."""
        return self.coordinator.leadership

    @property
    def deposed(self) -> asyncio.Event:
        """Set when this coordinator stops leading; ``serve`` then exits with code 3."""
        return self.coordinator.deposed

    async def start(self) -> App:
        """Build and listen; returns once listening (a standby keeps campaigning)."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()
        self._stopping = loop.create_future()
        self._run = asyncio.create_task(self._main(started), name="fencepost-app")
        await started  # raises why the start failed
        return self

    async def _main(self, started: asyncio.Future[None]) -> None:
        """Every task of the coordinator runs in this one group."""
        assert self._stopping is not None
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            try:
                await self._build(tasks)
            except Exception as exc:  # to start(), as raised: not in an ExceptionGroup
                await self._undo_build()
                started.set_exception(exc)
                return
            except BaseException:
                started.cancel()
                raise
            started.set_result(None)
            await self._shutdown(await self._stopping)

    async def _build(self, tasks: asyncio.TaskGroup) -> None:
        s = self.settings
        if s.fault and s.fault not in FAULTS:
            raise RuntimeError(f"unknown --fault {s.fault!r}; known: {', '.join(FAULTS)}")
        authn, credentials = security(s)  # before anything opens: a bad flag changes nothing
        self.authn = authn
        retain_ms = parse_duration_ms(s.retain_terminal, "--retain-terminal") \
            if s.retain_terminal else 0
        self._retain_ms = retain_ms
        storage: SqlStorage
        self._db = str(Path(s.db_path))
        # psycopg and the leadership module load only for PostgreSQL: a server
        # on a SQLite file starts sooner and holds about 11 MiB less
        pg = is_url(s.db_path)
        if s.lead_shards and not pg:
            raise RuntimeError("--lead-shards needs a PostgreSQL database (--db postgresql://...): "
                               "a SQLite file has one coordinator, which leads every shard")
        if pg:
            from .ha.leadership import default_identity
            from .storage import postgres
            from .storage.postgres import PostgresStorage

            self.identity = default_identity()
            storage = PostgresStorage(
                s.db_path, durable=s.durability is Durability.FULL, name=self.identity,
                unsafe_skip_epoch_check=s.test_hooks and s.fault == "no-epoch-check",
                shards=s.shards)
            if s.lead_shards:
                storage.lead_shards()
            self._db = str(storage.path)
        else:
            self.identity = f"{socket.gethostname()}/{os.getpid()}"
            storage = SqliteStorage(s.db_path, s.durability, shards=s.shards)
        writer = self.writer = Writer(
            storage,
            self.clock,
            max_batch=s.max_batch,
            commit_delay_ms=s.commit_delay_ms,
            request_retention_ms=s.request_retention_s * 1000,
            history_revisions=s.history_revisions,
            history_max_age_ms=s.history_max_age_s * 1000,
            prune_every_ms=int(s.prune_every_s * 1000),
            on_failed_commit=self.coordinator.on_failed_commit,
            memory_ok=self.coordinator.memory_ok if pg else None,
            **(hooks.writer_faults(s.fault) if s.test_hooks else {}),
        )
        reads = self.reads = Reads(storage, lambda: writer.state,
                                   writer.leads_key if s.lead_shards else None)
        if pg:
            assert isinstance(storage, PostgresStorage)
            # the schema first (standbys need the leader row), then only the
            # leader loads the state (``_lead``)
            await asyncio.to_thread(postgres.prepare, storage)
        else:
            await self.writer.start()
            if s.test_hooks and s.test_shard_map:  # TEST-ONLY: leads only the shards mapped here
                writer.lead_only(hooks.static_ownership(
                    s.test_shard_map, storage.shards, s.advertise or s.listen))
        # the engine store: its executors into the writer, its reads on reader threads
        writer.attach_engine(WriterHooks())
        self._engine_reader = EngineReader(storage.reader)
        self.engine_store = EngineStoreService(writer, self._engine_reader)
        self.hub = FenceHub(self.writer, self.clock, reads=reads, queue_limit=s.stream_queue_limit,
                            limits=ClientLimits(
                                max_queued_per_connection=s.max_queued_per_connection,
                                max_queued_per_principal=s.max_queued_per_principal,
                                max_tracked_per_connection=s.max_tracked_per_connection,
                                max_tracked_per_principal=s.max_tracked_per_principal))
        self.hub.start()
        self.metrics = Metrics(self.writer, self.hub, self.clock, version(),
                               leadership=self.coordinator.gauge,
                               shards=self.coordinator.shard_stats)
        instrument = instrumented(self.metrics)
        self._history = History(storage.reader)
        guarded: dict[str, Any] = {"authn": authn, "max_message_bytes": s.max_message_bytes,
                                   "gate": self.coordinator.gate}
        ledger = LedgerService(
            self.writer, self.hub, self._history, reads=reads,
            max_tracked_per_stream=s.max_tracked_per_stream,
            max_inflight_per_stream=s.max_inflight_per_stream,
            shard_owner=self.shard_owner,
            move_shard=self._move_shard if s.lead_shards else None,
        )
        if s.test_hooks:  # TEST-ONLY: a watch that leaves changes out (hooks.watch_drops)
            ledger.watch.drops = hooks.watch_drops(s.fault)
        self.server = server(
            ledger,
            RunStoreService(self.writer, reads, backend=storage.backend),
            self.engine_store,
            max_concurrent_streams=s.max_concurrent_streams, instrument=instrument, **guarded)
        if s.test_hooks:  # TEST-ONLY; a fault is built into the writer (hooks.writer_faults)
            add_test_hooks(self.server, self.clock, s.fault, **{**guarded, "gate": None})
        elif s.fault:
            log.warning("--fault %s ignored: it is only honoured with --test-hooks", s.fault)
        # not SERVING before the state is loaded and every listener is up
        await self.health.set(False)
        self.health.add_to(self.server)
        if credentials is None:
            self.port = self.server.add_insecure_port(s.listen)
        else:
            self.port = self.server.add_secure_port(s.listen, credentials)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {s.listen}")
        await self.server.start()
        if s.health_listen:
            await self.health.listen(s.health_listen)
        # the dashboard and /metrics (with /healthz) listen before health says
        # SERVING: a probe of either that follows the gRPC one finds them up
        await self._start_http()
        if pg and s.lead_shards:
            assert isinstance(storage, PostgresStorage)
            await self._lead_shards(storage)
        elif pg:
            from .ha.leadership import Leadership

            assert isinstance(storage, PostgresStorage)
            leadership = Leadership(
                storage.url, self.clock, address=s.advertise or self.address,
                identity=self.identity,
                lease_ms=duration_ms(s.leader_lease), renew_ms=duration_ms(s.leader_renew),
                max_skew_ms=duration_ms(s.max_clock_skew, "max_clock_skew"),
            )
            self._lead_task = tasks.create_task(
                self.coordinator.lead(leadership, storage, self.writer, self._describe),
                name="fencepost-leader")
            log.info("fencepost standby on %s (db=%s, advertised as %s): waiting to lead",
                     self.address, storage.path, leadership.address)
        else:
            await self.coordinator.lead_alone()
            log.info("fencepost serving on %s", self._describe())
        if self.collections is not None:
            self.collections.start(tasks)

    async def _lead_shards(self, storage: Any) -> None:
        """--lead-shards: take part in the shard assignment and serve the
        shards taken (ha/sharded.py)."""
        from .ha.sharded import ShardedLeading
        from .ha.shards import ShardLeases

        s = self.settings
        assert self.writer is not None and self.hub is not None
        leases = ShardLeases(
            storage.url, self.clock, address=s.advertise or self.address,
            identity=self.identity, shards=storage.shards,
            lease_ms=duration_ms(s.leader_lease), renew_ms=duration_ms(s.leader_renew),
            max_skew_ms=duration_ms(s.max_clock_skew, "max_clock_skew"))
        await self.coordinator.lead_shards(
            ShardedLeading(leases, storage, self.writer, self.hub.moved))
        log.info("fencepost serving on %s, leading the shards assigned to it (advertised as "
                 "%s)", self._describe(), leases.address)

    async def _prepare(self) -> None:
        """The state is loaded: sweep what a crash left, start retention."""
        assert self.writer is not None and self.reads is not None
        # (leading shards apart, the others' uploads are theirs: only the gone ones')
        await sweep_uploads(self.writer, abandoned_only=self.settings.lead_shards)
        if self._retain_ms:
            self.retention = Retention(self.writer, self.reads, self.clock, self._retain_ms)
            self.retention.start(self._tasks)

    async def _serving(self) -> None:
        await self.health.set(True)

    def _deposed(self) -> None:
        if self.hub is not None:
            self.hub.shutdown()  # streams end with UNAVAILABLE: clients go to the new leader
        self._tasks.create_task(self.health.set(False))

    async def _move_shard(self, shard: int, to: str) -> tuple[str, str, int]:
        """MoveShard under --lead-shards: who led the shard (ValueError naming
        the field when it cannot move there)."""
        sharded = self.coordinator.sharded
        if sharded is None:
            raise ValueError("shard: this coordinator is not serving yet")
        before = await sharded.leases.move(shard, to)
        return before.holder, before.address, before.epoch

    def shard_owner(self) -> tuple[str, str, int]:
        """Who leads every shard: (identity, advertised address, epoch)."""
        ld = self.leadership
        if ld is None:
            return self.identity, self.settings.advertise or self.address, 0
        return ld.identity, ld.address, ld.epoch or 0

    def _describe(self) -> str:
        assert self.writer is not None
        s = self.settings
        return (f"{self.address} (db={self._db}, durability={s.durability.value}, "
                f"revision={self.writer.state.revision}, runs={len(self.writer.state.index)})")

    async def _start_http(self) -> None:
        """The dashboard + /metrics, and the metrics-only listener (web/)."""
        s = self.settings
        metrics_listen = s.metrics_listen
        if not metrics_listen and s.metrics_port:
            metrics_listen = f"127.0.0.1:{s.metrics_port}"
        if not (s.http_listen or metrics_listen):
            return
        self.dashboard = Dashboard(self)
        try:
            await self.dashboard.start(s.http_listen, metrics_listen, Settings.http_listen)
        except RuntimeError:
            await self._shutdown(0)
            raise

    @property
    def http_port(self) -> int:
        """The dashboard's port (0: off)."""
        return self.dashboard.http_port if self.dashboard is not None else 0

    @property
    def writer_state(self) -> Any:
        assert self.writer is not None
        return self.writer.state

    @property
    def history(self) -> History | None:
        """The runs table and change log, read apart from the writer."""
        return self._history

    async def run_history(self, run_id: str, limit: int) -> list[Any]:
        """One run's retained changes, oldest first (read off the loop)."""
        assert self._history is not None
        return await self._history.run_history(run_id, limit)

    async def engine_runs(
        self, *, agent: str | None, statuses: list[str], limit: int, offset: int
    ) -> tuple[list[Any], int]:
        """A page of engine-store runs (created_at, id order) and the match count."""
        assert self._engine_reader is not None
        return await self._engine_reader.runs_page(
            agent=agent, statuses=statuses, limit=limit, offset=offset)

    @property
    def serving(self) -> bool:
        return self.health.serving

    @property
    def health_port(self) -> int:
        """The health-only listener's port (0: none)."""
        return self.health.port

    @property
    def address(self) -> str:
        host = self.settings.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Graceful: NOT_SERVING, stop accepting, finish in-flight calls, then
        let the writer commit what it has and close the database."""
        assert self._run is not None and self._stopping is not None
        if not self._stopping.done():
            self._stopping.set_result(self.settings.shutdown_grace_s if grace is None else grace)
        await self._run

    async def _undo_build(self) -> None:
        """A start that failed part way closes what it opened (the database
        file's lock, the port, the writer's tasks), so the same process may
        start again; what cannot be closed is logged, never raised over the
        start's own error."""
        try:
            await self._shutdown(0)
        except Exception:
            log.exception("closing what a failed start opened")

    async def _shutdown(self, grace: float) -> None:
        """The shutdown order; the group's tasks end here, before it exits."""
        if self.collections is not None:
            await self.collections.stop()
        if self.server is not None:  # built: health can say so
            await self.health.set(False)
        if self.coordinator.sharded is not None and self.coordinator.leading:
            try:  # while calls are still answered (NOT_OWNER: clients follow the shards)
                await self.coordinator.sharded.hand_over_all()
            except Exception:
                log.exception("could not hand the shards over; they move when their rows "
                              "run out")
        if self._lead_task is not None:
            self._lead_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._lead_task
        if self.retention is not None:
            await self.retention.stop()
        if self.dashboard is not None:
            await self.dashboard.stop()
            self.dashboard = None
        if self.hub is not None:
            self.hub.shutdown()  # streams end with UNAVAILABLE
        if self.server is not None:
            await self.server.stop(grace)
        await self.health.stop()
        if self.hub is not None:
            await self.hub.close()
        if self.engine_store is not None:
            await self.engine_store.drain()  # queued upload discards, before the writer closes
        if self.metrics is not None:
            self.metrics.close()
        if self.writer is not None:
            await self.writer.close()
        if self.reads is not None:
            await self.reads.close()
        await self.coordinator.close()  # a standby takes over at once
        if self._engine_reader is not None:
            await asyncio.to_thread(self._engine_reader.close)
        if self._history is not None:
            await self._history.close()
        log.info("fencepost stopped")


async def serve(settings: Settings, clock: Clock | None = None) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    if clock is None and settings.test_hooks:
        clock = OffsetClock()
        clock.jump(max(0, settings.test_clock_offset_ms))
    app = App(settings, clock or SystemClock(), collections=gcpolicy.FullCollections())
    # before the start: a SIGTERM that comes while the server still starts
    # (loads its state, opens its listeners) is kept, and the stop follows
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    stopped, deposed = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(app.deposed.wait())
    await asyncio.wait((stopped, deposed), return_when=asyncio.FIRST_COMPLETED)
    if app.deposed.is_set():
        # Crash-only: everything in memory may be stale now. Exit at once
        # (nothing more is acknowledged); the supervisor restarts this
        # coordinator, which comes back as a standby.
        log.error("exiting with code %d: lost leadership (%s)", EXIT_DEPOSED,
                  app.leadership.lost if app.leadership else "?")
        logging.shutdown()
        os._exit(EXIT_DEPOSED)
    log.info("signal received; draining")
    await app.stop()
