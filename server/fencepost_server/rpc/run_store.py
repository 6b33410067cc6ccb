"""fencepost.v1.RunStore: the raw three-method seam plus a declaration (docs/SPEC.md §7)."""

from __future__ import annotations

import grpc

from fencepost.v1 import run_store_pb2 as pb
from fencepost.v1 import run_store_pb2_grpc

from .. import auth
from ..core import ledger as L
from ..core import validate
from ..writer import Reads, Writer
from . import convert
from .status import handler


class RunStoreService(run_store_pb2_grpc.RunStoreServicer):
    def __init__(self, writer: Writer, reads: Reads) -> None:
        self.writer = writer
        self.reads = reads

    @handler
    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            atomicity=pb.ATOMICITY_CROSS_PROCESS, backend=self.writer.storage.backend, schema=1
        )

    @handler
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetResponse:
        validate.run_id(request.run_id)
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
        result = await self.writer.submit(convert.raw_create(request))
        assert isinstance(result, L.Created)
        return pb.CreateResponse(created=result.created, run=convert.record_to_pb(result.record))

    @handler
    async def CompareAndSet(
        self, request: pb.CompareAndSetRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompareAndSetResponse:
        cmd = convert.raw_cas(request)
        cmd.bound_to = auth.bound_to(auth.current())
        result = await self.writer.submit(cmd)
        assert isinstance(result, L.Swapped)
        resp = pb.CompareAndSetResponse(swapped=result.swapped)
        if result.record is not None:
            resp.run.CopyFrom(convert.record_to_pb(result.record))
        return resp

    @handler
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        cmd = convert.raw_delete(request)
        cmd.bound_to = auth.bound_to(auth.current())
        result = await self.writer.submit(cmd)
        assert isinstance(result, L.Deleted)
        return pb.DeleteResponse(deleted=result.deleted, revision=result.revision)
