"""Register servicers from their proto descriptors, each method decoded by
``decode.decoder`` (undecodable bytes reach the handler as ``Malformed``) and
wrapped in the interceptors (interceptors.py): guarded when identities are on
(identity, role, owners), gated and instrumented."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from ..auth import Authenticator
from ..core.errors import LedgerError
from .decode import decoder
from .interceptors import gated, guarded

Instrument = Callable[[str, str, Callable[..., Any]], Callable[..., Any]]


def add_service(
    server: grpc.aio.Server,
    servicer: object,
    service: ServiceDescriptor,
    *,
    authn: Authenticator | None = None,
    max_message_bytes: int | None = None,
    instrument: Instrument | None = None,
    gate: Callable[[], LedgerError | None] | None = None,
) -> None:
    """``authn`` guards each handler (auth.py); ``gate()``, before it, refuses
    every call while it returns an error (a standby coordinator: NOT_LEADER);
    ``instrument(service, method, fn)`` may wrap it in turn (metrics:
    refusals by the guard are counted)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        fn = getattr(servicer, method.name)
        if authn is not None:
            fn = guarded(authn, f"/{service.full_name}/{method.name}", fn,
                         unary_request=not method.client_streaming)
        if gate is not None:
            fn = gated(gate, fn)
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
            request_deserializer=decoder(req_cls, max_message_bytes),
            response_serializer=resp_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
