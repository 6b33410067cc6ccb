"""fencepost: the Python SDK for the fencepost lease coordinator.

    import fencepost

    async with fencepost.Client("127.0.0.1:50051", owner="worker-7") as client:
        async with client.acquire("run-42", ttl_ms=10_000) as lease:
            await lease.record_checkpoint("ckpt/run-42/1", snapshot_version=1)
            await lease.finish("completed")

``SyncClient`` offers the same calls for threaded code. Every failure is a
``FencepostError`` subclass (the tree is drawn in ``fencepost._errors``).
The generated stubs live in ``fencepost.v1``; pytest fixtures for users'
tests in ``fencepost.testing``.
"""

from ._client import AcquireContext, Client, Lease, Stubs
from ._errors import (
    AlreadyTerminalError,
    AtomicStoreRequiredError,
    ConflictError,
    FencepostError,
    IntegrityError,
    InvalidRunStateError,
    InvalidTransitionError,
    LeaseHeldError,
    LeaseLostError,
    OutcomeUnknownError,
    PermissionDeniedError,
    RpcError,
    RunNotFoundError,
    RunSuspendedError,
    StorageFullError,
    StorageUnavailableError,
    UnauthenticatedError,
    UnavailableError,
    ValidationError,
)
from ._records import (
    CheckpointRef,
    DeleteResult,
    FenceStatus,
    LeaseInfo,
    Outcome,
    RunRecord,
    RunStatus,
    Suspension,
    can_transition,
    is_terminal,
)
from ._retry import RetryPolicy
from ._sync import SyncClient, SyncLease, SyncStubs

__version__ = "0.1.0"

__all__ = [
    "AcquireContext",
    "AlreadyTerminalError",
    "AtomicStoreRequiredError",
    "CheckpointRef",
    "Client",
    "ConflictError",
    "DeleteResult",
    "FenceStatus",
    "FencepostError",
    "IntegrityError",
    "InvalidRunStateError",
    "InvalidTransitionError",
    "Lease",
    "LeaseHeldError",
    "LeaseInfo",
    "LeaseLostError",
    "Outcome",
    "OutcomeUnknownError",
    "PermissionDeniedError",
    "RetryPolicy",
    "RpcError",
    "RunNotFoundError",
    "RunRecord",
    "RunStatus",
    "RunSuspendedError",
    "StorageFullError",
    "StorageUnavailableError",
    "Stubs",
    "Suspension",
    "SyncClient",
    "SyncLease",
    "SyncStubs",
    "UnauthenticatedError",
    "UnavailableError",
    "ValidationError",
    "__version__",
    "can_transition",
    "is_terminal",
]
