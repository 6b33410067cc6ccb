"""Domain errors (docs/SPEC.md §8). Pure: the gRPC mapping lives in rpc/status.py."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import Record


class Code(StrEnum):
    RUN_VALIDATION_ERROR = "RUN_VALIDATION_ERROR"
    RUN_NOT_FOUND = "RUN_NOT_FOUND"
    RUN_LEASE_HELD = "RUN_LEASE_HELD"
    RUN_LEASE_LOST = "RUN_LEASE_LOST"
    RUN_ALREADY_TERMINAL = "RUN_ALREADY_TERMINAL"
    RUN_SUSPENDED = "RUN_SUSPENDED"
    RUN_INVALID_TRANSITION = "RUN_INVALID_TRANSITION"
    RUN_CONFLICT = "RUN_CONFLICT"
    RUN_INTEGRITY_ERROR = "RUN_INTEGRITY_ERROR"
    RUN_STORE_ATOMIC_REQUIRED = "RUN_STORE_ATOMIC_REQUIRED"
    INVALID_RUN_STATE = "INVALID_RUN_STATE"
    # A write's fence on a keyed lock no longer holds (the lock moved on).
    LOCK_LOST = "LOCK_LOST"
    # The write could not be made durable (docs/SPEC.md §9); nothing changed.
    STORAGE_FULL = "STORAGE_FULL"
    STORAGE_UNAVAILABLE = "STORAGE_UNAVAILABLE"
    # The server is stopping: nothing was done; retry (elsewhere, or after restart).
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # WatchRuns: the requested revision is older than the retained history.
    RUN_REVISION_COMPACTED = "RUN_REVISION_COMPACTED"
    # A stream (KeepAlive, WatchRuns) fell too far behind reading and was dropped.
    STREAM_TOO_SLOW = "STREAM_TOO_SLOW"
    # Identity and authorization (docs/SECURITY.md).
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    OWNER_NOT_PERMITTED = "OWNER_NOT_PERMITTED"
    # A per-connection limit (tracked leases per KeepAlive stream) was reached.
    STREAM_LIMIT_EXCEEDED = "STREAM_LIMIT_EXCEEDED"
    # This coordinator does not lead (a standby, or deposed): nothing was
    # done; metadata "leader" is the leader's advertised address ("" unknown).
    NOT_LEADER = "NOT_LEADER"
    # Another coordinator leads the shard the call is keyed in: nothing was
    # done; metadata "shard", and "owner" (its address, "" unknown), "epoch".
    NOT_OWNER = "NOT_OWNER"


class LedgerError(Exception):
    """A refused command. Carries the record observed when one was read."""

    def __init__(
        self,
        code: Code,
        message: str,
        record: Record | None = None,
        field: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.record = record
        self.field = field
        # More ErrorInfo metadata (a lock fence's lock, a transaction's command
        # index, owner, principal, role...); "field" and the record's keys are
        # added from above.
        self.metadata = metadata

    def __repr__(self) -> str:
        return f"LedgerError({self.code.value}, {self.message!r})"


def owner_bound_ok(principal: str, owner: str) -> bool:
    """Whether a principal whose owners are bound (docs/SECURITY.md) may use
    ``owner``: its own name, or a name under it (``principal/...``)."""
    return owner == principal or owner.startswith(principal + "/")


def owner_not_permitted(principal: str, owner: str, field: str) -> LedgerError:
    """The refusal of an owner the principal may not use."""
    return LedgerError(
        Code.OWNER_NOT_PERMITTED,
        f"{field}: {principal!r} may only use the owner {principal!r} or "
        f"owners starting with {principal + '/'!r}, not {owner!r}",
        field=field,
        metadata={"owner": owner, "principal": principal},
    )


def not_owner(shard: int, owner: str, epoch: int) -> LedgerError:
    """The refusal of a call keyed in a shard another coordinator leads."""
    where = f"the coordinator at {owner}" if owner else "another coordinator (not known yet)"
    return LedgerError(
        Code.NOT_OWNER,
        f"shard {shard} is led by {where}: nothing was done; send it there",
        metadata={"shard": str(shard), "owner": owner, "epoch": str(epoch)},
    )


def validation(field: str, message: str) -> LedgerError:
    """A RUN_VALIDATION_ERROR whose message starts with the field it names."""
    return LedgerError(Code.RUN_VALIDATION_ERROR, f"{field}: {message}", field=field)


def unrepresentable(run_id: str, field: str, value: object) -> LedgerError:
    """The refusal of a stored record whose ``field`` no client can represent
    exactly (records.out_of_range): it is neither served nor changed."""
    return LedgerError(
        Code.RUN_INTEGRITY_ERROR,
        f"{field}: run {run_id!r} is stored with {field} {value}, outside "
        "0..9007199254740991 (2^53 - 1); it is not served and only a delete changes it",
        field=field,
        metadata={"run_id": run_id},
    )


def in_transaction(exc: LedgerError, index: int) -> LedgerError:
    """A transaction command's refusal as the transaction's: its message
    names the command, a field is prefixed ``commands[i].``."""
    prefix = f"commands[{index}]"
    field = f"{prefix}.{exc.field}" if exc.field is not None else None
    message = exc.message
    if exc.field is not None and message.startswith(f"{exc.field}:"):
        message = f"{field}:{message[len(exc.field) + 1 :]}"
    else:
        message = f"{field or prefix}: {message}"
    meta = {**(exc.metadata or {}), "command_index": str(index)}
    return LedgerError(exc.code, message, exc.record, field, meta)
