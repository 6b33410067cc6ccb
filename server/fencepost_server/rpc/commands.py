"""The one command registry: every request the writer acts on, by kind, as
(request -> validated writer command, writer result -> the response filled in
place). The unary handlers, Ledger.Execute, Transact's commands and a
KeepAlive renewal all build their commands here, so each transport validates,
refuses and answers a request exactly as the others do.

A kind is the request's field name in ledger.proto's Command and
CommandResult oneofs (the raw seam's, which Execute does not carry, are
``raw_*``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fencepost.v1 import ledger_pb2 as pb

from ..core import ledger as L
from ..core import validate
from ..core.errors import LedgerError, in_transaction, validation
from . import convert
from .engine_convert import MUTATIONS

# Fill a response (an empty message of the unary RPC's response type) from
# the writer's result, in place.
Fill = Callable[[Any, Any], None]


@dataclass(frozen=True, slots=True)
class Kind:
    to_command: Callable[[Any], Any]
    fill: Fill
    # the engine store's answers are built whole (engine_convert); a unary
    # call returns that message as it is, with no copy
    to_response: Callable[[Any], Any] | None = None


def _fill_record(response: Any, record: Any) -> None:
    convert.fill_record_pb(response.run, record)


def _fill_deleted(response: Any, deleted: L.Deleted) -> None:
    response.revision = deleted.revision
    response.fencing_token = deleted.fencing_token


def _fill_created(response: Any, result: L.Created) -> None:
    response.created = result.created
    convert.fill_record_pb(response.run, result.record)


def _fill_swapped(response: Any, result: L.Swapped) -> None:
    response.swapped = result.swapped
    if result.record is not None:
        convert.fill_record_pb(response.run, result.record)


def _fill_raw_deleted(response: Any, result: L.Deleted) -> None:
    response.deleted = result.deleted
    response.revision = result.revision


def _copied(to_response: Callable[[Any], Any]) -> Fill:
    return lambda response, result: response.CopyFrom(to_response(result))


def transaction_cmd(req: pb.TransactionRequest) -> L.Transaction:
    """A TransactionRequest as one writer command: each of its commands
    converted and validated as on its own (errors name ``commands[i]``)."""
    if not req.commands:
        raise validation("commands", "a transaction needs at least one command")
    if len(req.commands) > L.MAX_TRANSACTION_COMMANDS:
        raise validation(
            "commands",
            f"at most {L.MAX_TRANSACTION_COMMANDS} commands (got {len(req.commands)})",
        )
    commands = []
    for i, sub in enumerate(req.commands):
        try:
            kind = sub.WhichOneof("kind")
            if kind is None:
                raise validation("kind", "empty command")
            if kind == "transaction":
                raise validation("transaction", "a transaction cannot contain a transaction")
            inner = getattr(sub, kind)
            if inner.request_id:
                raise validation(
                    "request_id", "commands of a transaction take the transaction's request_id"
                )
            commands.append(KINDS[kind].to_command(inner))
        except LedgerError as exc:
            raise in_transaction(exc, i) from None
    return L.Transaction(
        tuple(commands), convert.fence_from_pb(req), validate.request_id(req.request_id)
    )


def fill_transaction(
    response: pb.TransactionResponse, done: L.TransactionDone, request: pb.TransactionRequest
) -> None:
    """Each command's answer into a CommandResult with the command's id."""
    for sub, result in zip(request.commands, done.results, strict=True):
        kind = str(sub.WhichOneof("kind"))
        KINDS[kind].fill(getattr(response.results.add(id=sub.id), kind), result)


def _no_fill(response: Any, result: Any) -> None:
    raise AssertionError("a transaction's answer is filled by fill_transaction")


KINDS: dict[str, Kind] = {
    "acquire": Kind(convert.acquire, _fill_record),
    "renew": Kind(convert.renew, _fill_record),
    "record_checkpoint": Kind(convert.record_checkpoint, _fill_record),
    "suspend": Kind(convert.suspend, _fill_record),
    "finish": Kind(convert.finish, _fill_record),
    "release": Kind(convert.release, _fill_record),
    "cancel": Kind(convert.cancel, _fill_record),
    "request_resume": Kind(convert.request_resume, _fill_record),
    "delete_run": Kind(convert.delete_run, _fill_deleted),
    "transaction": Kind(transaction_cmd, _no_fill),
    # the engine store's: create_run, update_run, ... doc_delete
    **{kind: Kind(to_cmd, _copied(to_resp), to_resp)
       for kind, (to_cmd, to_resp) in MUTATIONS.items()},
    # the raw seam's (RunStore), unary only
    "raw_create": Kind(convert.raw_create, _fill_created),
    "raw_compare_and_set": Kind(convert.raw_cas, _fill_swapped),
    "raw_delete": Kind(convert.raw_delete, _fill_raw_deleted),
}


def filler(kind: str, request: Any) -> Fill:
    """How to fill the answer of ``request`` (of ``kind``): a transaction's
    depends on its request (each command's answer under its id)."""
    if kind == "transaction":
        return functools.partial(fill_transaction, request=request)
    return KINDS[kind].fill


def stream_renew(msg: pb.KeepAliveRenew, owner: str) -> L.Renew:
    """A KeepAlive renewal: a Renew whose owner is the stream's (hello.owner)."""
    ttl = msg.lease_ttl_ms if msg.HasField("lease_ttl_ms") else None
    return validate.command(  # type: ignore[return-value]
        L.Renew(msg.run_id, owner, msg.fencing_token, ttl)
    )
