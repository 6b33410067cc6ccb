// One error class per fencepost reason, and the one mapping from a gRPC
// status (its google.rpc.ErrorInfo detail and the observed record packed
// beside it) to them. Nothing in the client matches on message text.
import { anyUnpack } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";
import { ErrorInfoSchema } from "./gen/google/rpc/error_details_pb.js";
import type { Status } from "./gen/google/rpc/status_pb.js";
import { RunSchema } from "./gen/fencepost/v1/record_pb.js";
import { recordFromPb, type LostReason, type RunRecord } from "./records.js";

export const ERROR_DOMAIN = "fencepost";

export interface ErrorOptions {
  record?: RunRecord;
  field?: string;
  grpcCode?: Code;
  cause?: unknown;
  metadata?: Record<string, string>;
}

/** Base of every error the client throws for a failed call. */
export class FencepostError extends Error {
  /** The fencepost reason (e.g. "RUN_LEASE_HELD"), or the gRPC code name when the status had none. */
  readonly code: string;
  /** The run record the server observed when it refused, when it read one. */
  readonly record: RunRecord | undefined;
  /** For RUN_VALIDATION_ERROR: the input field at fault (e.g. "lease_ttl_ms"). */
  readonly field: string | undefined;
  /** The gRPC status code of the call. */
  readonly grpcCode: Code | undefined;
  /**
   * The refusal's ErrorInfo metadata, when the server sent one: `field`, a
   * lock fence's `lock_key` / `fencing_token` / `owner`, a transaction's
   * `command_index`, ...
   */
  readonly metadata: Readonly<Record<string, string>>;

  constructor(code: string, message: string, options: ErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = code;
    this.record = options.record;
    this.field = options.field;
    this.grpcCode = options.grpcCode;
    this.metadata = { ...options.metadata };
  }

  /** For a refused transaction: the index (from 0) of the command that was refused. */
  get commandIndex(): number | undefined {
    const i = this.metadata["command_index"];
    return i === undefined || i === "" ? undefined : Number(i);
  }
}

type Ctor = new (message: string, options?: ErrorOptions) => FencepostError;
function reason<C extends string>(code: C) {
  return class extends FencepostError {
    static readonly code: C = code;
    constructor(message: string, options?: ErrorOptions) {
      super(code, message, options);
    }
  };
}

/** Bad input; `field` names it. Nothing changed. */
export class ValidationError extends reason("RUN_VALIDATION_ERROR") {}
export class RunNotFoundError extends reason("RUN_NOT_FOUND") {}
/** Another owner holds a live lease; `record` shows who. */
export class LeaseHeldError extends reason("RUN_LEASE_HELD") {}
/** The handle's fence moved: another owner, a cancel, a delete... */
export class LeaseLostError extends FencepostError {
  static readonly code: string = "RUN_LEASE_LOST";
  /** Why, when a KeepAlive push told us. */
  readonly reason: LostReason | undefined;
  constructor(message: string, options: ErrorOptions & { reason?: LostReason } = {}, code = "RUN_LEASE_LOST") {
    super(code, message, options);
    this.reason = options.reason;
  }
}
/** Raised locally, never by the server: safe-until passed or the lease is expiring. */
export class LeaseAtRiskError extends LeaseLostError {
  static override readonly code: string = "LEASE_AT_RISK";
  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options, "LEASE_AT_RISK");
  }
}
export class AlreadyTerminalError extends reason("RUN_ALREADY_TERMINAL") {}
export class RunSuspendedError extends reason("RUN_SUSPENDED") {}
export class InvalidTransitionError extends reason("RUN_INVALID_TRANSITION") {}
export class ConflictError extends reason("RUN_CONFLICT") {}
export class IntegrityError extends reason("RUN_INTEGRITY_ERROR") {}
/**
 * A fenced engine-store write named a keyed lock whose token is no longer
 * current (taken over, or released); nothing changed. `lockKey`,
 * `fencingToken` and `owner` (undefined when released) describe the lock as
 * the server saw it.
 */
