// The run record as TypeScript users see it: camelCase fields, numbers for
// counters, Dates for times, lowercase status names, and absent sub-records
// as `undefined` (never empty placeholders).
import { create } from "@bufbuild/protobuf";
import { timestampFromMs, timestampMs, type Timestamp } from "@bufbuild/protobuf/wkt";
import {
  CheckpointRefSchema,
  LeaseSchema,
  OutcomeSchema,
  RunSchema,
  RunStatus as PbRunStatus,
  SuspensionSchema,
  type Run as PbRun,
} from "./gen/fencepost/v1/record_pb.js";
import { LostReason as PbLostReason } from "./gen/fencepost/v1/ledger_pb.js";

/** The lifecycle status of a run (SPEC §3). */
export type RunStatus = "queued" | "running" | "suspended" | "completed" | "failed" | "cancelled";

/** Statuses nothing leaves. */
export const TERMINAL_STATUSES: readonly RunStatus[] = ["completed", "failed", "cancelled"];

const STATUS_TO_PB: Record<RunStatus, PbRunStatus> = {
  queued: PbRunStatus.QUEUED,
  running: PbRunStatus.RUNNING,
  suspended: PbRunStatus.SUSPENDED,
  completed: PbRunStatus.COMPLETED,
  failed: PbRunStatus.FAILED,
  cancelled: PbRunStatus.CANCELLED,
};
const STATUS_FROM_PB = new Map<PbRunStatus, RunStatus>(
  Object.entries(STATUS_TO_PB).map(([k, v]) => [v, k as RunStatus]),
);

export function statusToPb(status: RunStatus, field = "status"): PbRunStatus {
  const v = STATUS_TO_PB[status];
  if (v === undefined) {
    throw new TypeError(`${field}: must be one of ${Object.keys(STATUS_TO_PB).join(", ")}, got ${String(status)}`);
  }
  return v;
}

export function statusFromPb(status: PbRunStatus): RunStatus {
  const v = STATUS_FROM_PB.get(status);
  if (v === undefined) throw new TypeError(`unknown run status ${status} from the server`);
  return v;
}

/** Why a lease's fence moved (pushed by KeepAlive). */
export type LostReason = "taken_over" | "cancelled" | "deleted" | "fence_moved" | "finished" | "unknown";

export function lostReasonFromPb(reason: PbLostReason): LostReason {
  switch (reason) {
    case PbLostReason.TAKEN_OVER: return "taken_over";
    case PbLostReason.CANCELLED: return "cancelled";
    case PbLostReason.DELETED: return "deleted";
    case PbLostReason.FENCE_MOVED: return "fence_moved";
    case PbLostReason.FINISHED: return "finished";
    default: return "unknown";
  }
}

/**
 * Why the fence at `token` is gone, judged from the record the server
 * refused a fenced write with (such a refusal carries no reason): the rule
 * the server uses for a loss it learns of after the fact.
 */
export function deriveLostReason(record: RunRecord | undefined, token: number): LostReason {
  if (!record) return "deleted";
  if (record.status === "cancelled" && record.fencingToken > token) return "cancelled";
  if (TERMINAL_STATUSES.includes(record.status)) return "finished";
  if (record.fencingToken !== token && record.lease) return "taken_over";
  return "fence_moved";
}

export interface LeaseInfo {
  owner: string;
  acquiredAt: Date;
  expiresAt: Date;
  ttlMs: number;
  lockDelayMs: number;
}

export interface CheckpointRef {
  key: string;
  snapshotVersion: number;
  savedAt: Date;
}

export interface Outcome {
  code: string;
  message?: string;
}

export interface Suspension {
  suspendedAt: Date;
  pendingApprovalIds: string[];
}

/** The authoritative record fencepost keeps per run (SPEC §2). */
export interface RunRecord {
  schema: number;
  runId: string;
  version: number;
  status: RunStatus;
  attempt: number;
  fencingToken: number;
  lease?: LeaseInfo;
  checkpointRef?: CheckpointRef;
  outcome?: Outcome;
  suspension?: Suspension;
  createdAt: Date;
  updatedAt: Date;
  /** The server-wide revision of the commit that wrote this version. */
  revision: number;
}

