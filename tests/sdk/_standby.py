"""A real gRPC server that plays a fencepost standby coordinator.

It refuses every Ledger / RunStore / EngineStore method, unary or streaming,
at the start of the call, with exactly the status a standby sends:
``UNAVAILABLE`` and a ``google.rpc.Status`` detail ``ErrorInfo{reason:
"NOT_LEADER", domain: "fencepost", metadata: {"leader": ADDR}}`` (ADDR empty
while no leader is known), and answers gRPC health ``NOT_SERVING``. It
records every call it refused (the method and, for a request that has one,
its ``request_id``), so a test can see what a client sent where.

Runs on its own loop thread, so sync and async tests use it the same way.
``leader`` may be changed while it runs (a takeover finished elsewhere).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2, message_factory
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from fencepost.v1 import engine_store_pb2, ledger_pb2, run_store_pb2

_FILES = (ledger_pb2, run_store_pb2, engine_store_pb2)
# "/fencepost.v1.Ledger/Acquire" -> the method's descriptor
METHODS = {
    f"/{service.full_name}/{method.name}": method
    for module in _FILES
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
}


def not_leader_status(leader: str) -> grpc.Status:
    """The contract's refusal: UNAVAILABLE + ErrorInfo NOT_LEADER {leader}."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="NOT_LEADER", domain="fencepost",
                                          metadata={"leader": leader}))
    where = leader or "unknown"
    return rpc_status.to_status(status_pb2.Status(
        code=code_pb2.UNAVAILABLE,
        message=f"this coordinator is a standby; the leader is at {where}",
        details=[info],
    ))


@dataclass(frozen=True)
class Refused:
    method: str  # e.g. "Acquire"
    request_id: str  # "" when the request has none (or a stream was refused unread)


class _Refuser(grpc.GenericRpcHandler):
    def __init__(self, standby: Standby) -> None:
        self._standby = standby

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = METHODS.get(details.method)  # type: ignore[attr-defined]
        if method is None:
            return None  # health and the rest: UNIMPLEMENTED
        standby = self._standby
        cls = message_factory.GetMessageClass(method.input_type)

        def record(raw: bytes | None) -> None:
            request_id = ""
            if raw is not None:
                msg = cls.FromString(raw)
                if "request_id" in cls.DESCRIPTOR.fields_by_name:
                    request_id = msg.request_id  # type: ignore[attr-defined]
            standby.refused.append(Refused(method.name, request_id))

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            # HTTP/2 frames every kind of call alike: one streaming handler
            # takes them all, reading the request of a unary-request call
            record(None if method.client_streaming else await anext(aiter(requests)))
            await context.abort_with_status(not_leader_status(standby.leader))

        return grpc.stream_stream_rpc_method_handler(refuse)


class Standby:
    """``with Standby(leader=ADDR) as s: s.address``; ``s.refused`` lists the
    calls it turned away."""

    def __init__(self, leader: str = "", listen: str = "127.0.0.1:0") -> None:
        self.leader = leader
        self.refused: list[Refused] = []
        self._listen = listen
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-standby",
                                        daemon=True)
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def methods(self) -> list[str]:
        return [r.method for r in self.refused]

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_generic_rpc_handlers((_Refuser(self),))
        self.port = server.add_insecure_port(self._listen)
        await server.start()
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *{m.containing_service.full_name for m in METHODS.values()}):
            await servicer.set(name, not_serving)
        self._server = server

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    def start(self) -> Standby:
        if not self._thread.is_alive():
            self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())

    def __enter__(self) -> Standby:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
