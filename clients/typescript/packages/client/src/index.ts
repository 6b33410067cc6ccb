export { FencepostClient, defaultOwner } from "./client.js";
export type {
  AcquireOptions, CallOptions, ClientOptions, CommandRequest, CommandResponse, FenceStatus, ListRunsOptions, RunPage, ShardInfo, ShardMap, WatchOptions,
} from "./client.js";
export { Lease } from "./lease.js";
export { WatchCursor } from "./watch.js";
export type { RunChange } from "./watch.js";
export { probeServer } from "./probe.js";
export type { ProbeOptions, ServerDescription } from "./probe.js";
export type { FenceListener } from "./keepalive.js";
export { EngineStoreClient, ARTIFACT_CHUNK_BYTES } from "./store.js";
export { MAX_TRANSACTION_WRITES, QueuedWrite, StoreTransaction } from "./transaction.js";
export type { Answered, StoreWrite, TransactionWrites } from "./transaction.js";
export type {
  ArtifactHeader, EngineArtifact, EngineCheckpoint, EngineClaim, EngineDoc, EngineRun, EngineRunInput,
  EngineRunPatch, EngineStep, FenceSpec, Lookup, WriteOptions,
} from "./store.js";
export {
  AlreadyTerminalError, ConflictError, ERROR_DOMAIN, FencepostError, IntegrityError, InvalidRunStateError,
  InvalidTransitionError, LeaseAtRiskError, LockLostError, LeaseHeldError, LeaseLostError, OutcomeUnknownError,
  RevisionCompactedError, RpcError, RunNotFoundError, RunSuspendedError, ShuttingDownError, StorageFullError,
  StorageUnavailableError, StreamTooSlowError, UnavailableError, ValidationError, errorFor, fromCallError, fromStatus,
  NotLeaderError, NotOwnerError, OwnerNotPermittedError, PermissionDeniedError, UnauthenticatedError,
} from "./errors.js";
export { TERMINAL_STATUSES, recordFromPb, recordToPb, statusFromPb, statusToPb } from "./records.js";
export type { CheckpointRef, LeaseInfo, LostReason, Outcome, RunRecord, RunStatus, Suspension } from "./records.js";
export { newRequestId } from "./retry.js";
export type { RetryPolicy } from "./retry.js";
export { parseEndpoints } from "./endpoints.js";
export type { ConnectionOptions, KeepalivePingOptions, Pem, TlsOptions } from "./endpoints.js";
export type { CommandKind, Transport } from "./execute.js";
export { MAX_SHARDS, SHARD_KEY_SEPARATOR, shardOf } from "./shards.js";
export { MAX_HOPS } from "./routing.js";
export { shardKeys } from "./placement.js";
export type { Stubs } from "./routing.js";
