"""The gRPC listener of one coordinator: its transport options, the product's
services registered from their descriptors, gRPC health (on the listener, and
on a plaintext health-only port for probes under TLS) and reflection."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fencepost.v1 import engine_store_pb2, ledger_pb2, run_store_pb2, testing_pb2

from ..clock import Clock
from .registry import Instrument, add_service

log = logging.getLogger("fencepost")

health_aio: Any = health.aio  # type: ignore[attr-defined]  # untyped in grpcio-health-checking

SERVICE_NAMES = (
    ledger_pb2.DESCRIPTOR.services_by_name["Ledger"].full_name,
    run_store_pb2.DESCRIPTOR.services_by_name["RunStore"].full_name,
    engine_store_pb2.DESCRIPTOR.services_by_name["EngineStore"].full_name,
)


def transport_receive_limit(max_message_bytes: int) -> int:
    """gRPC's receive limit: 4x ours, at least 16 MiB."""
    return max(4 * max_message_bytes, 16 * 1024 * 1024)


def options(max_message_bytes: int, max_concurrent_streams: int) -> list[tuple[str, Any]]:
    return [
        # Our own limit (registry.py) answers an oversized message with
        # RUN_VALIDATION_ERROR and keeps the stream; gRPC's, above it, only
        # cuts what is far too big to buffer.
        ("grpc.max_receive_message_length", transport_receive_limit(max_message_bytes)),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        ("grpc.so_reuseport", 0),
        # The SDK pings every 2 s while it has calls open, to notice a frozen
        # coordinator: allow pings that often (gRPC's default answers them
        # with GOAWAY), with or without calls. And ping clients that have gone
        # quiet, to close the streams of a worker whose machine vanished.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def server(ledger: object, run_store: object, engine_store: object, *,
           max_concurrent_streams: int, instrument: Instrument, **guarded: Any,
           ) -> grpc.aio.Server:
    """A gRPC server with the three product services, each guarded by
    ``guarded`` (authn, max_message_bytes, gate: see add_service)."""
    srv = grpc.aio.server(
        options=options(guarded["max_message_bytes"], max_concurrent_streams))
    for servicer, name, pb in ((ledger, "Ledger", ledger_pb2),
                               (run_store, "RunStore", run_store_pb2),
                               (engine_store, "EngineStore", engine_store_pb2)):
        add_service(srv, servicer, pb.DESCRIPTOR.services_by_name[name],
                    instrument=instrument, **guarded)
    return srv


def add_test_hooks(srv: grpc.aio.Server, clock: Clock, fault: str, **guarded: Any) -> None:
    """TEST-ONLY: the TestHooks service, which moves this server's clock, said
    loudly, as is the broken build ``fault`` (the writer was built with it)."""
    from .test_hooks import TestHooksService

    log.warning("TEST HOOKS ENABLED: the TestHooks service lets any client move this server's "
                "clock (%s). NEVER run this in production.", type(clock).__name__)
    add_service(srv, TestHooksService(clock), testing_pb2.DESCRIPTOR.services_by_name["TestHooks"],
                **guarded)
    if fault:
        log.warning("BROKEN BUILD --fault %s: this server violates its guarantees on purpose "
                    "(torture self-test). NEVER run this in production.", fault)


class Health:
    """gRPC health for the server and every service. grpc's servicer starts
    out SERVING for "": this one says NOT_SERVING until told otherwise."""

    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()
        self.serving = False
        self.server: grpc.aio.Server | None = None  # the health-only listener
        self.port = 0

    async def set(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.servicer.set(name, status)

    def add_to(self, srv: grpc.aio.Server) -> None:
        """Health and reflection on the main listener."""
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, srv)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), srv)

    async def listen(self, address: str) -> None:
        """Health alone, plaintext, on ``address`` (--health-listen)."""
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {address} (--health-listen)")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
