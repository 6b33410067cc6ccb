"""fencepost.v1.EngineStore (docs/SPEC.md §11): thin handlers.

Each handler validates its request with the input rules of ``core.engine``
(naming the field), builds a command and awaits the writer, or reads through
the ``EngineReader`` (read-only connections in reader threads); then converts
the answer to protobuf. The rules live in ``core.engine``, the SQL in
``storage/engine_sql.py``.

Every unary mutation is two synchronous functions, request -> writer command
and writer result -> response, listed in ``MUTATIONS``: the unary handlers
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
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from fencepost.v1 import engine_store_pb2 as pb
from fencepost.v1 import engine_store_pb2_grpc

from ..core import engine as E
from ..core import validate
from ..core.errors import Code, LedgerError, validation
from ..storage import engine_sql as Q
from ..storage.engine_sql import EngineReader
from ..writer import Writer
from .convert import fence_from_pb
from .decode import Malformed
from .status import handler

log = logging.getLogger("fencepost.engine_store")

# Chunks of one upload queued to the writer but not yet committed.
STAGE_IN_FLIGHT = 4

# -- conversions -----------------------------------------------------------------------


def _ts(ms: int) -> Timestamp:
    seconds, millis = divmod(ms, 1000)
    return Timestamp(seconds=seconds, nanos=millis * 1_000_000)


def _set_json(msg: Any, name: str, text: str | None) -> None:
    if text is not None:
        getattr(msg, name).json = text


def run_to_pb(r: E.Run) -> pb.EngineRun:
    msg = pb.EngineRun(
        id=r.id,
        agent=r.agent,
        status=r.status,
        created_at=_ts(r.created_at),
        updated_at=_ts(r.updated_at),
    )
    if r.concurrency_key is not None:
        msg.concurrency_key = r.concurrency_key
    _set_json(msg, "input", r.input)
    _set_json(msg, "output", r.output)
    _set_json(msg, "error", r.error)
    _set_json(msg, "metadata", r.metadata)
    if r.claim is not None:
        msg.claim.owner = r.claim.owner
        msg.claim.expires_at.CopyFrom(_ts(r.claim.expires_at))
    return msg


def step_to_pb(s: E.Step) -> pb.EngineStep:
    msg = pb.EngineStep(run_id=s.run_id, seq=s.seq, name=s.name, created_at=_ts(s.created_at))
    if s.status is not None:
        msg.status = s.status
    _set_json(msg, "input", s.input)
    _set_json(msg, "output", s.output)
    _set_json(msg, "error", s.error)
    _set_json(msg, "metadata", s.metadata)
    return msg


def checkpoint_to_pb(c: E.Checkpoint) -> pb.EngineCheckpoint:
    return pb.EngineCheckpoint(
        run_id=c.run_id,
        step_index=c.step_index,
        state=pb.JsonValue(json=c.state),
        saved_at=_ts(c.saved_at),
    )


def doc_to_pb(d: E.Doc) -> pb.EngineDoc:
    return pb.EngineDoc(id=d.id, doc=pb.JsonValue(json=d.doc), updated_at=_ts(d.updated_at))


def artifact_to_pb(a: E.Artifact) -> pb.EngineArtifact:
    msg = pb.EngineArtifact(
        id=a.id,
        run_id=a.run_id,
        name=a.name,
        content_type=a.content_type,
        size_bytes=a.size_bytes,
        sha256=a.sha256,
        created_at=_ts(a.created_at),
    )
    _set_json(msg, "metadata", a.metadata)
    return msg


def _runs_page(runs: list[E.Run], total: int) -> pb.EngineListRunsResponse:
    return pb.EngineListRunsResponse(runs=[run_to_pb(r) for r in runs], total=total)


def _steps_page(steps: list[E.Step]) -> pb.EngineListStepsResponse:
    return pb.EngineListStepsResponse(steps=[step_to_pb(s) for s in steps])


def _docs_page(docs: list[E.Doc]) -> pb.EngineDocListResponse:
    return pb.EngineDocListResponse(docs=[doc_to_pb(d) for d in docs])


def _artifacts_page(arts: list[E.Artifact]) -> pb.EngineListArtifactsResponse:
    return pb.EngineListArtifactsResponse(artifacts=[artifact_to_pb(a) for a in arts])


# -- request -> command (input rules from core.engine) ---------------------------------


def _json(msg: Any, name: str, field: str) -> str | None:
    """The JSON text of an optional JsonValue field (None when absent)."""
    if not msg.HasField(name):
        return None
    return E.json_text(field, getattr(msg, name).json)


def _required_json(msg: Any, name: str, field: str) -> str:
    if not msg.HasField(name):
        raise validation(field, "is required (send the JSON text `null` for a null)")
    return E.json_text(field, getattr(msg, name).json)


def _opt_text(msg: Any, name: str, field: str, max_bytes: int) -> str | None:
    if not msg.HasField(name):
        return None
    return E.ident(field, getattr(msg, name), max_bytes)


def _read_only(msg: Any, names: tuple[str, ...], prefix: str) -> None:
    for name in names:
        if msg.HasField(name):
            raise validation(f"{prefix}.{name}", "is set by the server; leave it absent")


def _statuses(values: Any, field: str) -> tuple[str, ...]:
    if len(values) > E.MAX_FILTER_VALUES:
        raise validation(field, f"at most {E.MAX_FILTER_VALUES} entries (got {len(values)})")
    return tuple(E.ident(f"{field}[{i}]", v, E.MAX_STATUS_BYTES) for i, v in enumerate(values))


def _limit(msg: Any) -> int | None:
    return E.non_negative("limit", msg.limit) if msg.HasField("limit") else None


def create_run_cmd(req: pb.EngineCreateRunRequest) -> E.CreateRun:
    if not req.HasField("run"):
        raise validation("run", "is required")
    r = req.run
    _read_only(r, ("claim", "created_at", "updated_at"), "run")
    return E.CreateRun(
        id=E.ident("run.id", r.id),
        agent=E.ident("run.agent", r.agent, E.MAX_NAME_BYTES),
        status=E.ident("run.status", r.status, E.MAX_STATUS_BYTES),
        concurrency_key=_opt_text(r, "concurrency_key", "run.concurrency_key", E.MAX_KEY_BYTES),
        input=_json(r, "input", "run.input"),
        output=_json(r, "output", "run.output"),
        error=_json(r, "error", "run.error"),
        metadata=_json(r, "metadata", "run.metadata"),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def update_run_cmd(req: pb.EngineUpdateRunRequest) -> E.UpdateRun:
    p = req.patch
    clear = tuple(dict.fromkeys(p.clear))
    for i, name in enumerate(clear):
        if name not in E.RUN_CLEARABLE:
            raise validation(
                f"patch.clear[{i}]", f"unknown field {name!r}; one of {list(E.RUN_CLEARABLE)}"
            )
        if name != "claim" and p.HasField(name):  # type: ignore[arg-type]
            raise validation(f"patch.{name}", "is both set and cleared")
    patch = E.RunPatch(
        status=_opt_text(p, "status", "patch.status", E.MAX_STATUS_BYTES),
        concurrency_key=_opt_text(p, "concurrency_key", "patch.concurrency_key", E.MAX_KEY_BYTES),
        input=_json(p, "input", "patch.input"),
        output=_json(p, "output", "patch.output"),
        error=_json(p, "error", "patch.error"),
        metadata=_json(p, "metadata", "patch.metadata"),
        clear=clear,
    )
    return E.UpdateRun(
        id=E.ident("id", req.id),
        patch=patch,
        expect_status=_statuses(req.expect_status, "expect_status"),
        expect_owner=_opt_text(req, "expect_owner", "expect_owner", E.MAX_NAME_BYTES),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def append_step_cmd(req: pb.EngineAppendStepRequest) -> E.AppendStep:
    if not req.HasField("step"):
        raise validation("step", "is required")
    s = req.step
    if s.seq:
        raise validation("step.seq", "is assigned by the server; leave it 0")
    _read_only(s, ("created_at",), "step")
    return E.AppendStep(
        run_id=E.ident("step.run_id", s.run_id),
        name=E.ident("step.name", s.name, E.MAX_NAME_BYTES),
        status=_opt_text(s, "status", "step.status", E.MAX_STATUS_BYTES),
        input=_json(s, "input", "step.input"),
        output=_json(s, "output", "step.output"),
        error=_json(s, "error", "step.error"),
        metadata=_json(s, "metadata", "step.metadata"),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def save_checkpoint_cmd(req: pb.EngineSaveCheckpointRequest) -> E.SaveCheckpoint:
    if not req.HasField("checkpoint"):
        raise validation("checkpoint", "is required")
    c = req.checkpoint
    _read_only(c, ("saved_at",), "checkpoint")
    return E.SaveCheckpoint(
        run_id=E.ident("checkpoint.run_id", c.run_id),
        step_index=E.non_negative("checkpoint.step_index", c.step_index),
        state=_required_json(c, "state", "checkpoint.state"),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


_C = TypeVar("_C", E.ClaimRun, E.RenewClaim)


def _claim_cmd(cls: type[_C], req: Any) -> _C:
    """ClaimRun and RenewClaim take the same fields."""
    return cls(
        id=E.ident("id", req.id),
        owner=E.ident("owner", req.owner, E.MAX_NAME_BYTES),
        ttl_ms=E.ttl(req.ttl_ms),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def claim_run_cmd(req: pb.EngineClaimRunRequest) -> E.ClaimRun:
    return _claim_cmd(E.ClaimRun, req)


def renew_claim_cmd(req: pb.EngineRenewClaimRequest) -> E.RenewClaim:
    return _claim_cmd(E.RenewClaim, req)


def claim_key_cmd(req: pb.EngineClaimKeyRequest) -> E.ClaimKey:
    return E.ClaimKey(
        scope=E.ident("scope", req.scope, E.MAX_KEY_BYTES),
        key=E.ident("key", req.key, E.MAX_KEY_BYTES),
        run_id=E.ident("run_id", req.run_id),
        ttl_ms=E.ttl(req.ttl_ms),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def acquire_lock_cmd(req: pb.EngineAcquireLockRequest) -> E.AcquireLock:
    return E.AcquireLock(
        key=E.ident("key", req.key, E.MAX_KEY_BYTES),
        owner=E.ident("owner", req.owner, E.MAX_NAME_BYTES),
        ttl_ms=E.ttl(req.ttl_ms),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def release_lock_cmd(req: pb.EngineReleaseLockRequest) -> E.ReleaseLock:
    return E.ReleaseLock(
        key=E.ident("key", req.key, E.MAX_KEY_BYTES),
        owner=E.ident("owner", req.owner, E.MAX_NAME_BYTES),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def put_effect_cmd(req: pb.EnginePutEffectRequest) -> E.PutEffect:
    return E.PutEffect(
        key=E.ident("key", req.key, E.MAX_KEY_BYTES),
        result=_required_json(req, "result", "result"),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def kv_set_cmd(req: pb.EngineKvSetRequest) -> E.KvSet:
    return E.KvSet(
        agent=E.ident("agent", req.agent, E.MAX_NAME_BYTES),
        key=E.ident("key", req.key, E.MAX_KEY_BYTES),
        value=_required_json(req, "value", "value"),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def doc_upsert_cmd(req: pb.EngineDocUpsertRequest) -> E.DocUpsert:
    if not req.HasField("doc"):
        raise validation("doc", "is required")
    return E.DocUpsert(
        agent=E.ident("agent", req.agent, E.MAX_NAME_BYTES),
        collection=E.ident("collection", req.collection, E.MAX_NAME_BYTES),
        id=E.ident("id", req.id),
        doc=E.json_object("doc", req.doc.json),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def doc_delete_cmd(req: pb.EngineDocDeleteRequest) -> E.DocDelete:
    return E.DocDelete(
        agent=E.ident("agent", req.agent, E.MAX_NAME_BYTES),
        collection=E.ident("collection", req.collection, E.MAX_NAME_BYTES),
        id=E.ident("id", req.id),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


def delete_artifact_cmd(req: pb.EngineDeleteArtifactRequest) -> E.DeleteArtifact:
    return E.DeleteArtifact(
        id=E.ident("id", req.id),
        request_id=validate.request_id(req.request_id),
        fence=fence_from_pb(req),
    )


# -- writer result -> response ----------------------------------------------------------


def _maybe_run(run: E.Run | None) -> pb.EngineRun | None:
    return run_to_pb(run) if run is not None else None


def create_run_response(res: E.RunCreated) -> pb.EngineCreateRunResponse:
    return pb.EngineCreateRunResponse(created=res.created, run=run_to_pb(res.run))


def update_run_response(run: E.Run) -> pb.EngineUpdateRunResponse:
    return pb.EngineUpdateRunResponse(run=run_to_pb(run))


def claim_run_response(res: E.RunClaimed) -> pb.EngineClaimRunResponse:
    return pb.EngineClaimRunResponse(claimed=res.ok, run=_maybe_run(res.run))


def renew_claim_response(res: E.RunClaimed) -> pb.EngineRenewClaimResponse:
    return pb.EngineRenewClaimResponse(renewed=res.ok, run=_maybe_run(res.run))


def append_step_response(step: E.Step) -> pb.EngineAppendStepResponse:
    return pb.EngineAppendStepResponse(step=step_to_pb(step))


def save_checkpoint_response(res: E.CheckpointSaved) -> pb.EngineSaveCheckpointResponse:
    return pb.EngineSaveCheckpointResponse(
        saved=res.saved, checkpoint=checkpoint_to_pb(res.checkpoint)
    )


def claim_key_response(res: E.KeyClaimed) -> pb.EngineClaimKeyResponse:
    return pb.EngineClaimKeyResponse(
        created=res.created, run_id=res.run_id, expires_at=_ts(res.expires_at)
    )


def acquire_lock_response(res: E.LockAnswer) -> pb.EngineAcquireLockResponse:
    return pb.EngineAcquireLockResponse(
        acquired=res.acquired,
        fencing_token=res.fencing_token,
        owner=res.owner,
        expires_at=_ts(res.expires_at),
    )


def release_lock_response(res: E.Done) -> pb.EngineReleaseLockResponse:
    return pb.EngineReleaseLockResponse(released=res.ok)


def put_effect_response(res: E.Done) -> pb.EnginePutEffectResponse:
    return pb.EnginePutEffectResponse(recorded_at=_ts(res.at))


def kv_set_response(res: E.Done) -> pb.EngineKvSetResponse:
    return pb.EngineKvSetResponse(updated_at=_ts(res.at))


def doc_upsert_response(res: E.DocUpserted) -> pb.EngineDocUpsertResponse:
    return pb.EngineDocUpsertResponse(created=res.created, doc=doc_to_pb(res.doc))


def doc_delete_response(res: E.Done) -> pb.EngineDocDeleteResponse:
    return pb.EngineDocDeleteResponse(deleted=res.ok)


# The unary mutations, keyed by their field in ledger.proto's Command and
# CommandResult oneofs: (request -> writer command, writer result -> response).
# Ledger.Execute dispatches on this table; the handlers below use the same
# functions, so both transports share one code path.
MUTATIONS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "create_run": (create_run_cmd, create_run_response),
    "update_run": (update_run_cmd, update_run_response),
    "claim_run": (claim_run_cmd, claim_run_response),
    "renew_claim": (renew_claim_cmd, renew_claim_response),
    "append_step": (append_step_cmd, append_step_response),
    "save_checkpoint": (save_checkpoint_cmd, save_checkpoint_response),
    "claim_key": (claim_key_cmd, claim_key_response),
    "acquire_lock": (acquire_lock_cmd, acquire_lock_response),
    "release_lock": (release_lock_cmd, release_lock_response),
    "put_effect": (put_effect_cmd, put_effect_response),
    "kv_set": (kv_set_cmd, kv_set_response),
    "doc_upsert": (doc_upsert_cmd, doc_upsert_response),
    "doc_delete": (doc_delete_cmd, doc_delete_response),
}


class _Header:
    """A validated PutArtifact header."""

    def __init__(self, h: pb.EngineArtifactHeader) -> None:
        self.id = E.ident("header.id", h.id)
        self.run_id = E.ident("header.run_id", h.run_id)
        self.name = E.optional_text("header.name", h.name, E.MAX_ARTIFACT_NAME_BYTES)
        self.content_type = E.optional_text(
            "header.content_type", h.content_type, E.MAX_CONTENT_TYPE_BYTES
        )
        self.size_bytes = E.non_negative("header.size_bytes", h.size_bytes)
        self.sha256 = E.sha256_hex("header.sha256", h.sha256) if h.HasField("sha256") else None
        self.metadata = _json(h, "metadata", "header.metadata")
        self.request_id = validate.request_id(h.request_id)
        self.fence = fence_from_pb(h, "header.fence")


# -- the servicer ----------------------------------------------------------------------


class EngineStoreService(engine_store_pb2_grpc.EngineStoreServicer):
    def __init__(self, writer: Writer, reader: EngineReader) -> None:
        self.writer = writer
        self.reader = reader
        self._background: set[asyncio.Task[Any]] = set()

    async def _submit(self, cmd: object) -> Any:
        return await self.writer.submit(cmd)  # type: ignore[arg-type]

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
        return create_run_response(await self._submit(create_run_cmd(request)))

    @handler
    async def GetRun(
        self, request: pb.EngineGetRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineGetRunResponse:
        run = await self.reader.run(Q.get_run, E.ident("id", request.id))
        if run is None:
            return pb.EngineGetRunResponse(found=False)
        return pb.EngineGetRunResponse(found=True, run=run_to_pb(run))

    @handler
    async def UpdateRun(
        self, request: pb.EngineUpdateRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineUpdateRunResponse:
        return update_run_response(await self._submit(update_run_cmd(request)))

    @handler
    async def ListRuns(  # type: ignore[override]
        self, request: pb.EngineListRunsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        agent = _opt_text(request, "agent", "agent", E.MAX_NAME_BYTES)
        statuses = _statuses(request.statuses, "statuses")
        ckey = _opt_text(request, "concurrency_key", "concurrency_key", E.MAX_KEY_BYTES)
        limit = _limit(request)
        offset = E.non_negative("offset", request.offset)
        pages = self.reader.pages(
            Q.list_runs,
            _runs_page,
            agent=agent,
            statuses=statuses,
            concurrency_key=ckey,
            limit=limit,
            offset=offset,
        )
        await self._stream(context, pages)

    @handler
    async def ClaimRun(
        self, request: pb.EngineClaimRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineClaimRunResponse:
        return claim_run_response(await self._submit(claim_run_cmd(request)))

    @handler
    async def RenewClaim(
        self, request: pb.EngineRenewClaimRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineRenewClaimResponse:
        return renew_claim_response(await self._submit(renew_claim_cmd(request)))

    # -- steps and checkpoints ---------------------------------------------------------

    @handler
    async def AppendStep(
        self, request: pb.EngineAppendStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineAppendStepResponse:
        return append_step_response(await self._submit(append_step_cmd(request)))

    @handler
    async def ListSteps(  # type: ignore[override]
        self, request: pb.EngineListStepsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        run_id = E.ident("run_id", request.run_id)
        await self._stream(context, self.reader.pages(Q.list_steps, _steps_page, run_id))

    @handler
    async def SaveCheckpoint(
        self, request: pb.EngineSaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineSaveCheckpointResponse:
        return save_checkpoint_response(await self._submit(save_checkpoint_cmd(request)))

    @handler
    async def LatestCheckpoint(
        self, request: pb.EngineLatestCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineLatestCheckpointResponse:
        cp = await self.reader.run(Q.latest_checkpoint, E.ident("run_id", request.run_id))
        if cp is None:
            return pb.EngineLatestCheckpointResponse(found=False)
        return pb.EngineLatestCheckpointResponse(found=True, checkpoint=checkpoint_to_pb(cp))

    # -- idempotency and locks ---------------------------------------------------------

    @handler
    async def ClaimKey(
        self, request: pb.EngineClaimKeyRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineClaimKeyResponse:
        return claim_key_response(await self._submit(claim_key_cmd(request)))

    @handler
    async def AcquireLock(
        self, request: pb.EngineAcquireLockRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineAcquireLockResponse:
        return acquire_lock_response(await self._submit(acquire_lock_cmd(request)))

    @handler
    async def ReleaseLock(
        self, request: pb.EngineReleaseLockRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineReleaseLockResponse:
        return release_lock_response(await self._submit(release_lock_cmd(request)))

    # -- effects and state -------------------------------------------------------------

    @handler
    async def GetEffect(
        self, request: pb.EngineGetEffectRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineGetEffectResponse:
        row = await self.reader.run(Q.get_effect, E.ident("key", request.key, E.MAX_KEY_BYTES))
        if row is None:
            return pb.EngineGetEffectResponse(found=False)
        return pb.EngineGetEffectResponse(
            found=True, result=pb.JsonValue(json=row[0]), recorded_at=_ts(row[1])
        )

    @handler
    async def PutEffect(
        self, request: pb.EnginePutEffectRequest, context: grpc.aio.ServicerContext
    ) -> pb.EnginePutEffectResponse:
        return put_effect_response(await self._submit(put_effect_cmd(request)))

    @handler
    async def KvGet(
        self, request: pb.EngineKvGetRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineKvGetResponse:
        row = await self.reader.run(
            Q.kv_get,
            E.ident("agent", request.agent, E.MAX_NAME_BYTES),
            E.ident("key", request.key, E.MAX_KEY_BYTES),
        )
        if row is None:
            return pb.EngineKvGetResponse(found=False)
        return pb.EngineKvGetResponse(
            found=True, value=pb.JsonValue(json=row[0]), updated_at=_ts(row[1])
        )

    @handler
    async def KvSet(
        self, request: pb.EngineKvSetRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineKvSetResponse:
        return kv_set_response(await self._submit(kv_set_cmd(request)))

    @handler
    async def DocList(  # type: ignore[override]
        self, request: pb.EngineDocListRequest, context: grpc.aio.ServicerContext
    ) -> None:
        agent = E.ident("agent", request.agent, E.MAX_NAME_BYTES)
        collection = E.ident("collection", request.collection, E.MAX_NAME_BYTES)
        where = E.parse_where(request.where.json if request.HasField("where") else None)
        limit = _limit(request)
        pages = self.reader.pages(
            Q.doc_list, _docs_page, agent=agent, collection=collection, where=where, limit=limit
        )
        await self._stream(context, pages)

    @handler
    async def DocUpsert(
        self, request: pb.EngineDocUpsertRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineDocUpsertResponse:
        return doc_upsert_response(await self._submit(doc_upsert_cmd(request)))

    @handler
    async def DocDelete(
        self, request: pb.EngineDocDeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineDocDeleteResponse:
        return doc_delete_response(await self._submit(doc_delete_cmd(request)))

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
        hdr = _Header(first.header)
        # An id that exists keeps its artifact: its bytes need not be stored again.
        exists = await self.reader.run(Q.artifact_exists, hdr.id)
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
                created=res.created, artifact=artifact_to_pb(res.artifact)
            )
        finally:
            if upload_id and not adopted:
                self._discard(upload_id)

    async def _receive(
        self, messages: AsyncIterator[Any], hdr: _Header, upload_id: str
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
        art = await self.reader.run(Q.get_artifact, E.ident("id", request.id))
        if art is None:
            return pb.EngineGetArtifactResponse(found=False)
        return pb.EngineGetArtifactResponse(found=True, artifact=artifact_to_pb(art))

    @handler
    async def ReadArtifact(  # type: ignore[override]
        self, request: pb.EngineReadArtifactRequest, context: grpc.aio.ServicerContext
    ) -> None:
        art_id = E.ident("id", request.id)
        layout = await self.reader.run(Q.artifact_layout, art_id)
        if layout is None:
            raise LedgerError(Code.RUN_NOT_FOUND, f"artifact {art_id!r} not found", field="id")
        art, upload_id, chunks = layout
        head = artifact_to_pb(art)
        if chunks == 0:
            await context.write(pb.EngineReadArtifactResponse(artifact=head))
            return
        for seq in range(chunks):
            data = await self.reader.run(Q.read_chunk, upload_id, seq)
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
        await self._stream(context, self.reader.pages(Q.list_artifacts, _artifacts_page, run_id))

    @handler
    async def DeleteArtifact(
        self, request: pb.EngineDeleteArtifactRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineDeleteArtifactResponse:
        res: E.Done = await self._submit(delete_artifact_cmd(request))
        return pb.EngineDeleteArtifactResponse(deleted=res.ok)


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve a staged chunk's outcome nobody awaits any more."""
    if not fut.cancelled():
        fut.exception()


def start_engine_store(
    writer: Writer, connect: Callable[[], Any]
) -> tuple[EngineStoreService, EngineReader]:
    """Register the executors and build the servicer with its reader over
    ``connect`` (the storage's read-only connections); call before the server
    starts serving, and ``sweep_uploads`` once the writer runs."""
    Q.register(writer)
    reader = EngineReader(connect)
    return EngineStoreService(writer, reader), reader


async def sweep_uploads(writer: Writer) -> None:
    """Remove the artifact uploads a crash left unfinished (the writer runs)."""
    swept: Any = await writer.submit(E.SweepUploads())  # type: ignore[arg-type]
    if swept.ok:
        log.info("removed %d unfinished artifact uploads", swept.at)