/** An int64 from the wire as a number; refuses values a number cannot hold exactly. */
export function toNumber(v: bigint, field = "value"): number {
  if (v > BigInt(Number.MAX_SAFE_INTEGER) || v < BigInt(Number.MIN_SAFE_INTEGER)) {
    throw new RangeError(`${field}: ${v} does not fit a JavaScript number exactly`);
  }
  return Number(v);
}

/** A number for an int64 field; refuses non-integers (naming the field). */
export function toBigInt(v: number | bigint, field: string): bigint {
  if (typeof v === "bigint") return v;
  if (!Number.isSafeInteger(v)) throw new TypeError(`${field}: must be a safe integer, got ${v}`);
  return BigInt(v);
}

function date(ts: Timestamp | undefined): Date {
  return new Date(ts === undefined ? 0 : timestampMs(ts));
}

/** A record from its wire form. */
export function recordFromPb(m: PbRun): RunRecord {
  const r: RunRecord = {
    schema: m.schema,
    runId: m.runId,
    version: toNumber(m.version, "version"),
    status: statusFromPb(m.status),
    attempt: toNumber(m.attempt, "attempt"),
    fencingToken: toNumber(m.fencingToken, "fencing_token"),
    createdAt: date(m.createdAt),
    updatedAt: date(m.updatedAt),
    revision: toNumber(m.revision, "revision"),
  };
  if (m.lease) {
    r.lease = {
      owner: m.lease.owner,
      acquiredAt: date(m.lease.acquiredAt),
      expiresAt: date(m.lease.expiresAt),
      ttlMs: toNumber(m.lease.ttlMs, "lease.ttl_ms"),
      lockDelayMs: toNumber(m.lease.lockDelayMs, "lease.lock_delay_ms"),
    };
  }
  if (m.checkpointRef) {
    r.checkpointRef = {
      key: m.checkpointRef.key,
      snapshotVersion: toNumber(m.checkpointRef.snapshotVersion, "checkpoint_ref.snapshot_version"),
      savedAt: date(m.checkpointRef.savedAt),
    };
  }
  if (m.outcome) {
    r.outcome = { code: m.outcome.code };
    if (m.outcome.message !== undefined) r.outcome.message = m.outcome.message;
  }
  if (m.suspension) {
    r.suspension = {
      suspendedAt: date(m.suspension.suspendedAt),
      pendingApprovalIds: [...m.suspension.pendingApprovalIds],
    };
  }
  return r;
}

/** The wire form of a record (for the raw RunStore seam). */
export function recordToPb(r: RunRecord, fencingToken?: bigint): PbRun {
  const m = create(RunSchema, {
    schema: r.schema,
    runId: r.runId,
    version: toBigInt(r.version, "version"),
    status: statusToPb(r.status),
    attempt: toBigInt(r.attempt, "attempt"),
    fencingToken: fencingToken ?? toBigInt(r.fencingToken, "fencing_token"),
    createdAt: timestampFromMs(r.createdAt.getTime()),
    updatedAt: timestampFromMs(r.updatedAt.getTime()),
  });
  if (r.lease) {
    m.lease = create(LeaseSchema, {
      owner: r.lease.owner,
      acquiredAt: timestampFromMs(r.lease.acquiredAt.getTime()),
      expiresAt: timestampFromMs(r.lease.expiresAt.getTime()),
      ttlMs: toBigInt(r.lease.ttlMs, "lease.ttl_ms"),
      lockDelayMs: toBigInt(r.lease.lockDelayMs, "lease.lock_delay_ms"),
    });
  }
  if (r.checkpointRef) {
    m.checkpointRef = create(CheckpointRefSchema, {
      key: r.checkpointRef.key,
      snapshotVersion: toBigInt(r.checkpointRef.snapshotVersion, "checkpoint_ref.snapshot_version"),
      savedAt: timestampFromMs(r.checkpointRef.savedAt.getTime()),
    });
  }
  if (r.outcome) m.outcome = create(OutcomeSchema, r.outcome);
  if (r.suspension) {
    m.suspension = create(SuspensionSchema, {
      suspendedAt: timestampFromMs(r.suspension.suspendedAt.getTime()),
      pendingApprovalIds: [...r.suspension.pendingApprovalIds],
    });
  }
  return m;
}
