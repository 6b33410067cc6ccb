// open-multi-agent's run-store seam, as its documentation specifies it:
// RunRecord, RunStore and RunStoreError with its codes.

export type RunLifecycleStatus = "queued" | "running" | "suspended" | "completed" | "failed" | "cancelled";

/** The outcome code of a finished run (open-multi-agent's RunStatusCode; any non-empty string here). */
export type RunStatusCode = string;

export interface RunRecord {
  schema: 1;
  runId: string;
  /** Optimistic concurrency; increments on every write. */
  version: number;
  status: RunLifecycleStatus;
  /** Increments when a worker takes an abandoned run over. */
  attempt: number;
  /** Increments only when ownership changes hands. */
  fencingToken: number;
  lease?: { owner: string; acquiredAt: string; expiresAt: string };
  checkpointRef?: { key: string; snapshotVersion: number; savedAt: string };
  outcome?: { code: RunStatusCode; message?: string };
  suspension?: { suspendedAt: string; pendingApprovalIds: readonly string[] };
  createdAt: string;
  updatedAt: string;
}

export interface RunStore {
  readonly atomicity: "process" | "cross-process";
  get(runId: string): Promise<RunRecord | null>;
  create(record: RunRecord): Promise<boolean>;
  compareAndSet(runId: string, expectedVersion: number, next: RunRecord): Promise<boolean>;
  delete?(runId: string): Promise<void>;
}

export type RunStoreErrorCode =
  | "RUN_LEASE_HELD"
  | "RUN_LEASE_LOST"
  | "RUN_ALREADY_TERMINAL"
  | "RUN_SUSPENDED"
  | "RUN_INVALID_TRANSITION"
  | "RUN_INTEGRITY_ERROR"
  | "RUN_VALIDATION_ERROR"
  | "RUN_CONFLICT"
  | "RUN_NOT_FOUND"
  | "RUN_STORE_ATOMIC_REQUIRED";

export const RUN_STORE_ERROR_CODES: readonly RunStoreErrorCode[] = [
  "RUN_LEASE_HELD", "RUN_LEASE_LOST", "RUN_ALREADY_TERMINAL", "RUN_SUSPENDED", "RUN_INVALID_TRANSITION",
  "RUN_INTEGRITY_ERROR", "RUN_VALIDATION_ERROR", "RUN_CONFLICT", "RUN_NOT_FOUND", "RUN_STORE_ATOMIC_REQUIRED",
];

export class RunStoreError extends Error {
  readonly code: RunStoreErrorCode;
  /** The record the failure was detected against, when one was read. */
  readonly record: RunRecord | undefined;
  /** For RUN_VALIDATION_ERROR: the field at fault, when known. */
  readonly field: string | undefined;

  constructor(code: RunStoreErrorCode, message: string, options: { record?: RunRecord; field?: string; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = "RunStoreError";
    this.code = code;
    this.record = options.record;
    this.field = options.field;
  }
}

const EDGES: Record<RunLifecycleStatus, readonly RunLifecycleStatus[]> = {
  queued: ["running", "cancelled", "failed"],
  running: ["suspended", "completed", "failed", "cancelled", "queued"],
  suspended: ["queued", "running", "cancelled", "failed"],
  completed: [],
  failed: [],
  cancelled: [],
};

/** Whether the lifecycle allows `from` -> `to`. */
export function canTransitionRun(from: RunLifecycleStatus, to: RunLifecycleStatus): boolean {
  return EDGES[from].includes(to);
}

export function isTerminalRunStatus(status: RunLifecycleStatus): boolean {
  return EDGES[status].length === 0;
}
