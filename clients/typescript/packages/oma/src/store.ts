// FencepostRunStore: open-multi-agent's RunStore over fencepost's raw
// RunStore service (SPEC §7), plus the push OMA's ledger lacks
// (onFenceMoved, over KeepAlive `track`).
//
// Tokens. fencepost never reuses a fencing token for a run id, also across
// a delete; OMA's ledger creates every run — also a deleted id created
// again — at token 1. The adapter reconciles the two with a per-run epoch
// carried in the server's token itself:
//
//     server token = epoch * 2^32 + OMA token        (epoch 0 until a delete)
//
// A create that the server refuses because the id's deleted incarnation
// reached token T is repeated at the smallest epoch whose tokens are all
// above T (epoch = floor(T / 2^32) + 1). Every handle, in every process,
// decodes a record the same way from the token alone, so OMA sees its own
// numbering (1, 2, ...) while the server's tokens for the id strictly
// increase forever. Downstream resources that fence on tokens should use
// the server token (serverFencingToken), which is unique per run id; the
// OMA token alone is unique only within one incarnation of the id.
import { create } from "@bufbuild/protobuf";
import { timestampFromMs, timestampMs, type Timestamp } from "@bufbuild/protobuf/wkt";
import {
  FencepostClient,
  FencepostError,
  ValidationError,
  fromCallError,
  probeServer,
  type ClientOptions,
  type LostReason,
} from "@fencepost/client";
import {
  CheckpointRefSchema,
  LeaseSchema,
  OutcomeSchema,
  RunSchema,
  RunStatus as PbStatus,
  SuspensionSchema,
  type Run as PbRun,
} from "@fencepost/client/gen/fencepost/v1/record_pb";
import { RunStoreError, RUN_STORE_ERROR_CODES, type RunLifecycleStatus, type RunRecord, type RunStore, type RunStoreErrorCode } from "./types.js";

/** The span of OMA tokens one epoch holds. */
export const EPOCH_SPAN = 1n << 32n;
const MAX_OMA_TOKEN = Number(EPOCH_SPAN) - 1;

const STATUS: Record<RunLifecycleStatus, PbStatus> = {
  queued: PbStatus.QUEUED, running: PbStatus.RUNNING, suspended: PbStatus.SUSPENDED,
  completed: PbStatus.COMPLETED, failed: PbStatus.FAILED, cancelled: PbStatus.CANCELLED,
};
const STATUS_BACK = new Map<PbStatus, RunLifecycleStatus>(Object.entries(STATUS).map(([k, v]) => [v, k as RunLifecycleStatus]));

/** The server token for an OMA token in an epoch. */
export function encodeToken(epoch: bigint, omaToken: number): bigint {
  return epoch * EPOCH_SPAN + BigInt(omaToken);
}

/** [epoch, OMA token] of a server token. */
export function decodeToken(serverToken: bigint): [bigint, number] {
  return [serverToken / EPOCH_SPAN, Number(serverToken % EPOCH_SPAN)];
}

/** The first epoch all of whose tokens are above a deleted incarnation's last token. */
export function epochAbove(tombstone: bigint): bigint {
  return tombstone / EPOCH_SPAN + 1n;
}

function invalid(field: string, message: string): RunStoreError {
  return new RunStoreError("RUN_VALIDATION_ERROR", `${field}: ${message}`, { field });
}

function isoToTs(value: unknown, field: string): Timestamp {
  const ms = typeof value === "string" ? Date.parse(value) : Number.NaN;
  if (!Number.isFinite(ms)) throw invalid(field, `must be an ISO-8601 timestamp, got ${JSON.stringify(value)}`);
  return timestampFromMs(ms);
}

function count(value: unknown, field: string, min: number, max = Number.MAX_SAFE_INTEGER): bigint {
  if (typeof value !== "number" || !Number.isInteger(value) || value < min || value > max) {
    throw invalid(field, `must be an integer in ${min} - ${max}, got ${JSON.stringify(value)}`);
  }
  return BigInt(value);
}

const iso = (t: Timestamp | undefined) => new Date(t ? timestampMs(t) : 0).toISOString();

