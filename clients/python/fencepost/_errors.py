"""Exceptions raised by the fencepost SDK, and the one mapping that turns a
gRPC status into one of them: ``from_rpc_error`` for a call that ended with
it, ``from_status`` for the same ``google.rpc.Status`` carried in an Execute
result. Nothing else in the SDK looks at a gRPC status, and nothing anywhere
matches on message text.

The tree (the middle layers say what a caller can do about a failure;
catch the layer, or a leaf for one case)::

    FencepostError                  .code .record .field .message .grpc_code .metadata
    ├── InvalidInputError           the call itself is wrong: nothing changed; fix
    │   │                           the call, a retry is refused the same way
    │   └── ValidationError         RUN_VALIDATION_ERROR       (.field names the input)
    ├── RefusedError                the server (or the SDK, on what the server already
    │   │                           said) refused the call: nothing changed; a retry
    │   │                           is refused until the state changes
    │   ├── RunNotFoundError        RUN_NOT_FOUND
    │   ├── LeaseHeldError          RUN_LEASE_HELD
    │   ├── LeaseLostError          RUN_LEASE_LOST             (the handle's fence moved;
    │   │                                                      .reason a LostReason)
    │   ├── AlreadyTerminalError    RUN_ALREADY_TERMINAL
    │   ├── RunSuspendedError       RUN_SUSPENDED
    │   ├── InvalidTransitionError  RUN_INVALID_TRANSITION
    │   ├── ConflictError           RUN_CONFLICT
    │   ├── IntegrityError          RUN_INTEGRITY_ERROR
    │   ├── AtomicStoreRequiredError RUN_STORE_ATOMIC_REQUIRED
    │   ├── InvalidRunStateError    INVALID_RUN_STATE
    │   ├── LockLostError           LOCK_LOST                  (a write's lock fence no longer
    │   │                                                      holds: the lock moved on)
    │   ├── StorageFullError        STORAGE_FULL               (nothing was written)
    │   ├── RevisionCompactedError  RUN_REVISION_COMPACTED     (watch: that revision is no
    │   │                                                      longer retained; re-list)
    │   ├── UnauthenticatedError    UNAUTHENTICATED            (no or bad credentials; never
    │   │                                                      retried)
    │   └── PermissionDeniedError   PERMISSION_DENIED          (the caller's role may not make
    │       │                                                  this call: .metadata["role"]
    │       │                                                  names the role needed; never
    │       │                                                  retried)
    │       └── OwnerNotPermittedError OWNER_NOT_PERMITTED     (the owner is not the caller's
    │                                                          principal or principal/...;
    │                                                          .metadata owner, principal)
    ├── LeaseAtRiskError            LEASE_AT_RISK              (beside LeaseLostError, not a
    │                                                          kind of it: raised locally by
    │                                                          guard() and check(), never by
    │                                                          the server: safe-until passed
    │                                                          or the lease is expiring.
    │                                                          To stop work on either:
    │                                                          ``except (LeaseLostError,
    │                                                          LeaseAtRiskError)``)
    ├── StorageUnavailableError     STORAGE_UNAVAILABLE        (nothing was written; retried
    │                                                          like UNAVAILABLE)
    ├── StreamTooSlowError          STREAM_TOO_SLOW            (a stream fell too far behind;
    │                                                          the SDK reconnects by itself)
    ├── RpcError                    a reason this SDK has no class for yet (.code is
    │                               the reason), or a status with no fencepost reason
    │                               (.code is the gRPC status name, e.g. "INTERNAL")
    └── UnavailableError            no answer: UNAVAILABLE after every retry, or a
        │                           read's deadline passed (.code "UNAVAILABLE" or
        │                           "DEADLINE_EXCEEDED"); for a mutation, raised only
        │                           when no attempt can have left this process (the
        │                           channel never connected): nothing was applied
        ├── ShuttingDownError       SHUTTING_DOWN: the server is stopping and did
        │                           nothing with this call; retried like UNAVAILABLE
        ├── NotLeaderError          NOT_LEADER: a standby coordinator refused the call
        │                           and did nothing with it (.leader: the address it
        │                           named, or ""); the SDK follows it by itself and
        │                           raises it only when every endpoint kept refusing
        │                           until the retry policy gave up
        ├── NotOwnerError           NOT_OWNER: the coordinator leads other shards than
        │                           the call's and did nothing with it (.shard, .owner:
        │                           the owner's address or "", .epoch); the SDK sends
        │                           the call to that owner by itself and raises it only
        │                           when the owners it was sent to kept naming others
        └── OutcomeUnknownError     outcome unknown: a mutation got no answer, it may
                                    or may not have been applied. Retrying it with a
                                    fresh call is safe for the converging commands
                                    (finish, suspend, release, cancel, resume) and
                                    reads the current state for the others.

Misuse of the SDK is not a failed call and is not a ``FencepostError``: it
raises a ``UsageError`` (a ``RuntimeError``, as before these had a class),
a bug to fix rather than a failure to handle::

    UsageError (RuntimeError)       the program used the SDK in a way it does not allow
    ├── ClientClosedError           a call on a closed client (or its store or leases)
    └── EventLoopError              a Client used on another event loop than its first,
                                    a SyncClient inside a running loop, guard() outside
                                    a task

``.record`` is the run record the server observed when it refused (for
example the record that shows who holds the lease), or None. ``.metadata``
is the refusal's ErrorInfo metadata (``field``, a lock fence's
``lock_key``/``fencing_token``/``owner``, a transaction's ``command_index``).
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ._records import LostReason, RunRecord, record_from_pb
from .v1 import record_pb2

DOMAIN = "fencepost"


class FencepostError(Exception):
    """Base of every error the SDK raises for a failed call."""

    code: str = ""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        record: RunRecord | None = None,
        field: str | None = None,
        grpc_code: grpc.StatusCode | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        # the ErrorInfo metadata, when the server sent one (field, run_id, a lock
        # fence's lock_key, a transaction's command_index, owner, principal, role...)
        self.metadata: dict[str, str] = dict(metadata or {})
        if code is not None:
            self.code = code
        self.message = message
        self.record = record
        self.field = field
        self.grpc_code = grpc_code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.code else self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class InvalidInputError(FencepostError):
    """The call itself is wrong (a field out of range, a value that is not
    JSON...): nothing changed, and the same call is refused again."""


class RefusedError(FencepostError):
    """The server refused the call, or the SDK did on what the server had
    already said (a lease known lost): nothing changed. The same call is
    refused again until the state it ran into changes."""


class ValidationError(InvalidInputError):
    """Bad input; ``.field`` names it (e.g. "lease_ttl_ms"). Nothing changed."""

    code = "RUN_VALIDATION_ERROR"


class RunNotFoundError(RefusedError):
    code = "RUN_NOT_FOUND"


class LeaseHeldError(RefusedError):
    """Another owner holds a live lease (``.record.lease`` says who, until when)."""

    code = "RUN_LEASE_HELD"


class LeaseLostError(RefusedError):
    """The handle's fence moved: taken over, cancelled, deleted or finished by
    another handle. The handle can make no further write. ``.reason`` is a
    ``LostReason`` when the SDK knows why (from a ``lost`` push, or judged
    from the record the server refused with), else None."""

    code = "RUN_LEASE_LOST"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        record: RunRecord | None = None,
        field: str | None = None,
        grpc_code: grpc.StatusCode | None = None,
        reason: LostReason | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, record=record, field=field, grpc_code=grpc_code,
                         metadata=metadata)
        self.reason = reason


class LeaseAtRiskError(FencepostError):
    """Raised by ``guard()`` and ``check()`` (never by the server) when the lease
    *may* be gone: its safe-until passed with no newer renewal answered (this
    process was cut off from the coordinator), or the server said it is
    ``expiring``. Nobody may have taken the run yet, but another owner could at
    any moment, so side effects must stop. ``.reason`` is ``LostReason.AT_RISK``.
    A later renewal that gets answered makes the lease safe again (``at_risk``
    False); a fenced call tells for sure. Not a ``LeaseLostError``: catch both
    (``except (LeaseLostError, LeaseAtRiskError)``) to stop on either."""

    code = "LEASE_AT_RISK"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        record: RunRecord | None = None,
        field: str | None = None,
        grpc_code: grpc.StatusCode | None = None,
        reason: LostReason | None = LostReason.AT_RISK,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, record=record, field=field, grpc_code=grpc_code,
                         metadata=metadata)
        self.reason = reason


class LockLostError(RefusedError):
    """A write fenced on a keyed lock was refused: the lock was taken over
    (its token moved) or released. Nothing was written. ``lock_key``,
    ``fencing_token`` and ``owner`` (None when released) describe the lock as
    the server saw it."""

    code = "LOCK_LOST"

    @property
    def lock_key(self) -> str:
        return self.metadata.get("lock_key", "")

    @property
    def fencing_token(self) -> int | None:
        token = self.metadata.get("fencing_token")
        return int(token) if token else None

    @property
    def owner(self) -> str | None:
        return self.metadata.get("owner") or None


class AlreadyTerminalError(RefusedError):
    code = "RUN_ALREADY_TERMINAL"


class RunSuspendedError(RefusedError):
    """The run is suspended; ``request_resume`` it before acquiring."""

    code = "RUN_SUSPENDED"


class InvalidTransitionError(RefusedError):
    code = "RUN_INVALID_TRANSITION"


class ConflictError(RefusedError):
    code = "RUN_CONFLICT"


class IntegrityError(RefusedError):
    code = "RUN_INTEGRITY_ERROR"


class AtomicStoreRequiredError(RefusedError):
    code = "RUN_STORE_ATOMIC_REQUIRED"


class InvalidRunStateError(RefusedError):
    code = "INVALID_RUN_STATE"


class StorageFullError(RefusedError):
    """The server could not make the write durable (disk full); nothing changed."""

    code = "STORAGE_FULL"


class StorageUnavailableError(FencepostError):
    """The server could not make the write durable, or is shutting down;
    nothing changed. Retried automatically like any UNAVAILABLE."""

    code = "STORAGE_UNAVAILABLE"


class RevisionCompactedError(RefusedError):
    """``watch`` asked for a revision older than the server's retained history.
    List the runs (the answer carries its revision) and watch from there + 1."""

    code = "RUN_REVISION_COMPACTED"


class StreamTooSlowError(FencepostError):
    """A stream fell more than the server's per-stream limit behind reading and
    was dropped. The SDK's streams reconnect on it by themselves (the watch
    resumes from its last revision + 1); raw-stub users see it."""

    code = "STREAM_TOO_SLOW"


class UnauthenticatedError(RefusedError):
    """The server requires credentials and got none, or bad ones. Never retried."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(RefusedError):
    """The caller's role may not make this call (``.metadata["role"]`` names
    the role needed). Never retried."""

    code = "PERMISSION_DENIED"


