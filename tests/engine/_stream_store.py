"""Run the engine-store tests over Ledger.Execute too: an adapter
with the EngineStore stub's method names that sends each unary mutation as a
command on one real Execute stream (and turns an error result back into a
grpc.RpcError with the same rich status), while reads and PutArtifact, which
stay off the stream, go to the unary stub. The stream machinery is the ledger
adapter's (tests/service/_transport.py), so both behave alike."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from service._transport import (  # tests/ is on sys.path (tests/conftest.py)
    ENGINE_KIND_OF,
    StreamLedger,
)

from fencepost.v1 import engine_store_pb2_grpc


class StreamEngineStore(StreamLedger):
    """EngineStore mutations over one Execute stream; everything else unary."""

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)
        self._engine = engine_store_pb2_grpc.EngineStoreStub(channel)

    def __getattr__(self, name: str) -> Any:
        kind = ENGINE_KIND_OF.get(name)
        if kind is None:
            return getattr(self._engine, name)
        return lambda request, **_: self._call(kind, request)


@contextmanager
def engine_client(channel: grpc.Channel, transport: str) -> Iterator[Any]:
    """The EngineStore stub ("unary"), or the adapter that sends its
    mutations over Ledger.Execute ("stream")."""
    if transport == "unary":
        yield engine_store_pb2_grpc.EngineStoreStub(channel)
        return
    assert transport == "stream", transport
    stream = StreamEngineStore(channel)
    try:
        yield stream
    finally:
        stream.close()
