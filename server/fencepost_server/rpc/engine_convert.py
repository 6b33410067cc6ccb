"""The engine store's protobuf conversions (docs/SPEC.md §11): each unary
mutation as request -> writer command (validated, naming the field) and
writer result -> response, and the records as messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from fencepost.v1 import engine_store_pb2 as pb

from ..core import engine as E
from ..core import validate
from ..core.errors import validation
from .convert import fence_from_pb


def ts(ms: int) -> Timestamp:
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
        created_at=ts(r.created_at),
        updated_at=ts(r.updated_at),
    )
    if r.concurrency_key is not None:
        msg.concurrency_key = r.concurrency_key
    _set_json(msg, "input", r.input)
    _set_json(msg, "output", r.output)
    _set_json(msg, "error", r.error)
    _set_json(msg, "metadata", r.metadata)
    if r.claim is not None:
        msg.claim.owner = r.claim.owner
        msg.claim.expires_at.CopyFrom(ts(r.claim.expires_at))
    return msg


def step_to_pb(s: E.Step) -> pb.EngineStep:
    msg = pb.EngineStep(run_id=s.run_id, seq=s.seq, name=s.name, created_at=ts(s.created_at))
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
        saved_at=ts(c.saved_at),
    )


def doc_to_pb(d: E.Doc) -> pb.EngineDoc:
    return pb.EngineDoc(id=d.id, doc=pb.JsonValue(json=d.doc), updated_at=ts(d.updated_at))


def artifact_to_pb(a: E.Artifact) -> pb.EngineArtifact:
    msg = pb.EngineArtifact(
        id=a.id,
        run_id=a.run_id,
        name=a.name,
        content_type=a.content_type,
        size_bytes=a.size_bytes,
        sha256=a.sha256,
        created_at=ts(a.created_at),
    )
    _set_json(msg, "metadata", a.metadata)
    return msg


def runs_page(runs: list[E.Run], total: int) -> pb.EngineListRunsResponse:
    return pb.EngineListRunsResponse(runs=[run_to_pb(r) for r in runs], total=total)


def steps_page(steps: list[E.Step]) -> pb.EngineListStepsResponse:
    return pb.EngineListStepsResponse(steps=[step_to_pb(s) for s in steps])


def docs_page(docs: list[E.Doc]) -> pb.EngineDocListResponse:
    return pb.EngineDocListResponse(docs=[doc_to_pb(d) for d in docs])


def artifacts_page(arts: list[E.Artifact]) -> pb.EngineListArtifactsResponse:
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


def opt_text(msg: Any, name: str, field: str, max_bytes: int) -> str | None:
    if not msg.HasField(name):
        return None
    return E.ident(field, getattr(msg, name), max_bytes)


def _read_only(msg: Any, names: tuple[str, ...], prefix: str) -> None:
    for name in names:
        if msg.HasField(name):
            raise validation(f"{prefix}.{name}", "is set by the server; leave it absent")


def statuses_from_pb(values: Any, field: str) -> tuple[str, ...]:
    if len(values) > E.MAX_FILTER_VALUES:
        raise validation(field, f"at most {E.MAX_FILTER_VALUES} entries (got {len(values)})")
    return tuple(E.ident(f"{field}[{i}]", v, E.MAX_STATUS_BYTES) for i, v in enumerate(values))


def limit_from_pb(msg: Any) -> int | None:
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
        concurrency_key=opt_text(r, "concurrency_key", "run.concurrency_key", E.MAX_KEY_BYTES),
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
        status=opt_text(p, "status", "patch.status", E.MAX_STATUS_BYTES),
        concurrency_key=opt_text(p, "concurrency_key", "patch.concurrency_key", E.MAX_KEY_BYTES),
        input=_json(p, "input", "patch.input"),
        output=_json(p, "output", "patch.output"),
        error=_json(p, "error", "patch.error"),
        metadata=_json(p, "metadata", "patch.metadata"),
        clear=clear,
    )
    return E.UpdateRun(
        id=E.ident("id", req.id),
        patch=patch,
        expect_status=statuses_from_pb(req.expect_status, "expect_status"),
        expect_owner=opt_text(req, "expect_owner", "expect_owner", E.MAX_NAME_BYTES),
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
        status=opt_text(s, "status", "step.status", E.MAX_STATUS_BYTES),
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
        created=res.created, run_id=res.run_id, expires_at=ts(res.expires_at)
    )


def acquire_lock_response(res: E.LockAnswer) -> pb.EngineAcquireLockResponse:
    return pb.EngineAcquireLockResponse(
        acquired=res.acquired,
        fencing_token=res.fencing_token,
        owner=res.owner,
        expires_at=ts(res.expires_at),
    )


def release_lock_response(res: E.Done) -> pb.EngineReleaseLockResponse:
    return pb.EngineReleaseLockResponse(released=res.ok)


def put_effect_response(res: E.Done) -> pb.EnginePutEffectResponse:
    return pb.EnginePutEffectResponse(recorded_at=ts(res.at))


def kv_set_response(res: E.Done) -> pb.EngineKvSetResponse:
    return pb.EngineKvSetResponse(updated_at=ts(res.at))


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


class ArtifactHeader:
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