class OwnerNotPermittedError(PermissionDeniedError):
    """The call names a lease owner the caller's identity may not use: only
    its principal, or names starting with ``principal/`` (``.metadata``:
    ``owner``, ``principal``). Never retried."""

    code = "OWNER_NOT_PERMITTED"


class RpcError(FencepostError):
    """A gRPC status without a fencepost reason (INTERNAL, UNIMPLEMENTED...).
    ``.code`` is the gRPC status name."""


class UnavailableError(FencepostError):
    """The server gave no answer: unreachable after every retry, or a read's
    deadline passed. A mutation raises exactly this class (not
    ``OutcomeUnknownError``) only when none of its attempts was sent, because
    the client never had a connection to the server: nothing was applied."""

    code = "UNAVAILABLE"


class ShuttingDownError(UnavailableError):
    """The server is stopping and did nothing with this call (safe to retry)."""

    code = "SHUTTING_DOWN"


class NotLeaderError(UnavailableError):
    """A standby coordinator refused the call (it did nothing with it): another
    coordinator leads, at ``.leader`` (empty while none is known, e.g. during
    a takeover). The client follows the leader by itself (``Client`` with
    several endpoints, docs/SDK.md); this is raised only when no endpoint
    would take the call before the retry policy gave up."""

    code = "NOT_LEADER"

    @property
    def leader(self) -> str:
        """The leader's advertised address as the standby knew it, or ""."""
        return self.metadata.get("leader", "")


