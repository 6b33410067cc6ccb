"""Domain errors (docs/SPEC.md §8). Pure: the gRPC mapping lives in services/_errors.py."""

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
        self.metadata = metadata  # extra ErrorInfo metadata (owner, principal, role...)

    def __repr__(self) -> str:
        return f"LedgerError({self.code.value}, {self.message!r})"


def validation(field: str, message: str) -> LedgerError:
    """A RUN_VALIDATION_ERROR whose message starts with the field it names."""
    return LedgerError(Code.RUN_VALIDATION_ERROR, f"{field}: {message}", field=field)
