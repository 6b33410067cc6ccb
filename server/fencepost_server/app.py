"""Composition root: builds everything from one frozen Settings and owns the
shutdown order (health NOT_SERVING -> server.stop(grace) -> writer drains and
commits -> database closes)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fencepost.v1 import ledger_pb2, run_store_pb2

from .clock import Clock, SystemClock
from .services._registry import add_service
from .services.ledger import LedgerService
from .services.run_store import RunStoreService
from .storage.sqlite import Durability, HistoryReader, SqliteStorage
from .streams import FenceHub
from .writer import Writer

log = logging.getLogger("fencepost")
health_aio: Any = health.aio  # type: ignore[attr-defined]  # untyped in grpcio-health-checking

SERVICE_NAMES = (
    ledger_pb2.DESCRIPTOR.services_by_name["Ledger"].full_name,
    run_store_pb2.DESCRIPTOR.services_by_name["RunStore"].full_name,
)


@dataclass(frozen=True)
class Settings:
    """Every knob, read in one place (flags > environment > defaults)."""

    listen: str = "127.0.0.1:50051"
    db_path: str = "./fencepost.db"
    durability: Durability = Durability.FULL
    log_level: str = "INFO"
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 1024
    shutdown_grace_s: float = 5.0
    max_batch: int = 1024
    request_retention_s: int = 15 * 60
    history_revisions: int = 100_000
    history_max_age_s: int = 0  # 0: no age limit on the watch history
    prune_every_s: float = 30.0
    stream_queue_limit: int = 65_536  # messages a stream may lag before it is dropped
    metrics_port: int = 0  # 0: no metrics endpoint

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        mapping = {
            "FENCEPOST_LISTEN": ("listen", str),
            "FENCEPOST_DB": ("db_path", str),
            "FENCEPOST_DURABILITY": ("durability", Durability),
            "FENCEPOST_LOG_LEVEL": ("log_level", str),
            "FENCEPOST_MAX_MESSAGE_BYTES": ("max_message_bytes", int),
            "FENCEPOST_METRICS_PORT": ("metrics_port", int),
            "FENCEPOST_SHUTDOWN_GRACE_S": ("shutdown_grace_s", float),
            "FENCEPOST_HISTORY_REVISIONS": ("history_revisions", int),
            "FENCEPOST_HISTORY_MAX_AGE_S": ("history_max_age_s", int),
        }
        for var, (name, typ) in mapping.items():
            if var in env and env[var] != "":
                values[name] = typ(env[var])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass
class App:
    """A running coordinator: gRPC server + writer + database."""

    settings: Settings
    clock: Clock = field(default_factory=SystemClock)
    writer: Writer | None = None
    server: grpc.aio.Server | None = None
    health: Any = None
    hub: FenceHub | None = None
    port: int = 0
    _history: HistoryReader | None = None
    _history_executor: ThreadPoolExecutor | None = None

    async def start(self) -> App:
        s = self.settings
        storage = SqliteStorage(s.db_path, s.durability)
        self.writer = Writer(
            storage,
            self.clock,
            max_batch=s.max_batch,
            request_retention_ms=s.request_retention_s * 1000,
            history_revisions=s.history_revisions,
            history_max_age_ms=s.history_max_age_s * 1000,
            prune_every_ms=int(s.prune_every_s * 1000),
        )
        await self.writer.start()
        self.hub = FenceHub(self.writer, self.clock, queue_limit=s.stream_queue_limit)
        self.hub.start()
        self._history_executor = ThreadPoolExecutor(1, thread_name_prefix="fencepost-history")
        self._history = HistoryReader(s.db_path)
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.max_concurrent_streams", s.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(options=options)
        add_service(
            self.server,
            LedgerService(self.writer, self.hub, self._history, self._history_executor),
            ledger_pb2.DESCRIPTOR.services_by_name["Ledger"],
        )
        add_service(
            self.server,
            RunStoreService(self.writer),
            run_store_pb2.DESCRIPTOR.services_by_name["RunStore"],
        )
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.port = self.server.add_insecure_port(s.listen)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {s.listen}")
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if s.metrics_port:
            from .metrics import start_metrics

            start_metrics(s.metrics_port, self.writer)
        log.info(
            "fencepost serving on %s (db=%s, durability=%s, revision=%d, runs=%d)",
            self.address,
            Path(s.db_path),
            s.durability.value,
            self.writer.state.revision,
            len(self.writer.state.runs),
        )
        return self

    async def _set_health(self, status: Any) -> None:
        assert self.health is not None
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    @property
    def address(self) -> str:
        host = self.settings.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Graceful: NOT_SERVING, stop accepting, finish in-flight calls, then
        let the writer commit what it has and close the database."""
        grace = self.settings.shutdown_grace_s if grace is None else grace
        if self.health is not None:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.hub is not None:
            self.hub.shutdown()  # streams end with UNAVAILABLE
        if self.server is not None:
            await self.server.stop(grace)
        if self.hub is not None:
            await self.hub.close()
        if self.writer is not None:
            await self.writer.close()
        if self._history_executor is not None and self._history is not None:
            history = self._history
            await asyncio.get_running_loop().run_in_executor(self._history_executor, history.close)
            self._history_executor.shutdown(wait=True)
        log.info("fencepost stopped")


async def serve(settings: Settings, clock: Clock | None = None) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    app = App(settings, clock or SystemClock())
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received; draining")
    await app.stop()