class NotOwnerError(UnavailableError):
    """A coordinator that leads only some shards refused a call keyed in
    another (it did nothing with it, and did not remember its request id):
    shard ``.shard`` is led at ``.owner`` (its address, "" while none is
    known) under ``.epoch``. The client sends the call there by itself
    (docs/SDK.md); this is raised only when the owners it was sent to kept
    naming others, or none."""

    code = "NOT_OWNER"

    @property
    def shard(self) -> int:
        """The shard the call is keyed in (-1 when the server named none)."""
        return _int(self.metadata.get("shard"), -1)

    @property
    def owner(self) -> str:
        """The address of the coordinator that leads ``shard``, or ""."""
        return self.metadata.get("owner", "")

    @property
    def epoch(self) -> int:
        """The epoch ``owner`` leads ``shard`` under (0 when not known)."""
        return _int(self.metadata.get("epoch"), 0)


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        return default


class OutcomeUnknownError(UnavailableError):
    """A mutation got no answer, so it may or may not have been applied."""


class UsageError(RuntimeError):
    """The program used the SDK in a way it does not allow (a bug to fix, not
    a failure to handle). A ``RuntimeError``, as these were before they had a
    class of their own; not a ``FencepostError``."""


class ClientClosedError(UsageError):
    """A call on a client that was closed (or on its store or a lease of it)."""


