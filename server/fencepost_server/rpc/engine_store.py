"""fencepost.v1.EngineStore (docs/SPEC.md §11): thin handlers.

Each handler validates its request with the input rules of ``core.engine``
(naming the field), builds a command and awaits the writer, or reads through
the ``EngineReads`` it is handed (read-only connections in reader threads);
then converts the answer to protobuf. The rules live in ``core.engine``, the
SQL behind both seams under the writer.

Every unary mutation is two synchronous functions, request -> writer command
and writer result -> response, listed in ``engine_convert.MUTATIONS``: the unary handlers
and ``Ledger.Execute`` (``rpc/execute.py``) both use them, so the stream
validates, refuses and answers exactly as the unary call does.

Lists are server-streamed in pages built in the reader threads. PutArtifact
stages each chunk as a writer command the moment it arrives (at most
``STAGE_IN_FLIGHT`` uncommitted), so a large artifact never sits whole in
memory; any failure or cancellation discards the staged upload.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from fencepost.v1 import engine_store_pb2 as pb
from fencepost.v1 import engine_store_pb2_grpc

from ..core import engine as E
from ..core.errors import Code, LedgerError, validation
from ..core.shards import compound_key
from ..writer import Writer
from . import engine_convert as EC
from .commands import KINDS
from .decode import Malformed
from .status import handler

log = logging.getLogger("fencepost.engine_store")

# Chunks of one upload queued to the writer but not yet committed.
STAGE_IN_FLIGHT = 4

P = TypeVar("P")


class EngineReads(Protocol):
    """The committed reads the service needs. Listings yield the pages
    ``make_page`` builds, each read in a reader thread, all one snapshot; a
    read the database could not answer raises STORAGE_UNAVAILABLE."""

    async def get_run(self, run_id: str) -> E.Run | None: ...
    def list_runs(
        self, make_page: Callable[[list[E.Run], int], P], *, agent: str | None,
        statuses: Sequence[str], concurrency_key: str | None, limit: int | None, offset: int,
    ) -> AsyncIterator[P]: ...
    def list_steps(
        self, make_page: Callable[[list[E.Step]], P], run_id: str) -> AsyncIterator[P]: ...
    async def latest_checkpoint(self, run_id: str) -> E.Checkpoint | None: ...
    async def get_effect(self, key: str) -> tuple[str, int] | None: ...
    async def kv_get(self, agent: str, key: str) -> tuple[str, int] | None: ...
    def doc_list(
        self, make_page: Callable[[list[E.Doc]], P], *, agent: str, collection: str,
        where: dict[str, Any], limit: int | None,
    ) -> AsyncIterator[P]: ...
    async def get_artifact(self, art_id: str) -> E.Artifact | None: ...
    async def artifact_exists(self, art_id: str) -> bool: ...
    async def artifact_layout(self, art_id: str) -> tuple[E.Artifact, str, int] | None: ...
    async def read_chunk(self, upload_id: str, seq: int) -> bytes | None: ...
    def list_artifacts(
        self, make_page: Callable[[list[E.Artifact]], P], run_id: str) -> AsyncIterator[P]: ...


# -- the servicer ----------------------------------------------------------------------


class EngineStoreService(engine_store_pb2_grpc.EngineStoreServicer):
    def __init__(self, writer: Writer, reader: EngineReads) -> None:
        self.writer = writer
        self.reader = reader
        self._background: set[asyncio.Task[Any]] = set()

    async def _submit(self, cmd: object) -> Any:
        return await self.writer.submit(cmd)  # type: ignore[arg-type]

    async def _mutate(self, kind: str, request: Any) -> Any:
        """A unary mutation through the command registry, as Execute runs it."""
        entry = KINDS[kind]
        assert entry.to_response is not None
        return entry.to_response(await self._submit(entry.to_command(request)))

    async def _stream(self, context: grpc.aio.ServicerContext, pages: AsyncIterator[Any]) -> None:
        try:
            async for page in pages:
                await context.write(page)
        finally:
            await pages.aclose()  # type: ignore[attr-defined]

    # -- runs --------------------------------------------------------------------------

    @handler
    async def CreateRun(
        self, request: pb.EngineCreateRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineCreateRunResponse:
        return await self._mutate("create_run", request)

    @handler
    async def GetRun(
        self, request: pb.EngineGetRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineGetRunResponse:
        run_id = E.ident("id", request.id)
        self.writer.check_led(run_id)
        run = await self.reader.get_run(run_id)
        if run is None:
            return pb.EngineGetRunResponse(found=False)
        return pb.EngineGetRunResponse(found=True, run=EC.run_to_pb(run))

    @handler
    async def UpdateRun(
        self, request: pb.EngineUpdateRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineUpdateRunResponse:
        return await self._mutate("update_run", request)

    @handler
    async def ListRuns(  # type: ignore[override]
        self, request: pb.EngineListRunsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        agent = EC.opt_text(request, "agent", "agent", E.MAX_NAME_BYTES)
        statuses = EC.statuses_from_pb(request.statuses, "statuses")
        ckey = EC.opt_text(request, "concurrency_key", "concurrency_key", E.MAX_KEY_BYTES)
        limit = EC.limit_from_pb(request)
        offset = E.non_negative("offset", request.offset)
        pages = self.reader.list_runs(EC.runs_page, agent=agent, statuses=statuses,
                                      concurrency_key=ckey, limit=limit, offset=offset)
        await self._stream(context, pages)

    @handler
    async def ClaimRun(
        self, request: pb.EngineClaimRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineClaimRunResponse:
        return await self._mutate("claim_run", request)

    @handler
    async def RenewClaim(
        self, request: pb.EngineRenewClaimRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineRenewClaimResponse:
        return await self._mutate("renew_claim", request)

    # -- steps and checkpoints ---------------------------------------------------------

    @handler
    async def AppendStep(
        self, request: pb.EngineAppendStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineAppendStepResponse:
        return await self._mutate("append_step", request)

    @handler
    async def ListSteps(  # type: ignore[override]
        self, request: pb.EngineListStepsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        run_id = E.ident("run_id", request.run_id)
        self.writer.check_led(run_id)
        await self._stream(context, self.reader.list_steps(EC.steps_page, run_id))

    @handler
    async def SaveCheckpoint(
        self, request: pb.EngineSaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineSaveCheckpointResponse:
        return await self._mutate("save_checkpoint", request)

    @handler
    async def LatestCheckpoint(
        self, request: pb.EngineLatestCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineLatestCheckpointResponse:
        run_id = E.ident("run_id", request.run_id)
        self.writer.check_led(run_id)
        cp = await self.reader.latest_checkpoint(run_id)
        if cp is None:
            return pb.EngineLatestCheckpointResponse(found=False)
        return pb.EngineLatestCheckpointResponse(found=True, checkpoint=EC.checkpoint_to_pb(cp))

    # -- idempotency and locks ---------------------------------------------------------

    @handler
    async def ClaimKey(
        self, request: pb.EngineClaimKeyRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineClaimKeyResponse:
        return await self._mutate("claim_key", request)

    @handler
    async def AcquireLock(
        self, request: pb.EngineAcquireLockRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineAcquireLockResponse:
        return await self._mutate("acquire_lock", request)

    @handler
    async def ReleaseLock(
        self, request: pb.EngineReleaseLockRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineReleaseLockResponse:
        return await self._mutate("release_lock", request)

    # -- effects and state -------------------------------------------------------------

    @handler
    async def GetEffect(
        self, request: pb.EngineGetEffectRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineGetEffectResponse:
        key = E.ident("key", request.key, E.MAX_KEY_BYTES)
        self.writer.check_led(key)
        row = await self.reader.get_effect(key)
        if row is None:
            return pb.EngineGetEffectResponse(found=False)
        return pb.EngineGetEffectResponse(
            found=True, result=pb.JsonValue(json=row[0]), recorded_at=EC.ts(row[1])
        )

    @handler
    async def PutEffect(
        self, request: pb.EnginePutEffectRequest, context: grpc.aio.ServicerContext
    ) -> pb.EnginePutEffectResponse:
        return await self._mutate("put_effect", request)

    @handler
    async def KvGet(
        self, request: pb.EngineKvGetRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineKvGetResponse:
        agent = E.ident("agent", request.agent, E.MAX_NAME_BYTES)
        key = E.ident("key", request.key, E.MAX_KEY_BYTES)
        self.writer.check_led(compound_key(agent, key))
        row = await self.reader.kv_get(agent, key)
        if row is None:
            return pb.EngineKvGetResponse(found=False)
        return pb.EngineKvGetResponse(
            found=True, value=pb.JsonValue(json=row[0]), updated_at=EC.ts(row[1])
        )

    @handler
    async def KvSet(
        self, request: pb.EngineKvSetRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineKvSetResponse:
        return await self._mutate("kv_set", request)

    @handler
    async def DocList(  # type: ignore[override]
        self, request: pb.EngineDocListRequest, context: grpc.aio.ServicerContext
    ) -> None:
        agent = E.ident("agent", request.agent, E.MAX_NAME_BYTES)
        collection = E.ident("collection", request.collection, E.MAX_NAME_BYTES)
        self.writer.check_led(compound_key(agent, collection))
        where = E.parse_where(request.where.json if request.HasField("where") else None)
        limit = EC.limit_from_pb(request)
        pages = self.reader.doc_list(EC.docs_page, agent=agent, collection=collection,
                                     where=where, limit=limit)
        await self._stream(context, pages)

    @handler
    async def DocUpsert(
        self, request: pb.EngineDocUpsertRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineDocUpsertResponse:
        return await self._mutate("doc_upsert", request)

    @handler
    async def DocDelete(
        self, request: pb.EngineDocDeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineDocDeleteResponse:
        return await self._mutate("doc_delete", request)

    # -- artifacts ---------------------------------------------------------------------

    @handler
    async def PutArtifact(  # type: ignore[override]
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> pb.EnginePutArtifactResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None:
            raise validation("header", "the stream ended before its header")
        if isinstance(first, Malformed):
            raise validation(first.field, f"undecodable {first.type_name}: {first.error}")
        if first.WhichOneof("part") != "header":
            raise validation("header", "the first message must be the header (bytes came first)")
        hdr = EC.ArtifactHeader(first.header)
        # An id that exists keeps its artifact: its bytes need not be stored again.
        exists = await self.reader.artifact_exists(hdr.id)
        upload_id = "" if exists else uuid.uuid4().hex
        adopted = False
        try:
            digest, received = await self._receive(messages, hdr, upload_id)
            if hdr.sha256 is not None and hdr.sha256 != digest:
                raise validation(
                    "header.sha256", f"the bytes received hash to {digest}, not {hdr.sha256}"
                )
            try:
                res: E.ArtifactCommitted = await self._submit(
                    E.CommitArtifact(
                        id=hdr.id,
                        run_id=hdr.run_id,
                        name=hdr.name,
                        content_type=hdr.content_type,
                        size_bytes=hdr.size_bytes,
                        sha256=digest,
                        metadata=hdr.metadata,
                        upload_id=upload_id,
                        staged_bytes=received,
                        request_id=hdr.request_id,
                        fence=hdr.fence,
                    )
                )
            except LedgerError as exc:
                if exc.field is not None and exc.field.startswith("fence."):
                    exc.field = f"header.{exc.field}"  # the fence is the header's
                    exc.message = exc.message.replace("fence.", "header.fence.", 1)
                raise
            adopted = bool(upload_id) and res.created and res.upload_id == upload_id
            return pb.EnginePutArtifactResponse(
                created=res.created, artifact=EC.artifact_to_pb(res.artifact)
            )
        finally:
            if upload_id and not adopted:
                self._discard(upload_id)

    async def _receive(
        self, messages: AsyncIterator[Any], hdr: EC.ArtifactHeader, upload_id: str
    ) -> tuple[str, int]:
        """Hash and count the chunks, staging each through the writer (at most
        STAGE_IN_FLIGHT uncommitted) when ``upload_id`` is set."""
        hasher = hashlib.sha256()
        received = 0
        seq = 0
        pending: deque[asyncio.Future[Any]] = deque()
        try:
            async for msg in messages:
                if isinstance(msg, Malformed):
                    raise validation(msg.field, f"undecodable {msg.type_name}: {msg.error}")
                part = msg.WhichOneof("part")
                if part == "header":
                    raise validation("header", "a stream carries exactly one header")
                if part != "chunk":
                    raise validation("part", "every message after the header must carry a chunk")
                data = msg.chunk
                if not data:
                    continue
                received += len(data)
                if received > hdr.size_bytes:
                    raise validation(
                        "chunk", f"more bytes than header.size_bytes ({hdr.size_bytes})"
                    )
                hasher.update(data)
                if not upload_id:
                    continue
                if len(pending) >= STAGE_IN_FLIGHT:
                    await pending.popleft()
                pending.append(self._stage(E.StageChunk(upload_id, seq, data)))
                seq += 1
            while pending:
                await pending.popleft()
        finally:
            for fut in pending:  # the write still lands; the discard follows it
                fut.add_done_callback(_consume)
        if received != hdr.size_bytes:
            raise validation(
                "chunk",
                f"the stream ended after {received} of header.size_bytes={hdr.size_bytes} bytes",
            )
        return hasher.hexdigest(), received

    def _stage(self, cmd: E.StageChunk) -> asyncio.Future[Any]:
        """Queue a chunk now (so a later discard is queued after it)."""
        try:
            return self.writer.submit_nowait(cmd)  # type: ignore[arg-type]
        except LedgerError as exc:
            if exc.code is not Code.STORAGE_UNAVAILABLE:
                raise
        # the queue is full: wait for room (still ahead of any later discard)
        return asyncio.ensure_future(self.writer.submit(cmd))  # type: ignore[arg-type]

    def _discard(self, upload_id: str) -> None:
        """Drop a staged upload in the background (also when the caller was
        cancelled): queued behind every chunk of it."""
        task = asyncio.get_running_loop().create_task(self._submit(E.DiscardUpload(upload_id)))
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "discarding an upload failed: %r (the start-up sweep will)", task.exception()
            )

    async def drain(self) -> None:
        """Wait for background discards (at shutdown, before the writer closes)."""
        if self._background:
            await asyncio.wait(list(self._background))

    @handler
    async def GetArtifact(
        self, request: pb.EngineGetArtifactRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineGetArtifactResponse:
        art = await self.reader.get_artifact(E.ident("id", request.id))
        if art is None:
            return pb.EngineGetArtifactResponse(found=False)
        return pb.EngineGetArtifactResponse(found=True, artifact=EC.artifact_to_pb(art))

    @handler
    async def ReadArtifact(  # type: ignore[override]
        self, request: pb.EngineReadArtifactRequest, context: grpc.aio.ServicerContext
    ) -> None:
        art_id = E.ident("id", request.id)
        layout = await self.reader.artifact_layout(art_id)
        if layout is None:
            raise LedgerError(Code.RUN_NOT_FOUND, f"artifact {art_id!r} not found", field="id")
        art, upload_id, chunks = layout
        head = EC.artifact_to_pb(art)
        if chunks == 0:
            await context.write(pb.EngineReadArtifactResponse(artifact=head))
            return
        for seq in range(chunks):
            data = await self.reader.read_chunk(upload_id, seq)
            if data is None:  # deleted meanwhile: its chunks went with it
                raise LedgerError(
                    Code.RUN_NOT_FOUND,
                    f"artifact {art_id!r} was deleted while it was being read "
                    f"({seq} of {chunks} chunks sent)",
                    field="id",
                )
            msg = pb.EngineReadArtifactResponse(chunk=data)
            if seq == 0:
                msg.artifact.CopyFrom(head)
            await context.write(msg)

    @handler
    async def ListArtifacts(  # type: ignore[override]
        self, request: pb.EngineListArtifactsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        run_id = E.ident("run_id", request.run_id)
        self.writer.check_led(run_id)
        await self._stream(context, self.reader.list_artifacts(EC.artifacts_page, run_id))

    @handler
    async def DeleteArtifact(
        self, request: pb.EngineDeleteArtifactRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineDeleteArtifactResponse:
        res: E.Done = await self._submit(EC.delete_artifact_cmd(request))
        return pb.EngineDeleteArtifactResponse(deleted=res.ok)


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve a staged chunk's outcome nobody awaits any more."""
    if not fut.cancelled():
        fut.exception()


async def sweep_uploads(writer: Writer, *, abandoned_only: bool = False) -> None:
    """Remove the artifact uploads a crash left unfinished (the writer runs);
    ``abandoned_only``: those of coordinators no longer taking part."""
    swept: Any = await writer.submit(E.SweepUploads(abandoned_only))  # type: ignore[arg-type]
    if swept.ok:
        log.info("removed %d unfinished artifact uploads", swept.at)