export class LockLostError extends reason("LOCK_LOST") {
  get lockKey(): string { return this.metadata["lock_key"] ?? ""; }
  get fencingToken(): number | undefined {
    const t = this.metadata["fencing_token"];
    return t ? Number(t) : undefined;
  }
  get owner(): string | undefined { return this.metadata["owner"] || undefined; }
}
/** An engine-store UpdateRun guard failed; nothing changed. */
export class InvalidRunStateError extends reason("INVALID_RUN_STATE") {}
/** The write could not be made durable; nothing was written. */
export class StorageFullError extends reason("STORAGE_FULL") {}
/** The write could not be made durable; nothing was written. */
export class StorageUnavailableError extends reason("STORAGE_UNAVAILABLE") {}
/** watchRuns: that revision is no longer retained; list again. */
export class RevisionCompactedError extends reason("RUN_REVISION_COMPACTED") {}
/** A stream fell too far behind (the client reconnects by itself). */
export class StreamTooSlowError extends reason("STREAM_TOO_SLOW") {}
/** No answer: UNAVAILABLE after every retry, or a deadline passed. */
export class UnavailableError extends FencepostError {
  constructor(message: string, options: ErrorOptions = {}, code = "UNAVAILABLE") {
    super(code, message, options);
  }
}
/** The server is stopping and did nothing with this call. */
export class ShuttingDownError extends UnavailableError {
  static readonly code = "SHUTTING_DOWN";
  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options, "SHUTTING_DOWN");
  }
}
/** A mutation got no answer: it may or may not have been applied. */
export class OutcomeUnknownError extends UnavailableError {
  static readonly code = "OUTCOME_UNKNOWN";
  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options, "OUTCOME_UNKNOWN");
  }
}
/**
 * A coordinator that is a standby refused the call (it did nothing with it):
 * `leader` is the leader's advertised address, "" while a takeover is under
 * way. The client follows it by itself; this surfaces only when no endpoint
 * took the call before the retry policy gave up.
 */
export class NotLeaderError extends UnavailableError {
  static readonly code = "NOT_LEADER";
  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options, "NOT_LEADER");
  }
  get leader(): string { return this.metadata["leader"] ?? ""; }
}
/**
 * The coordinator leads only some shards and not the one this call is keyed
 * in (docs/SPEC.md "Shards"); it did nothing with the call, nor remembered
 * its request id. `shard`, `owner` (the address of the coordinator that leads
 * it, "" while none is known) and `epoch` name it. The client sends the call
 * there by itself; this surfaces only when that did not settle within a few hops.
 */
export class NotOwnerError extends UnavailableError {
  static readonly code = "NOT_OWNER";
  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options, "NOT_OWNER");
  }
  get shard(): number { return Number(this.metadata["shard"] ?? -1); }
  get owner(): string { return this.metadata["owner"] ?? ""; }
  get epoch(): number { return Number(this.metadata["epoch"] ?? 0); }
}
/** No credentials, a token the server does not know, or a certificate without the identity it needs. Never retried. */
export class UnauthenticatedError extends reason("UNAUTHENTICATED") {}
/**
 * The caller's roles may not make this call; `metadata.role` names the
 * roles that would, `metadata.principal` who the caller is. Never retried.
 */
export class PermissionDeniedError extends FencepostError {
  static readonly code: string = "PERMISSION_DENIED";
  constructor(message: string, options: ErrorOptions = {}, code = "PERMISSION_DENIED") {
    super(code, message, options);
  }
}
/** The owner is neither the caller's principal nor under `principal/`; `metadata.owner`, `metadata.principal`. */
export class OwnerNotPermittedError extends PermissionDeniedError {
  static override readonly code: string = "OWNER_NOT_PERMITTED";
  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options, "OWNER_NOT_PERMITTED");
  }
}
/** A status with a reason this client has no class for (`code` is the reason or the gRPC code name). */
export class RpcError extends FencepostError {}