class EventLoopError(UsageError):
    """The wrong event loop, or none: a ``Client`` used on another loop than
    the one it was first used on, a ``SyncClient`` inside a running loop (where
    blocking would stall it), ``guard()`` outside a task."""


_BY_REASON: dict[str, type[FencepostError]] = {
    cls.code: cls
    for cls in (
        ValidationError,
        RunNotFoundError,
        LeaseHeldError,
        LeaseLostError,
        AlreadyTerminalError,
        RunSuspendedError,
        InvalidTransitionError,
        ConflictError,
        IntegrityError,
        AtomicStoreRequiredError,
        InvalidRunStateError,
        LockLostError,
        StorageFullError,
        StorageUnavailableError,
        RevisionCompactedError,
        StreamTooSlowError,
        ShuttingDownError,
        NotLeaderError,
        NotOwnerError,
        UnauthenticatedError,
        PermissionDeniedError,
        OwnerNotPermittedError,
    )
}

# Status codes that mean "no answer arrived" rather than "the server refused".
_NO_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _rich_status(err: grpc.RpcError) -> status_pb2.Status | None:
    try:
        return rpc_status.from_call(err)  # type: ignore[arg-type]
    except (ValueError, AttributeError, TypeError):
        return None


def from_rpc_error(err: grpc.RpcError, *, mutation: bool) -> FencepostError:
    """The SDK's single mapping from a gRPC error to a ``FencepostError``.

    A status with a fencepost ``ErrorInfo`` becomes the class for its reason,
    with ``.record`` unpacked from the attached ``fencepost.v1.Run`` and
    ``.field`` from the ErrorInfo metadata. Without one, UNAVAILABLE and
    DEADLINE_EXCEEDED become ``OutcomeUnknownError`` for a mutation and
    ``UnavailableError`` otherwise; any other status becomes ``RpcError``.
    """
    code_fn = getattr(err, "code", None)
    grpc_code: grpc.StatusCode = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    message = (details_fn() if callable(details_fn) else None) or str(err)
    return _from_status_parts(grpc_code, message, _rich_status(err), mutation=mutation)


_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status(status: status_pb2.Status, *, mutation: bool) -> FencepostError:
    """``from_rpc_error`` for a ``google.rpc.Status`` that arrived inside a
    message instead of ending a call: an ``Execute`` command's ``error``, which
    is exactly the status the unary call would have ended with. Same mapping,
    same exception."""
    grpc_code = _GRPC_CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return _from_status_parts(grpc_code, status.message or grpc_code.name, status,
                              mutation=mutation)


def _from_status_parts(
    grpc_code: grpc.StatusCode,
    message: str,
    rich: status_pb2.Status | None,
    *,
    mutation: bool,
) -> FencepostError:
    reason: str | None = None
    field: str | None = None
    record: RunRecord | None = None
    metadata: dict[str, str] = {}
    if rich is not None:
        for detail in rich.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == DOMAIN:
                    reason = info.reason
                    field = info.metadata.get("field") or None
                    metadata = dict(info.metadata)
            elif detail.Is(record_pb2.Run.DESCRIPTOR):
                run = record_pb2.Run()
                detail.Unpack(run)
                try:
                    record = record_from_pb(run)
                except ValueError:
                    record = None

    if reason is not None:
        cls = _BY_REASON.get(reason)
        if cls is not None:
            return cls(message, record=record, field=field, grpc_code=grpc_code,
                       metadata=metadata)
        return RpcError(message, code=reason, record=record, field=field, grpc_code=grpc_code,
                        metadata=metadata)
    if grpc_code in _NO_ANSWER:
        no_answer = OutcomeUnknownError if mutation else UnavailableError
        return no_answer(message, code=grpc_code.name, grpc_code=grpc_code)
    if grpc_code is grpc.StatusCode.UNAUTHENTICATED:
        return UnauthenticatedError(message, grpc_code=grpc_code)
    if grpc_code is grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDeniedError(message, grpc_code=grpc_code)
    return RpcError(message, code=grpc_code.name, grpc_code=grpc_code)