/** An OMA record as the server's Run, at `epoch`. Throws RunStoreError RUN_VALIDATION_ERROR naming the field. */
export function toServerRecord(r: RunRecord, epoch: bigint, prefix = "run"): PbRun {
  if (r === null || typeof r !== "object") throw invalid(prefix, "must be a run record");
  if (r.schema !== 1) throw invalid(`${prefix}.schema`, "must be 1");
  if (typeof r.runId !== "string" || r.runId.length === 0) throw invalid(`${prefix}.runId`, "must be a non-empty string");
  const status = STATUS[r.status];
  if (status === undefined) throw invalid(`${prefix}.status`, `must be one of ${Object.keys(STATUS).join(", ")}`);
  const token = count(r.fencingToken, `${prefix}.fencingToken`, 1, MAX_OMA_TOKEN);
  const m = create(RunSchema, {
    schema: 1,
    runId: r.runId,
    version: count(r.version, `${prefix}.version`, 1),
    status,
    attempt: count(r.attempt, `${prefix}.attempt`, 1),
    fencingToken: epoch * EPOCH_SPAN + token,
    createdAt: isoToTs(r.createdAt, `${prefix}.createdAt`),
    updatedAt: isoToTs(r.updatedAt, `${prefix}.updatedAt`),
  });
  if (r.lease !== undefined) {
    if (typeof r.lease.owner !== "string") throw invalid(`${prefix}.lease.owner`, "must be a string");
    m.lease = create(LeaseSchema, {
      owner: r.lease.owner,
      acquiredAt: isoToTs(r.lease.acquiredAt, `${prefix}.lease.acquiredAt`),
      expiresAt: isoToTs(r.lease.expiresAt, `${prefix}.lease.expiresAt`),
    });
  }
  if (r.checkpointRef !== undefined) {
    m.checkpointRef = create(CheckpointRefSchema, {
      key: String(r.checkpointRef.key),
      snapshotVersion: count(r.checkpointRef.snapshotVersion, `${prefix}.checkpointRef.snapshotVersion`, 0),
      savedAt: isoToTs(r.checkpointRef.savedAt, `${prefix}.checkpointRef.savedAt`),
    });
  }
  if (r.outcome !== undefined) {
    m.outcome = create(OutcomeSchema, {
      code: String(r.outcome.code), ...(r.outcome.message === undefined ? {} : { message: String(r.outcome.message) }),
    });
  }
  if (r.suspension !== undefined) {
    if (!Array.isArray(r.suspension.pendingApprovalIds)) throw invalid(`${prefix}.suspension.pendingApprovalIds`, "must be an array");
    m.suspension = create(SuspensionSchema, {
      suspendedAt: isoToTs(r.suspension.suspendedAt, `${prefix}.suspension.suspendedAt`),
      pendingApprovalIds: [...r.suspension.pendingApprovalIds],
    });
  }
  return m;
}

/** The server's Run as an OMA record (tokens decoded). */
export function fromServerRecord(m: PbRun): RunRecord {
  const status = STATUS_BACK.get(m.status);
  if (status === undefined) throw new RunStoreError("RUN_INTEGRITY_ERROR", `run ${m.runId}: unknown status ${m.status}`);
  const r: RunRecord = {
    schema: 1,
    runId: m.runId,
    version: Number(m.version),
    status,
    attempt: Number(m.attempt),
    fencingToken: decodeToken(m.fencingToken)[1],
    createdAt: iso(m.createdAt),
    updatedAt: iso(m.updatedAt),
  };
  if (m.lease) r.lease = { owner: m.lease.owner, acquiredAt: iso(m.lease.acquiredAt), expiresAt: iso(m.lease.expiresAt) };
  if (m.checkpointRef) {
    r.checkpointRef = { key: m.checkpointRef.key, snapshotVersion: Number(m.checkpointRef.snapshotVersion), savedAt: iso(m.checkpointRef.savedAt) };
  }
  if (m.outcome) r.outcome = m.outcome.message === undefined ? { code: m.outcome.code } : { code: m.outcome.code, message: m.outcome.message };
  if (m.suspension) r.suspension = { suspendedAt: iso(m.suspension.suspendedAt), pendingApprovalIds: [...m.suspension.pendingApprovalIds] };
  return r;
}

/** The server's name of a record field (run.lease.expires_at) as OMA's (run.lease.expiresAt). */
export function camelField(field: string): string {
  return field.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());
}

/** A client error as a RunStoreError when OMA has a code for it; other failures (unavailable, storage) stay as they are. */
function toStoreError(e: unknown): Error {
  if (e instanceof RunStoreError) return e;
  const err: FencepostError = fromCallError(e);
  if ((RUN_STORE_ERROR_CODES as readonly string[]).includes(err.code)) {
    const options: { field?: string; cause: unknown } = { cause: err };
    if (err.field) options.field = camelField(err.field);
    return new RunStoreError(err.code as RunStoreErrorCode, err.message, options);
  }
  return err;
}

export interface FenceMovedEvent {
  runId: string;
  /** The OMA token that was watched (no longer current). */
  fencingToken: number;
  reason: LostReason;
  /** The record after the change; null when the run was deleted. */
  record: RunRecord | null;
}

