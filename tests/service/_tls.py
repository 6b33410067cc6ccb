"""TLS helpers for wire tests: a CA with the usual principals, a server with
TLS flags, and raw calls (any method, any credentials) that return what the
server answered."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torture.certs import CA, Pair  # noqa: E402

PRINCIPALS = ("admin", "op", "w1", "w2", "nobody")
POLICY = """
[roles]
admin = ["admin", "cli-*"]
operator = ["op"]
worker = ["w*"]

[tokens]
cli-admin = "{admin_digest}"
script = "{script_digest}"
"""
ADMIN_TOKEN, SCRIPT_TOKEN = "s3cret-admin-token", "script-token-42"


@dataclass
class Certs:
    ca: CA
    server: Pair
    clients: dict[str, Pair]
    dir: Path

    def creds(self, who: str | None) -> grpc.ChannelCredentials:
        if who is None:
            return grpc.ssl_channel_credentials(self.ca.cert_pem)
        p = self.clients[who]
        return grpc.ssl_channel_credentials(self.ca.cert_pem, p.key_pem, p.cert_pem)


def make_certs(directory: Path) -> Certs:
    ca = CA(directory)
    clients = {name: ca.issue(name, cn=name) for name in PRINCIPALS}
    return Certs(ca, ca.server(), clients, directory)


def write_policy(path: Path) -> Path:
    from fencepost_server.auth import token_digest

    path.write_text(POLICY.format(admin_digest=token_digest(ADMIN_TOKEN),
                                  script_digest=token_digest(SCRIPT_TOKEN)))
    return path


@dataclass
class Answer:
    """What one call got: OK, or a status code with its fencepost reason."""

    code: grpc.StatusCode
    reason: str
    metadata: dict[str, str]
    message: str
    responses: list[Any]


def answer_of(status: status_pb2.Status | None, code: grpc.StatusCode, message: str,
              responses: list[Any] | None = None) -> Answer:
    info = error_details_pb2.ErrorInfo()
    for d in status.details if status is not None else ():
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            d.Unpack(info)
    return Answer(code, info.reason, dict(info.metadata), message, responses or [])


def call(channel: grpc.Channel, method: str, kind: str, request: bytes | list[bytes] = b"",
         *, token: str | None = None, timeout: float = 5.0) -> Answer:
    """Call ``method`` with raw serialized request bytes; never raises."""
    md = (("authorization", f"Bearer {token}"),) if token else None
    ident = lambda b: b  # noqa: E731
    responses: list[Any] = []
    try:
        if kind == "unary_unary":
            responses = [channel.unary_unary(method, ident, ident)(request, metadata=md,
                                                                    timeout=timeout)]
        elif kind == "unary_stream":
            it = channel.unary_stream(method, ident, ident)(request, metadata=md,
                                                            timeout=timeout)
            responses = list(it)
        elif kind == "stream_unary":
            msgs = request if isinstance(request, list) else []
            responses = [channel.stream_unary(method, ident, ident)(iter(msgs), metadata=md,
                                                                     timeout=timeout)]
        else:
            msgs = request if isinstance(request, list) else []
            it = channel.stream_stream(method, ident, ident)(iter(msgs), metadata=md,
                                                             timeout=timeout)
            responses = list(it)
    except grpc.RpcError as err:
        try:
            status = rpc_status.from_call(err)  # type: ignore[arg-type]
        except Exception:
            status = None
        return answer_of(status, err.code(), err.details() or "",  # type: ignore[attr-defined]
                         responses)
    return Answer(grpc.StatusCode.OK, "", {}, "", responses)


def methods() -> Iterator[tuple[str, str]]:
    """(full method, kind) of every RPC of Ledger, RunStore and EngineStore."""
    from fencepost.v1 import engine_store_pb2, ledger_pb2, run_store_pb2

    for fd, name in ((ledger_pb2, "Ledger"), (run_store_pb2, "RunStore"),
                     (engine_store_pb2, "EngineStore")):
        svc = fd.DESCRIPTOR.services_by_name[name]
        for m in svc.methods:
            kind = (f"{'stream' if m.client_streaming else 'unary'}_"
                    f"{'stream' if m.server_streaming else 'unary'}")
            yield f"/{svc.full_name}/{m.name}", kind
