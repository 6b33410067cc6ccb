"""Run the unary ledger tests over the Execute stream too: an
adapter with the unary stub's method names that sends each command over one
real Execute stream and turns a result's error back into a grpc.RpcError
carrying the same rich status, so the same assertions apply."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from google.rpc import status_pb2

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

KIND_OF = {
    "Acquire": "acquire",
    "Renew": "renew",
    "RecordCheckpoint": "record_checkpoint",
    "Suspend": "suspend",
    "Finish": "finish",
    "Release": "release",
    "Cancel": "cancel",
    "RequestResume": "request_resume",
    "DeleteRun": "delete_run",
    "Transact": "transaction",
}

# EngineStore RPC -> its field in ledger.proto's Command / CommandResult oneofs
ENGINE_KIND_OF = {
    "CreateRun": "create_run",
    "UpdateRun": "update_run",
    "ClaimRun": "claim_run",
    "RenewClaim": "renew_claim",
    "AppendStep": "append_step",
    "SaveCheckpoint": "save_checkpoint",
    "ClaimKey": "claim_key",
    "AcquireLock": "acquire_lock",
    "ReleaseLock": "release_lock",
    "PutEffect": "put_effect",
    "KvSet": "kv_set",
    "DocUpsert": "doc_upsert",
    "DocDelete": "doc_delete",
}


class StreamedError(grpc.RpcError):
    """A command's error result, shaped like a failed unary call."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self._status = status

    def code(self) -> grpc.StatusCode:
        return next(c for c in grpc.StatusCode if c.value[0] == self._status.code)

    def details(self) -> str:
        return self._status.message

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return (("grpc-status-details-bin", self._status.SerializeToString()),)


class StreamLedger:
    """Ledger commands over one Execute stream; everything else unary."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._unary = ledger_pb2_grpc.LedgerStub(channel)
        self._open()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._results: dict[int, pb.CommandResult] = {}

    def _open(self) -> None:
        self._requests: queue.Queue[pb.ExecuteRequest | None] = queue.Queue()
        self._responses = self._unary.Execute(self._feed(self._requests))

    @staticmethod
    def _feed(requests: queue.Queue[pb.ExecuteRequest | None]) -> Iterator[pb.ExecuteRequest]:
        while (req := requests.get()) is not None:
            yield req

    def _call(self, kind: str, request: Any) -> Any:
        with self._lock:  # one command in flight per adapter: answers in order
            if self._responses.done():  # ended between calls (server restart): reconnect
                self._open()
            cid = next(self._ids)
            self._requests.put(pb.ExecuteRequest(commands=[pb.Command(id=cid, **{kind: request})]))
            try:
                while cid not in self._results:
                    for result in next(self._responses).results:
                        self._results[result.id] = result
            except grpc.RpcError:  # the stream itself failed: reconnect, as a client would
                self._requests.put(None)
                self._open()
                raise
            result = self._results.pop(cid)
        if result.WhichOneof("kind") == "error":
            raise StreamedError(result.error)
        assert result.WhichOneof("kind") == kind
        return getattr(result, kind)

    def __getattr__(self, name: str) -> Any:
        kind = KIND_OF.get(name)
        if kind is None:
            return getattr(self._unary, name)
        return lambda request, **_: self._call(kind, request)

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()