export interface ConnectOptions extends ClientOptions {
  /** Use this client (its connection and KeepAlive stream) instead of opening one; close() then leaves it open. */
  client?: FencepostClient;
}

const CACHE_LIMIT = 10_000;

export class FencepostRunStore implements RunStore {
  /** Declared from the server's Describe, never assumed. */
  readonly atomicity: "process" | "cross-process";
  readonly client: FencepostClient;
  private readonly ownsClient: boolean;
  /** Epoch per run id, as last seen by this handle. */
  private readonly epochs = new Map<string, bigint>();

  private constructor(client: FencepostClient, atomicity: "process" | "cross-process", ownsClient: boolean) {
    this.client = client;
    this.atomicity = atomicity;
    this.ownsClient = ownsClient;
  }

  /** Connect to a fencepost server and read its atomicity declaration (RunStore.Describe). */
  static async connect(address: string | readonly string[], options: ConnectOptions = {}): Promise<FencepostRunStore> {
    const { client: given, ...clientOptions } = options;
    const client = given ?? new FencepostClient(address, clientOptions);
    try {
      // every later call is on the raw seam: a role that may not Describe may not use it either
      const d = await probeServer(client, { requireDescribe: true });
      return new FencepostRunStore(client, d.atomicity, given === undefined);
    } catch (e) {
      if (given === undefined) await client.close();
      throw toStoreError(e);
    }
  }

  async get(runId: string): Promise<RunRecord | null> {
    try {
      const r = await this.client.read((o, stubs) => stubs.runStore.get({ runId }, o), {}, runId);
      if (!r.found || !r.run) return null;
      this.remember(runId, r.run.fencingToken);
      return fromServerRecord(r.run);
    } catch (e) {
      throw toStoreError(e);
    }
  }

  async create(record: RunRecord): Promise<boolean> {
    let epoch = 0n;
    toServerRecord(record, epoch); // validate before anything is sent
    for (let attempt = 0; attempt < 64; attempt++) {
      try {
        const run = toServerRecord(record, epoch);
        const r = await this.client.mutate((requestId, o, stubs) => stubs.runStore.create({ run, requestId }, o), {}, record.runId);
        if (r.run) this.remember(record.runId, r.run.fencingToken);
        return r.created;
      } catch (e) {
        const err = fromCallError(e);
        if (!(err instanceof ValidationError && err.field === "run.fencing_token")) throw toStoreError(err);
        // The id was deleted at a token at or above ours: move to the next epoch above it.
        const tomb = /must be above (\d+)/.exec(err.message);
        epoch = tomb ? epochAbove(BigInt(tomb[1]!)) : (epoch === 0n ? 1n : epoch * 2n);
      }
    }
    throw new RunStoreError("RUN_INTEGRITY_ERROR", `create ${record.runId}: no token epoch above the deleted run's was accepted`);
  }

  async compareAndSet(runId: string, expectedVersion: number, next: RunRecord): Promise<boolean> {
    if (next?.runId !== runId) throw invalid("next.runId", "must equal runId");
    if (!Number.isInteger(expectedVersion) || expectedVersion < 1) throw invalid("expectedVersion", "must be an integer >= 1");
    if (next.version !== expectedVersion + 1) throw invalid("next.version", "must be expectedVersion + 1");
    let epoch = this.epochs.get(runId);
    if (epoch === undefined) {
      const cur = await this.fetch(runId);
      if (!cur || cur.version !== BigInt(expectedVersion)) return false;
      epoch = decodeToken(cur.fencingToken)[0];
    }
    for (let refreshed = false; ; refreshed = true) {
      const nextPb = toServerRecord(next, epoch, "next");
      try {
        const r = await this.client.mutate((requestId, o, stubs) =>
          stubs.runStore.compareAndSet({ runId, expectedVersion: BigInt(expectedVersion), next: nextPb, requestId }, o), {}, runId);
        if (r.run) this.remember(runId, r.run.fencingToken);
        else this.epochs.delete(runId);
        return r.swapped;
      } catch (e) {
        const err = fromCallError(e);
        // A token "going backwards" after a delete and re-create elsewhere: our epoch is stale.
        if (refreshed || !(err instanceof ValidationError && err.field === "next.fencing_token")) {
          throw this.withRecord(toStoreError(err), err);
        }
        const cur = await this.fetch(runId);
        if (!cur || cur.version !== BigInt(expectedVersion)) return false;
        const fresh = decodeToken(cur.fencingToken)[0];
        if (fresh === epoch) throw this.withRecord(toStoreError(err), err);
        epoch = fresh;
      }
    }
  }

