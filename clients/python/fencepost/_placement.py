"""Where a request's items are: the shard keys of everything it writes or
reads, by request message type, exactly as the server places the command it
becomes (docs/SPEC.md "Shards", the table of shard keys).

A request names its items by their shard keys; a fence adds the run or lock
it is keyed by; a transaction is the union of its commands and its fence, in
order. ``None``: the request has no shard of its own (a listing, the map, an
artifact named by id), and may go to any coordinator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._shards import SEPARATOR
from .v1 import engine_store_pb2 as epb
from .v1 import ledger_pb2 as lpb
from .v1 import run_store_pb2 as rpb


def compound_key(*parts: str) -> str:
    """The shard key of an item named by several fields, in the order given."""
    return SEPARATOR.join(parts)


def _run_id(req: Any) -> tuple[str, ...]:
    return (req.run_id,)


def _id(req: Any) -> tuple[str, ...]:
    return (req.id,)


def _key(req: Any) -> tuple[str, ...]:
    return (req.key,)


def _agent_key(req: Any) -> tuple[str, ...]:
    return (compound_key(req.agent, req.key),)


def _collection(req: Any) -> tuple[str, ...]:
    return (compound_key(req.agent, req.collection),)


_KEYS: dict[type, Callable[[Any], tuple[str, ...]]] = {
    **dict.fromkeys(
        (lpb.AcquireRequest, lpb.RenewRequest, lpb.RecordCheckpointRequest, lpb.SuspendRequest,
         lpb.FinishRequest, lpb.ReleaseRequest, lpb.CancelRequest, lpb.RequestResumeRequest,
         lpb.DeleteRunRequest, lpb.GetRunRequest, lpb.ValidateFenceRequest,
         rpb.GetRequest, rpb.CompareAndSetRequest, rpb.DeleteRequest,
         epb.EngineListStepsRequest, epb.EngineLatestCheckpointRequest,
         epb.EngineListArtifactsRequest, epb.EngineArtifactHeader),
        _run_id),
    **dict.fromkeys(
        (epb.EngineGetRunRequest, epb.EngineUpdateRunRequest, epb.EngineClaimRunRequest,
         epb.EngineRenewClaimRequest),
        _id),
    **dict.fromkeys(
        (epb.EngineAcquireLockRequest, epb.EngineReleaseLockRequest, epb.EnginePutEffectRequest,
         epb.EngineGetEffectRequest),
        _key),
    **dict.fromkeys((epb.EngineKvSetRequest, epb.EngineKvGetRequest), _agent_key),
    **dict.fromkeys(
        (epb.EngineDocUpsertRequest, epb.EngineDocDeleteRequest, epb.EngineDocListRequest),
        _collection),
    rpb.CreateRequest: lambda r: (r.run.run_id,),
    epb.EngineCreateRunRequest: lambda r: (r.run.id,),
    epb.EngineAppendStepRequest: lambda r: (r.step.run_id,),
    epb.EngineSaveCheckpointRequest: lambda r: (r.checkpoint.run_id,),
    epb.EngineClaimKeyRequest: lambda r: (compound_key(r.scope, r.key),),
}

# The request types that may carry a fence (its run or lock is an item too).
_FENCED = frozenset(t for t in _KEYS if "fence" in t.DESCRIPTOR.fields_by_name)  # type: ignore[attr-defined]


def _fence_key(fence: Any) -> str:
    return str(fence.run_id or fence.lock_key)


def shard_keys(request: Any) -> tuple[str, ...] | None:
    """The shard keys of the items ``request`` writes or reads (repeats
    possible), or None when it has no shard of its own."""
    if type(request) is lpb.TransactionRequest:
        keys: list[str] = []
        for command in request.commands:
            kind = command.WhichOneof("kind")
            got = None if kind is None else shard_keys(getattr(command, kind))
            if got is None:
                return None
            keys.extend(got)
        if request.HasField("fence"):
            keys.append(_fence_key(request.fence))
        return tuple(keys)
    keys_of = _KEYS.get(type(request))
    if keys_of is None:
        return None
    keys = list(keys_of(request))
    if type(request) in _FENCED and request.HasField("fence"):
        keys.append(_fence_key(request.fence))
    return tuple(keys)


def first_key(request: Any) -> str | None:
    """The shard key a request is sent by: its first item's (a request whose
    items span coordinators goes to the first one's, which refuses it naming
    the shard it does not lead)."""
    keys = shard_keys(request)
    return keys[0] if keys else None
