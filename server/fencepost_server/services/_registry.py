"""Register servicers from their proto descriptors, with a request decoder that
never raises: undecodable bytes (bad UTF-8, truncated fields) reach the handler
as ``Malformed`` and are answered RUN_VALIDATION_ERROR naming ``request``,
instead of gRPC's generic UNKNOWN with a parser traceback. A message over the
server's size limit is ``Malformed`` too (not decoded at all), so it is refused
the same way and never tears down a KeepAlive or Execute stream; gRPC's own
receive limit is set well above it (app.py). With an ``Authenticator`` every
method is wrapped by ``auth.guard`` (identity, role, owners)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from ..auth import Authenticator, guard


@dataclass(frozen=True, slots=True)
class Malformed:
    type_name: str
    error: str


def _decoder(cls: Any, max_bytes: int | None) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return Malformed(
                cls.DESCRIPTOR.full_name,
                f"the message is {len(data)} bytes, over the server's limit of {max_bytes} "
                "(--max-message-bytes)",
            )
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(cls.DESCRIPTOR.full_name, str(exc).split(":")[-1].strip())

    return decode


def add_service(
    server: grpc.aio.Server,
    servicer: object,
    service: ServiceDescriptor,
    *,
    authn: Authenticator | None = None,
    max_message_bytes: int | None = None,
) -> None:
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        fn = getattr(servicer, method.name)
        if authn is not None:
            fn = guard(authn, f"/{service.full_name}/{method.name}", fn,
                       unary_request=not method.client_streaming)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            fn,
            request_deserializer=_decoder(req_cls, max_message_bytes),
            response_serializer=resp_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