  async delete(runId: string): Promise<void> {
    try {
      await this.client.mutate((requestId, o, stubs) => stubs.runStore.delete({ runId, requestId }, o), {}, runId);
      this.epochs.delete(runId);
    } catch (e) {
      throw toStoreError(e);
    }
  }

  /**
   * The token the server holds for `record` (epoch and OMA token), for
   * downstream resources that fence writers: unique for the run id across
   * deletes, and what Ledger.ValidateFence compares.
   */
  async serverFencingToken(runId: string): Promise<bigint | null> {
    const cur = await this.fetch(runId);
    return cur ? cur.fencingToken : null;
  }

  /**
   * Be told within milliseconds when `runId`'s fence moves away from the
   * given OMA token (default: the current one) — a takeover, a cancel or
   * any write that changes the token, the owner or drops the lease, or a
   * delete. OMA's ledger otherwise learns of it only at its next write.
   * The listener is called at most once. Returns a function that stops
   * watching.
   */
  async onFenceMoved(runId: string, listener: (event: FenceMovedEvent) => void, fencingToken?: number): Promise<() => void> {
    let serverToken: bigint;
    const epoch = this.epochs.get(runId);
    if (fencingToken !== undefined && epoch !== undefined) {
      serverToken = encodeToken(epoch, fencingToken);
    } else {
      const cur = await this.fetch(runId);
      if (!cur) throw new RunStoreError("RUN_NOT_FOUND", `run ${runId} does not exist`);
      const [e, t] = decodeToken(cur.fencingToken);
      serverToken = fencingToken === undefined ? cur.fencingToken : encodeToken(e, fencingToken);
      if (fencingToken !== undefined && fencingToken !== t && fencingToken > t) {
        throw invalid("fencingToken", `is above the run's current token ${t}`);
      }
    }
    const omaToken = decodeToken(serverToken)[1];
    let fired = false;
    const stop = this.client.watchFence(runId, serverToken, {
      lost: (reason, record) => {
        if (fired) return;
        fired = true;
        listener({ runId, fencingToken: omaToken, reason, record: record ? fromClientRecord(record) : null });
      },
    });
    return stop;
  }

  /** Close the connection (when this store opened it). */
  async close(): Promise<void> {
    if (this.ownsClient) await this.client.close();
  }

  private async fetch(runId: string): Promise<PbRun | undefined> {
    try {
      const r = await this.client.read((o, stubs) => stubs.runStore.get({ runId }, o), {}, runId);
      if (r.found && r.run) this.remember(runId, r.run.fencingToken);
      return r.found ? r.run : undefined;
    } catch (e) {
      throw toStoreError(e);
    }
  }

  private remember(runId: string, serverToken: bigint): void {
    this.epochs.delete(runId);
    this.epochs.set(runId, decodeToken(serverToken)[0]);
    if (this.epochs.size > CACHE_LIMIT) this.epochs.delete(this.epochs.keys().next().value as string);
  }

  private withRecord(storeErr: Error, err: FencepostError): Error {
    if (storeErr instanceof RunStoreError && err.record && !storeErr.record) {
      const options: { record: RunRecord; field?: string; cause: unknown } = { record: fromClientRecord(err.record), cause: err };
      if (storeErr.field) options.field = storeErr.field;
      return new RunStoreError(storeErr.code, storeErr.message, options);
    }
    return storeErr;
  }
}

type ClientRecord = NonNullable<FencepostError["record"]>;

/** A client-side record (Dates, decoded counters) as an OMA record. */
function fromClientRecord(r: ClientRecord): RunRecord {
  const out: RunRecord = {
    schema: 1, runId: r.runId, version: r.version, status: r.status, attempt: r.attempt,
    fencingToken: decodeToken(BigInt(r.fencingToken))[1], createdAt: r.createdAt.toISOString(), updatedAt: r.updatedAt.toISOString(),
  };
  if (r.lease) out.lease = { owner: r.lease.owner, acquiredAt: r.lease.acquiredAt.toISOString(), expiresAt: r.lease.expiresAt.toISOString() };
  if (r.checkpointRef) out.checkpointRef = { key: r.checkpointRef.key, snapshotVersion: r.checkpointRef.snapshotVersion, savedAt: r.checkpointRef.savedAt.toISOString() };
  if (r.outcome) out.outcome = { ...r.outcome };
  if (r.suspension) out.suspension = { suspendedAt: r.suspension.suspendedAt.toISOString(), pendingApprovalIds: [...r.suspension.pendingApprovalIds] };
  return out;
}
