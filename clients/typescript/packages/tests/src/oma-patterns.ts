// How open-multi-agent uses a MemoryStore, re-stated from its documented
// behaviour (its package is not installable here): MemoryStoreRunStore keeps
// run records under `__oma_run__/<runId>` and swaps them with
// compareAndSet on the exact stored JSON; checkpoints are one JSON value at
// `__oma_checkpoint__/<runId>/latest`; durable approvals create a request
// at `__oma_approval__/<requestId>` if absent, and a decision is a
// compareAndSet from the undecided record, so the first decision wins.
import { RunStoreError, type RunRecord, type RunStore } from "@fencepost/oma";
import type { MemoryStore } from "@fencepost/oma";

export class MemoryRunStore implements RunStore {
  readonly atomicity: "process" | "cross-process";
  constructor(private readonly store: MemoryStore, atomicity: "process" | "cross-process" = "process") {
    if (!store.compareAndSet) throw new RunStoreError("RUN_STORE_ATOMIC_REQUIRED", "compareAndSet is required");
    this.atomicity = atomicity;
  }

  async get(runId: string): Promise<RunRecord | null> {
    return (await this.read(runId))?.record ?? null;
  }

  async create(record: RunRecord): Promise<boolean> {
    if (record.version !== 1) throw new RunStoreError("RUN_VALIDATION_ERROR", "a record is created at version 1", { field: "version" });
    return this.swap(record.runId, null, record);
  }

  async compareAndSet(runId: string, expectedVersion: number, next: RunRecord): Promise<boolean> {
    if (next.runId !== runId) throw new RunStoreError("RUN_VALIDATION_ERROR", "runId mismatch", { field: "runId" });
    if (next.version !== expectedVersion + 1) throw new RunStoreError("RUN_VALIDATION_ERROR", "version must be expected + 1", { field: "version" });
    const cur = await this.read(runId);
    if (cur === null || cur.record.version !== expectedVersion) return false;
    return this.swap(runId, cur.raw, next);
  }

  async delete(runId: string): Promise<void> {
    await this.store.delete(`__oma_run__/${runId}`);
  }

  private async read(runId: string): Promise<{ record: RunRecord; raw: string } | null> {
    const entry = await this.store.get(`__oma_run__/${runId}`);
    if (entry === null) return null;
    const record = JSON.parse(entry.value) as RunRecord;
    if (record.runId !== runId) throw new RunStoreError("RUN_INTEGRITY_ERROR", "record under another run's key");
    return { record, raw: entry.value };
  }

  private swap(runId: string, expectedRaw: string | null, next: RunRecord): Promise<boolean> {
    return this.store.compareAndSet!(`__oma_run__/${runId}`, expectedRaw, JSON.stringify(next), {
      namespace: "run", schema: 1, runId, version: next.version, status: next.status, attempt: next.attempt,
      fencingToken: next.fencingToken, updatedAt: next.updatedAt,
    });
  }
}

export const checkpointKey = (runId: string) => `__oma_checkpoint__/${runId}/latest`;

/** A checkpoint save as open-multi-agent makes it (its metadata, plus the fence when given). */
export async function saveCheckpoint(store: MemoryStore, runId: string, snapshot: Record<string, unknown>, fence?: { fencingToken: number }): Promise<void> {
  await store.set(checkpointKey(runId), JSON.stringify(snapshot), {
    namespace: "checkpoint", version: 5, runId, createdAt: new Date().toISOString(), ...fence,
  });
}

export async function loadCheckpoint(store: MemoryStore, runId: string): Promise<Record<string, unknown> | null> {
  const entry = await store.get(checkpointKey(runId));
  return entry === null ? null : (JSON.parse(entry.value) as Record<string, unknown>);
}

export const approvalKey = (requestId: string) => `__oma_approval__/${requestId}`;

/** Create the request's record unless it exists (the same request twice converges). */
export async function ensureApprovalRequest(store: MemoryStore, request: { id: string; runId: string }): Promise<void> {
  const value = JSON.stringify({ version: 1, request });
  if (await store.compareAndSet!(approvalKey(request.id), null, value, { namespace: "approval", version: 1, runId: request.runId })) return;
  const existing = await store.get(approvalKey(request.id));
  if (existing?.value !== value) throw new Error(`approval ${request.id} exists with other content`);
}

/** Decide a request: true when this decision was recorded, false when another came first. */
export async function decideApproval(store: MemoryStore, requestId: string, reviewer: string, decision: "approved" | "rejected"): Promise<boolean> {
  const entry = await store.get(approvalKey(requestId));
  if (entry === null) throw new Error(`approval ${requestId} not found`);
  const record = JSON.parse(entry.value) as { request: { runId: string }; decision?: unknown };
  if (record.decision !== undefined) return false;
  const next = JSON.stringify({ ...record, decision: { requestId, decision, reviewer: { id: reviewer }, decidedAt: new Date().toISOString() } });
  return store.compareAndSet!(approvalKey(requestId), entry.value, next, { namespace: "approval", version: 1, runId: record.request.runId, decided: true });
}
