"""fencepost.v1.RunStore: the raw three-method seam plus a declaration (docs/SPEC.md §7)."""

from __future__ import annotations

from typing import Any

import grpc

from fencepost.v1 import run_store_pb2 as pb
from fencepost.v1 import run_store_pb2_grpc

from .. import auth
from ..core import validate
from ..writer import Reads, Writer
from . import convert
from .commands import KINDS
from .status import handler


class RunStoreService(run_store_pb2_grpc.RunStoreServicer):
    def __init__(self, writer: Writer, reads: Reads, *, backend: str) -> None:
        self.writer = writer
        self.reads = reads
        self.backend = backend  # what Describe names: "sqlite" or "postgresql"

    async def _answer(self, kind: str, request: Any, response: Any) -> Any:
        """A raw-seam command from the registry; a compare-and-set or delete
        is bound to the caller's principal (auth.bound_to)."""
        entry = KINDS[kind]
        cmd = entry.to_command(request)
        if kind != "raw_create":
            cmd.bound_to = auth.bound_to(auth.current())
        entry.fill(response, await self.writer.submit(cmd))
        return response

    @handler
    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            atomicity=pb.ATOMICITY_CROSS_PROCESS, backend=self.backend, schema=1)

    @handler
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetResponse:
        validate.run_id(request.run_id)
        self.writer.check_led(request.run_id)
        revision = self.writer.state.revision
        rec = await self.reads.read_run(request.run_id)
        if rec is None:
            return pb.GetResponse(found=False, revision=revision)
        return pb.GetResponse(
            found=True, run=convert.record_to_pb(rec), revision=max(revision, rec.revision)
        )

    @handler
    async def Create(
        self, request: pb.CreateRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateResponse:
        return await self._answer("raw_create", request, pb.CreateResponse())

    @handler
    async def CompareAndSet(
        self, request: pb.CompareAndSetRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompareAndSetResponse:
        return await self._answer("raw_compare_and_set", request, pb.CompareAndSetResponse())

    @handler
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        return await self._answer("raw_delete", request, pb.DeleteResponse())
