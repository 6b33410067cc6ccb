"""fencepost: the Python SDK for the fencepost lease coordinator.

    import fencepost

    async with fencepost.Client("127.0.0.1:50051") as client:  # owner: unique per process
        async with client.acquire("run-42", ttl_ms=10_000) as lease:
            await lease.record_checkpoint("ckpt/run-42/1", snapshot_version=1)
            await lease.finish("completed")

Leases are renewed over one KeepAlive stream per client; loss shows as
``lease.lost``, a ``LeaseLostError`` from the next fenced call, and
``lease.guard()`` cancelling the guarded block (see ``fencepost.Lease``).
``client.watch()`` streams committed changes. ``SyncClient`` offers the same
calls for threaded code. Every failure is a
``FencepostError`` subclass (the tree is drawn in ``fencepost._errors``).
The generated stubs live in ``fencepost.v1``; pytest fixtures for users'
tests in ``fencepost.testing``.
"""

from ._client import AcquireContext, Client, ClientStatistics, Lease, Stubs
from ._errors import (
    AlreadyTerminalError,
    AtomicStoreRequiredError,
    ClientClosedError,
    ConflictError,
    EventLoopError,
    FencepostError,
    IntegrityError,
    InvalidInputError,
    InvalidRunStateError,
    InvalidTransitionError,
    LeaseAtRiskError,
    LeaseHeldError,
    LeaseLostError,
    LockLostError,
    NotLeaderError,
    NotOwnerError,
    OutcomeUnknownError,
    OwnerNotPermittedError,
    PermissionDeniedError,
    RefusedError,
    RevisionCompactedError,
    RpcError,
    RunNotFoundError,
    RunSuspendedError,
    ShuttingDownError,
    StorageFullError,
    StorageUnavailableError,
    StreamTooSlowError,
    UnauthenticatedError,
    UnavailableError,
    UsageError,
    ValidationError,
)
from ._records import (
    ChangeKind,
    CheckpointRef,
    DeleteResult,
    FenceStatus,
    LeaseInfo,
    LostReason,
    Outcome,
    RunListing,
    RunRecord,
    RunStatus,
    Suspension,
    WatchEvent,
    can_transition,
    is_terminal,
)
from ._retry import RetryPolicy
from ._security import TLS
from ._shards import ShardInfo, ShardMap, shard_of
from ._store import ABSENT, AsyncStore, InvalidRunState, Lookup, RunNotFound
from ._sync import SyncClient, SyncLease, SyncStore, SyncStoreTransaction, SyncStubs
from ._transaction import StoreTransaction
from ._watch import WatchCursor

__version__ = "0.1.0"

__all__ = [
    "ABSENT",
    "TLS",
    "AcquireContext",
    "AlreadyTerminalError",
    "AsyncStore",
    "AtomicStoreRequiredError",
    "ChangeKind",
    "CheckpointRef",
    "Client",
    "ClientClosedError",
    "ClientStatistics",
    "ConflictError",
    "DeleteResult",
    "EventLoopError",
    "FenceStatus",
    "FencepostError",
    "IntegrityError",
    "InvalidInputError",
    "InvalidRunState",
    "InvalidRunStateError",
    "InvalidTransitionError",
    "Lease",
    "LeaseAtRiskError",
    "LeaseHeldError",
    "LeaseInfo",
    "LeaseLostError",
    "LockLostError",
    "Lookup",
    "LostReason",
    "NotLeaderError",
    "NotOwnerError",
    "Outcome",
    "OutcomeUnknownError",
    "OwnerNotPermittedError",
    "PermissionDeniedError",
    "RefusedError",
    "RetryPolicy",
    "RevisionCompactedError",
    "RpcError",
    "RunListing",
    "RunNotFound",
    "RunNotFoundError",
    "RunRecord",
    "RunStatus",
    "RunSuspendedError",
    "ShardInfo",
    "ShardMap",
    "ShuttingDownError",
    "StorageFullError",
    "StorageUnavailableError",
    "StoreTransaction",
    "StreamTooSlowError",
    "Stubs",
    "Suspension",
    "SyncClient",
    "SyncLease",
    "SyncStore",
    "SyncStoreTransaction",
    "SyncStubs",
    "UnauthenticatedError",
    "UnavailableError",
    "UsageError",
    "ValidationError",
    "WatchCursor",
    "WatchEvent",
    "__version__",
    "can_transition",
    "is_terminal",
    "shard_of",
]
