"""The ceiling: a plain grpc.aio server for ``fencepost.v1.Ledger`` that does nothing.

It implements the unary methods the end-to-end workload calls (Acquire, Renew,
RecordCheckpoint, Finish) and answers each with a prebuilt response holding a
small fixed ``Run`` (lease, checkpoint and timestamps set, so messages are the
size fencepost sends back). No validation, no writer, no disk: whatever the
client program measures against it is the cost of Python gRPC on this machine.

    .venv/bin/python bench/echo_server.py --listen 127.0.0.1:0

Prints ``echo serving on HOST:PORT`` when ready; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb

# The same server options fencepost's app uses, so the transport is the same.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.max_send_message_length", 4 * 1024 * 1024),
    ("grpc.max_concurrent_streams", 1024),
    ("grpc.so_reuseport", 0),
]


def fixed_run() -> rpb.Run:
    now = Timestamp(seconds=1_700_000_000, nanos=123_000_000)
    later = Timestamp(seconds=1_700_000_060, nanos=123_000_000)
    return rpb.Run(
        schema=1,
        run_id="bench-r0-p0-c00-000000",
        version=3,
        status=rpb.RUN_STATUS_RUNNING,
        attempt=1,
        fencing_token=1,
        lease=rpb.Lease(owner="bench-p0-c00", acquired_at=now, expires_at=later, ttl_ms=60_000),
        checkpoint_ref=rpb.CheckpointRef(key="ckpt/0", snapshot_version=1, saved_at=now),
        created_at=now,
        updated_at=now,
        revision=12_345,
    )


class EchoLedger(ledger_pb2_grpc.LedgerServicer):
    """Answers without looking at the request."""

    def __init__(self) -> None:
        run = fixed_run()
        self._acquire = pb.AcquireResponse(run=run)
        self._renew = pb.RenewResponse(run=run)
        self._checkpoint = pb.RecordCheckpointResponse(run=run)
        self._finish = pb.FinishResponse(run=run)
        self._by_kind = {
            "acquire": self._acquire,
            "renew": self._renew,
            "record_checkpoint": self._checkpoint,
            "finish": self._finish,
            "release": pb.ReleaseResponse(run=run),
        }

    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireResponse:
        return self._acquire

    async def Renew(
        self, request: pb.RenewRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewResponse:
        return self._renew

    async def RecordCheckpoint(
        self, request: pb.RecordCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordCheckpointResponse:
        return self._checkpoint

    async def Finish(
        self, request: pb.FinishRequest, context: grpc.aio.ServicerContext
    ) -> pb.FinishResponse:
        return self._finish

    async def Execute(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExecuteResponse]:
        """Each message answered at once, every command with the prebuilt
        response of its kind (a kind it has none for: UNIMPLEMENTED)."""
        by_kind = self._by_kind
        async for request in request_iterator:
            response = pb.ExecuteResponse()
            for cmd in request.commands:
                result = response.results.add(id=cmd.id)
                kind = cmd.WhichOneof("kind") or ""
                answer = by_kind.get(kind)
                if answer is None:
                    result.error.code = grpc.StatusCode.UNIMPLEMENTED.value[0]
                    result.error.message = "the echo server answers lifecycle commands only"
                else:
                    getattr(result, kind).CopyFrom(answer)
            yield response


async def serve(listen: str) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    ledger_pb2_grpc.add_LedgerServicer_to_server(EchoLedger(), server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise SystemExit(f"echo: could not listen on {listen}")
    await server.start()
    host = listen.rsplit(":", 1)[0]
    print(f"echo serving on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    print("echo stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="address (default: a free port)")
    args = parser.parse_args(argv)
    if not args.listen.startswith("127.0.0.1:"):
        parser.error("the echo server listens on 127.0.0.1 only")
    asyncio.run(serve(args.listen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
