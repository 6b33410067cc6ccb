"""Register servicers from their proto descriptors, with a request decoder that
never raises: undecodable bytes (bad UTF-8, truncated fields) reach the handler
as ``Malformed`` and are answered RUN_VALIDATION_ERROR naming ``request``,
instead of gRPC's generic UNKNOWN with a parser traceback."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError


@dataclass(frozen=True, slots=True)
class Malformed:
    type_name: str
    error: str


def _decoder(cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(cls.DESCRIPTOR.full_name, str(exc).split(":")[-1].strip())

    return decode


Instrument = Callable[[str, str, Callable[..., Any]], Callable[..., Any]]


def add_service(
    server: grpc.aio.Server,
    servicer: object,
    service: ServiceDescriptor,
    instrument: Instrument | None = None,
) -> None:
    """``instrument(service, method, fn)`` may wrap each handler (metrics)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        fn = getattr(servicer, method.name)
        if instrument is not None:
            fn = instrument(service.full_name, method.name, fn)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            fn,
            request_deserializer=_decoder(req_cls),
            response_serializer=resp_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