const BY_REASON: Record<string, Ctor> = {
  RUN_VALIDATION_ERROR: ValidationError,
  RUN_NOT_FOUND: RunNotFoundError,
  RUN_LEASE_HELD: LeaseHeldError,
  RUN_LEASE_LOST: LeaseLostError,
  RUN_ALREADY_TERMINAL: AlreadyTerminalError,
  RUN_SUSPENDED: RunSuspendedError,
  RUN_INVALID_TRANSITION: InvalidTransitionError,
  RUN_CONFLICT: ConflictError,
  RUN_INTEGRITY_ERROR: IntegrityError,
  INVALID_RUN_STATE: InvalidRunStateError,
  LOCK_LOST: LockLostError,
  STORAGE_FULL: StorageFullError,
  STORAGE_UNAVAILABLE: StorageUnavailableError,
  SHUTTING_DOWN: ShuttingDownError,
  RUN_REVISION_COMPACTED: RevisionCompactedError,
  STREAM_TOO_SLOW: StreamTooSlowError,
  NOT_LEADER: NotLeaderError,
  NOT_OWNER: NotOwnerError,
  UNAUTHENTICATED: UnauthenticatedError,
  PERMISSION_DENIED: PermissionDeniedError,
  OWNER_NOT_PERMITTED: OwnerNotPermittedError,
};

/** The error class for a reason and its fields. */
export function errorFor(code: string, message: string, options: ErrorOptions = {}): FencepostError {
  const C = BY_REASON[code];
  return C ? new C(message, options) : new RpcError(code, message, options);
}

/** The typed error for a failed call (a ConnectError, or anything else thrown by a call). */
export function fromCallError(err: unknown): FencepostError {
  if (err instanceof FencepostError) return err;
  const ce = ConnectError.from(err);
  const info = ce.findDetails(ErrorInfoSchema).find((d) => d.domain === ERROR_DOMAIN);
  const runs = ce.findDetails(RunSchema);
  const options: ErrorOptions = { grpcCode: ce.code, cause: err };
  if (runs[0]) options.record = recordFromPb(runs[0]);
  if (info?.metadata["field"]) options.field = info.metadata["field"];
  if (info) options.metadata = info.metadata;
  if (info) return errorFor(info.reason, ce.rawMessage, options);
  if (ce.code === Code.Unavailable || ce.code === Code.DeadlineExceeded) {
    return new UnavailableError(ce.rawMessage, options, codeName(ce.code));
  }
  // A refusal by something in front of the server (a proxy, a load balancer) carries no reason.
  if (ce.code === Code.Unauthenticated) return new UnauthenticatedError(ce.rawMessage, options);
  if (ce.code === Code.PermissionDenied) return new PermissionDeniedError(ce.rawMessage, options);
  return new RpcError(codeName(ce.code), ce.rawMessage, options);
}

/** A gRPC code's canonical name: DEADLINE_EXCEEDED, INTERNAL... */
function codeName(code: Code): string {
  return (Code[code] ?? "Unknown").replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}

/** The typed error for a google.rpc.Status carried in a message (e.g. an Execute result). */
export function fromStatus(status: Status): FencepostError {
  let info: { reason: string; metadata: Record<string, string> } | undefined;
  let record: RunRecord | undefined;
  for (const d of status.details) {
    const ei = anyUnpack(d, ErrorInfoSchema);
    if (ei && ei.domain === ERROR_DOMAIN) info = ei;
    const run = anyUnpack(d, RunSchema);
    if (run) record = recordFromPb(run);
  }
  const options: ErrorOptions = { grpcCode: status.code as Code };
  if (record) options.record = record;
  if (info?.metadata["field"]) options.field = info.metadata["field"];
  if (info) options.metadata = info.metadata;
  return info ? errorFor(info.reason, status.message, options) : new RpcError(codeName(status.code as Code), status.message, options);
}

/** Whether a failed attempt may be retried with the same request id. */
export function isRetryable(err: FencepostError): boolean {
  // a NotOwnerError reaching a retry is one routing gave up on (or a call that is not routed)
  return err.grpcCode === Code.Unavailable && !(err instanceof NotOwnerError);
}
