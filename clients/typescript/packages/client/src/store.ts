// The engine store (SPEC §11) with plain JavaScript values: JSON values go
// in and come out as parsed JSON (undefined = absent, null = a stored JSON
// null), times as Dates, bytes as plain Uint8Arrays. Every call copies what
// it is given (by serialising it) and returns values nobody else holds.
// Mutations carry one request id for all their retries.
import { create } from "@bufbuild/protobuf";
import { timestampMs, type Timestamp } from "@bufbuild/protobuf/wkt";
import type { Client } from "@connectrpc/connect";
import {
  EngineArtifactHeaderSchema,
  EngineListRunsRequestSchema,
  EnginePutArtifactRequestSchema,
  EngineRunPatchSchema,
  EngineRunSchema,
  EngineStepSchema,
  FenceSchema,
  type Fence,
  JsonValueSchema,
  type EngineArtifact as PbArtifact,
  type EngineCheckpoint as PbCheckpoint,
  type EngineDoc as PbDoc,
  type EnginePutArtifactRequest,
  type EngineRun as PbEngineRun,
  type EngineStep as PbStep,
  type EngineStore,
  type JsonValue,
} from "./gen/fencepost/v1/engine_store_pb.js";
import { fromCallError, LeaseLostError, LockLostError, ValidationError } from "./errors.js";
import { toBigInt, toNumber } from "./records.js";
import { newRequestId, withRetry, type AttemptOptions, type CallOptions, type FullRetryPolicy } from "./retry.js";
import type { CommandKind, WriteKind } from "./execute.js";
import type { TransactionResponse } from "./gen/fencepost/v1/ledger_pb.js";
import { StoreTransaction, type Answered } from "./transaction.js";
import { SHARD_KEY_SEPARATOR } from "./shards.js";

export interface EngineClaim { owner: string; expiresAt: Date }

export interface EngineRun {
  id: string;
  agent: string;
  status: string;
  concurrencyKey?: string;
  input?: unknown;
  output?: unknown;
  error?: unknown;
  metadata?: unknown;
  claim?: EngineClaim;
  createdAt: Date;
  updatedAt: Date;
}

export type EngineRunInput = Pick<EngineRun, "id" | "agent" | "status" | "concurrencyKey" | "input" | "output" | "error" | "metadata">;

export interface EngineRunPatch {
  status?: string;
  concurrencyKey?: string;
  input?: unknown;
  output?: unknown;
  error?: unknown;
  metadata?: unknown;
  /** Fields to make absent: "concurrency_key", "input", "output", "error", "metadata", "claim". */
  clear?: string[];
}

export interface EngineStep {
  runId: string;
  seq: number;
  name: string;
  status?: string;
  input?: unknown;
  output?: unknown;
  error?: unknown;
  metadata?: unknown;
  createdAt: Date;
}

export interface EngineCheckpoint { runId: string; stepIndex: number; state: unknown; savedAt: Date }

export interface EngineDoc { id: string; doc: Record<string, unknown>; updatedAt: Date }

export interface EngineArtifact {
  id: string;
  runId: string;
  name: string;
  contentType: string;
  sizeBytes: number;
  sha256: string;
  metadata?: unknown;
  createdAt: Date;
}

export interface ArtifactHeader {
  id: string;
  runId: string;
  name?: string;
  contentType?: string;
  metadata?: unknown;
  /** Required when the data is a stream; taken from the bytes otherwise. */
  sizeBytes?: number;
  sha256?: string;
}

export interface Lookup<T> { found: boolean; value: T | undefined; at: Date | undefined }

/**
 * A precondition on a write (docs/FENCING.md): it commits only while the
 * ledger run's fencing token (a Lease's `fence`) or the keyed lock's
 * (acquireLock's `fencingToken`) is still current. Otherwise the write
 * changes nothing and throws LeaseLostError or LockLostError.
 */
export type FenceSpec = { runId: string; fencingToken: number } | { lockKey: string; fencingToken: number };

/** A write's options: its fence, and the call options every call takes. */
export interface WriteOptions extends CallOptions {
  fence?: FenceSpec;
}

/** The wire form of a fence (the server validates it: one target, a token >= 1). */
export function fencePb(f: FenceSpec): Fence {
  const g = f as { runId?: string; lockKey?: string; fencingToken: number };
  return create(FenceSchema, {
    runId: g.runId ?? "", lockKey: g.lockKey ?? "", fencingToken: toBigInt(g.fencingToken, "fence.fencing_token"),
  });
}

function fenceIn(f: FenceSpec | undefined): { fence?: Fence } {
  return f === undefined ? {} : { fence: fencePb(f) };
}

/** A fence given to fenced() or transaction(): exactly one target and an integer token, else ValidationError. */
function checkFence(f: FenceSpec): Fence {
  const g = f as { runId?: unknown; lockKey?: unknown; fencingToken?: unknown };
  const run = typeof g.runId === "string" && g.runId !== "";
  const lock = typeof g.lockKey === "string" && g.lockKey !== "";
  if (run === lock) throw new ValidationError("fence.run_id: give exactly one of runId and lockKey", { field: "fence.run_id" });
  if (typeof g.fencingToken !== "number" || !Number.isSafeInteger(g.fencingToken)) {
    throw new ValidationError(`fence.fencing_token: must be an integer (got ${String(g.fencingToken)})`, { field: "fence.fencing_token" });
  }
  return fencePb(f);
}

/** Bytes per PutArtifact chunk message. */
export const ARTIFACT_CHUNK_BYTES = 256 * 1024;

/** A JSON value for the wire; undefined stays absent. Throws ValidationError naming `field` for non-JSON. */
export function jsonIn(value: unknown, field: string): JsonValue | undefined {
  if (value === undefined) return undefined;
  let text: string | undefined;
  try {
    text = JSON.stringify(value);
  } catch (e) {
    throw new ValidationError(`${field}: not a JSON value (${(e as Error).message})`, { field });
  }
  if (text === undefined) throw new ValidationError(`${field}: not a JSON value`, { field });
  return create(JsonValueSchema, { json: text });
}

export function jsonOut(v: JsonValue | undefined): unknown {
  return v === undefined ? undefined : JSON.parse(v.json);
}

const date = (t: Timestamp | undefined) => new Date(t ? timestampMs(t) : 0);

function setJson(target: Record<string, unknown>, key: string, value: unknown): void {
  if (value !== undefined) target[key] = value;
}

type Values = { input?: JsonValue; output?: JsonValue; error?: JsonValue; metadata?: JsonValue };

/** The four JSON values of a run or step, parsed; absent ones stay absent. */
function valuesOut(target: object, m: Values): void {
  const t = target as Record<string, unknown>;
  setJson(t, "input", jsonOut(m.input));
  setJson(t, "output", jsonOut(m.output));
  setJson(t, "error", jsonOut(m.error));
  setJson(t, "metadata", jsonOut(m.metadata));
}

/** The four JSON values of a run, patch or step for the wire, fields named `${prefix}.input`... */
function valuesIn(v: { input?: unknown; output?: unknown; error?: unknown; metadata?: unknown }, prefix: string): Values {
  return {
    ...opt("input", jsonIn(v.input, `${prefix}.input`)), ...opt("output", jsonIn(v.output, `${prefix}.output`)),
    ...opt("error", jsonIn(v.error, `${prefix}.error`)), ...opt("metadata", jsonIn(v.metadata, `${prefix}.metadata`)),
  };
}

export function engineRunFromPb(m: PbEngineRun): EngineRun {
  const r: EngineRun = { id: m.id, agent: m.agent, status: m.status, createdAt: date(m.createdAt), updatedAt: date(m.updatedAt) };
  if (m.concurrencyKey !== undefined) r.concurrencyKey = m.concurrencyKey;
  valuesOut(r, m);
  if (m.claim) r.claim = { owner: m.claim.owner, expiresAt: date(m.claim.expiresAt) };
  return r;
}

function stepFromPb(m: PbStep): EngineStep {
  const s: EngineStep = { runId: m.runId, seq: toNumber(m.seq), name: m.name, createdAt: date(m.createdAt) };
  if (m.status !== undefined) s.status = m.status;
  valuesOut(s, m);
  return s;
}

function artifactFromPb(m: PbArtifact): EngineArtifact {
  const a: EngineArtifact = {
    id: m.id, runId: m.runId, name: m.name, contentType: m.contentType, sizeBytes: toNumber(m.sizeBytes),
    sha256: m.sha256, createdAt: date(m.createdAt),
  };
  setJson(a as unknown as Record<string, unknown>, "metadata", jsonOut(m.metadata));
  return a;
}

function checkpointFromPb(c: PbCheckpoint): EngineCheckpoint {
  return { runId: c.runId, stepIndex: toNumber(c.stepIndex), state: jsonOut(c.state), savedAt: date(c.savedAt) };
}

function docFromPb(m: PbDoc): EngineDoc {
  return { id: m.id, doc: jsonOut(m.doc) as Record<string, unknown>, updatedAt: date(m.updatedAt) };
}

function opt<T>(key: string, v: T | undefined): Record<string, T> {
  return v === undefined ? {} : { [key]: v };
}

function ttl(ms: number): bigint {
  return toBigInt(ms, "ttl_ms");
}

/** Runs a mutation (the unary request as an init object) with one request id for all its attempts. */
export type CommandRunner = <T>(kind: CommandKind, request: Record<string, unknown>, options?: { signal?: AbortSignal; timeoutMs?: number }) => Promise<T>;

/**
 * @internal Where a view's writes go instead of the server: a transaction
 * queues each (its request built and validated, and how to read its answer).
 */
export type WriteQueue = (kind: WriteKind, request: Record<string, unknown>, convert: (response: never) => unknown) => unknown;

/** @internal What a view adds to the store: a fence on every write, who hears of a refused fence, a queue. */
export interface StoreView {
  fence?: Fence;
  onRefused?: (err: LeaseLostError | LockLostError) => void;
  queue?: WriteQueue;
}

/**
 * @internal Sends a read or upload keyed by `key` (undefined: none) to the
 * stub of the coordinator that leads its shard.
 */
export type StoreRoute = <T>(key: string | undefined, call: (stub: Client<typeof EngineStore>) => Promise<T>) => Promise<T>;

const compound = (a: string, b: string) => `${a}${SHARD_KEY_SEPARATOR}${b}`;

type Resp<K extends keyof Client<typeof EngineStore>> = Client<typeof EngineStore>[K] extends (...a: never[]) => Promise<infer R> ? R : never;

export class EngineStoreClient {
  constructor(
    readonly stub: Client<typeof EngineStore>,
    private readonly retry: FullRetryPolicy,
    private readonly command: CommandRunner,
    private readonly view: StoreView = {},
    private readonly route: StoreRoute = (_key, call) => call(stub),
  ) {}

  /**
   * A view of this store whose every write carries `fence` (docs/FENCING.md):
   * each commits only while the ledger run `runId` is still at
   * `fencingToken` (a lease's token) or the keyed lock `lockKey` still at its
   * token (`acquireLock(...).fencingToken`), checked by the server in the
   * same step as the write. A stale fence throws LeaseLostError
   * (LockLostError for a lock) and writes nothing. A write's own `{ fence }`
   * option replaces the view's; reads are unchanged. The view shares this
   * store's connection and transport (`lease.fenced()` makes one for a lease).
   * Throws ValidationError for a fence without exactly one target or an integer token.
   */
  fenced(fence: FenceSpec): EngineStoreClient {
    return this.withView({ fence: checkFence(fence) });
  }

  /**
   * Writes that commit together or not at all. The writes `fn` makes on `tx`
   * are queued (each returns a QueuedWrite at once; do not wait for them in
   * `fn`); when `fn` returns, they go to the server as one Ledger.Transact
   * (over the client's Execute stream when it is up), under `options.fence`,
   * or this view's fence for a fenced view, or none. It resolves to what `fn`
   * returned, each QueuedWrite in it (alone, or in an array or plain object)
   * replaced by its write's answer; `tx.results` has every answer in order.
   * A refusal of the fence or of any write throws (its `commandIndex` names
   * the write) and nothing was written; if `fn` throws, nothing is sent.
   */
  transaction<R>(fn: (tx: StoreTransaction) => R | PromiseLike<R>, options: { fence?: FenceSpec } = {}): Promise<Answered<R>> {
    let fence: Fence | undefined;
    try {
      fence = options.fence === undefined ? this.view.fence : checkFence(options.fence);
    } catch (e) {
      return Promise.reject(e);
    }
    return StoreTransaction.run(this, fence, undefined, fn);
  }

  /** @internal This view's fence (fenced() or lease.fenced()), if any. */
  get viewFence(): Fence | undefined { return this.view.fence; }

  /** @internal The same store with `view` (and none of this one's). */
  withView(view: StoreView): EngineStoreClient {
    return new EngineStoreClient(this.stub, this.retry, this.command, view, this.route);
  }

  /** @internal One Ledger.Transact (the request as an init object, without request id). */
  transact(request: Record<string, unknown>): Promise<TransactionResponse> {
    return this.refusals(this.command<TransactionResponse>("transaction", request));
  }

  /** A read of what shard key `key` places (undefined: no one shard), on the stub of its coordinator. */
  private read<T>(key: string | undefined, call: (o: AttemptOptions, stub: Client<typeof EngineStore>) => Promise<T>, options: CallOptions = {}): Promise<T> {
    return withRetry(this.retry, false, (o) => this.route(key, (stub) => call(o, stub)), options);
  }

  /**
   * A mutation: `build` makes the request (throwing ValidationError for bad
   * input, so nothing is sent), the view's fence is added unless the call
   * gave one, and `convert` turns the answer into the result. In a
   * transaction's view it is queued instead, and bad input throws at once.
   */
  private write<R, T>(kind: WriteKind, build: () => Record<string, unknown>, convert: (response: R) => T, call: CallOptions = {}): Promise<T> {
    if (this.view.queue) return this.view.queue(kind, build(), convert as (response: never) => unknown) as Promise<T>;
    let request: Record<string, unknown>;
    try {
      request = build();
    } catch (e) {
      return Promise.reject(e);
    }
    if (request["fence"] === undefined && this.view.fence) request["fence"] = this.view.fence;
    const limits: CallOptions = {};
    if (call.signal) limits.signal = call.signal;
    if (call.timeoutMs !== undefined) limits.timeoutMs = call.timeoutMs;
    return this.refusals(this.command<R>(kind, request, limits)).then(convert);
  }

  /** A refused fence is also reported to the view's owner (a lease marks itself lost). */
  private async refusals<T>(call: Promise<T>): Promise<T> {
    try {
      return await call;
    } catch (e) {
      if ((e instanceof LeaseLostError || e instanceof LockLostError) && this.view.onRefused) this.view.onRefused(e);
      throw e;
    }
  }

  /** Insert-if-absent: `created` false returns the stored run, unchanged. */
  createRun(run: EngineRunInput, opts: WriteOptions = {}): Promise<{ created: boolean; run: EngineRun }> {
    return this.write("createRun", () => ({
      run: create(EngineRunSchema, {
        id: run.id, agent: run.agent, status: run.status, ...opt("concurrencyKey", run.concurrencyKey),
        ...valuesIn(run, "run"),
      }),
      ...fenceIn(opts.fence),
    }), (r: Resp<"createRun">) => ({ created: r.created, run: engineRunFromPb(r.run!) }), opts);
  }

  async getRun(id: string, options: CallOptions = {}): Promise<EngineRun | undefined> {
    const r = await this.read(id, (o, stub) => stub.getRun({ id }, o), options);
    return r.found && r.run ? engineRunFromPb(r.run) : undefined;
  }

  /** Throws InvalidRunStateError when a guard fails, RunNotFoundError for an unknown id. */
  updateRun(id: string, patch: EngineRunPatch, guards: { expectStatus?: string[]; expectOwner?: string } & WriteOptions = {}): Promise<EngineRun> {
    return this.write("updateRun", () => ({
      id,
      patch: create(EngineRunPatchSchema, {
        ...opt("status", patch.status), ...opt("concurrencyKey", patch.concurrencyKey),
        ...valuesIn(patch, "patch"),
        clear: [...(patch.clear ?? [])],
      }),
      expectStatus: [...(guards.expectStatus ?? [])], ...opt("expectOwner", guards.expectOwner),
      ...fenceIn(guards.fence),
    }), (r: Resp<"updateRun">) => engineRunFromPb(r.run!), guards);
  }

  /** Ordered by createdAt then id; `total` ignores limit and offset; no limit returns every match. */
  async listRuns(q: { agent?: string; statuses?: string[]; concurrencyKey?: string; limit?: number; offset?: number } = {}, options: CallOptions = {}): Promise<{ runs: EngineRun[]; total: number }> {
    const req = create(EngineListRunsRequestSchema, {
      ...opt("agent", q.agent), statuses: [...(q.statuses ?? [])], ...opt("concurrencyKey", q.concurrencyKey),
      ...opt("limit", q.limit === undefined ? undefined : toBigInt(q.limit, "limit")),
      offset: toBigInt(q.offset ?? 0, "offset"),
    });
    return this.read(undefined, async (o, stub) => {
      const runs: EngineRun[] = [];
      let total = 0;
      for await (const page of stub.listRuns(req, o)) {
        total = toNumber(page.total);
        for (const r of page.runs) runs.push(engineRunFromPb(r));
      }
      return { runs, total };
    }, options);
  }

  claimRun(id: string, owner: string, ttlMs: number, opts: WriteOptions = {}): Promise<{ claimed: boolean; run: EngineRun | undefined }> {
    return this.write("claimRun", () => ({ id, owner, ttlMs: ttl(ttlMs), ...fenceIn(opts.fence) }),
      (r: Resp<"claimRun">) => ({ claimed: r.claimed, run: r.run ? engineRunFromPb(r.run) : undefined }), opts);
  }

  renewClaim(id: string, owner: string, ttlMs: number, opts: WriteOptions = {}): Promise<{ renewed: boolean; run: EngineRun | undefined }> {
    return this.write("renewClaim", () => ({ id, owner, ttlMs: ttl(ttlMs), ...fenceIn(opts.fence) }),
      (r: Resp<"renewClaim">) => ({ renewed: r.renewed, run: r.run ? engineRunFromPb(r.run) : undefined }), opts);
  }

  appendStep(step: { runId: string; name: string; status?: string; input?: unknown; output?: unknown; error?: unknown; metadata?: unknown }, opts: WriteOptions = {}): Promise<EngineStep> {
    return this.write("appendStep", () => ({
      step: create(EngineStepSchema, {
        runId: step.runId, name: step.name, ...opt("status", step.status),
        ...valuesIn(step, "step"),
      }),
      ...fenceIn(opts.fence),
    }), (r: Resp<"appendStep">) => stepFromPb(r.step!), opts);
  }

  async listSteps(runId: string, options: CallOptions = {}): Promise<EngineStep[]> {
    return this.read(runId, async (o, stub) => {
      const out: EngineStep[] = [];
      for await (const page of stub.listSteps({ runId }, o)) for (const s of page.steps) out.push(stepFromPb(s));
      return out;
    }, options);
  }

  /** Keeps the highest stepIndex; an equal index replaces; a lower one is ignored (saved false). */
  saveCheckpoint(cp: { runId: string; stepIndex: number; state: unknown }, opts: WriteOptions = {}): Promise<{ saved: boolean; checkpoint: EngineCheckpoint }> {
    return this.write("saveCheckpoint", () => {
      const state = jsonIn(cp.state === undefined ? null : cp.state, "checkpoint.state");
      return {
        checkpoint: { runId: cp.runId, stepIndex: toBigInt(cp.stepIndex, "checkpoint.step_index"), ...opt("state", state) },
        ...fenceIn(opts.fence),
      };
    }, (r: Resp<"saveCheckpoint">) => ({ saved: r.saved, checkpoint: checkpointFromPb(r.checkpoint!) }), opts);
  }

  async latestCheckpoint(runId: string, options: CallOptions = {}): Promise<EngineCheckpoint | undefined> {
    const r = await this.read(runId, (o, stub) => stub.latestCheckpoint({ runId }, o), options);
    return r.found && r.checkpoint ? checkpointFromPb(r.checkpoint) : undefined;
  }

  /** The first caller per (scope, key) wins; the others get the winner's runId until the key expires. */
  claimKey(scope: string, key: string, runId: string, ttlMs: number, opts: WriteOptions = {}): Promise<{ created: boolean; runId: string; expiresAt: Date }> {
    return this.write("claimKey", () => ({ scope, key, runId, ttlMs: ttl(ttlMs), ...fenceIn(opts.fence) }),
      (r: Resp<"claimKey">) => ({ created: r.created, runId: r.runId, expiresAt: date(r.expiresAt) }), opts);
  }

  acquireLock(key: string, owner: string, ttlMs: number, opts: WriteOptions = {}): Promise<{ acquired: boolean; fencingToken: number; owner: string; expiresAt: Date }> {
    return this.write("acquireLock", () => ({ key, owner, ttlMs: ttl(ttlMs), ...fenceIn(opts.fence) }),
      (r: Resp<"acquireLock">) => ({ acquired: r.acquired, fencingToken: toNumber(r.fencingToken), owner: r.owner, expiresAt: date(r.expiresAt) }), opts);
  }

  releaseLock(key: string, owner: string, opts: WriteOptions = {}): Promise<boolean> {
    return this.write("releaseLock", () => ({ key, owner, ...fenceIn(opts.fence) }), (r: Resp<"releaseLock">) => r.released, opts);
  }

  async getEffect(key: string, options: CallOptions = {}): Promise<Lookup<unknown>> {
    const r = await this.read(key, (o, stub) => stub.getEffect({ key }, o), options);
    return { found: r.found, value: r.found ? jsonOut(r.result) : undefined, at: r.recordedAt ? date(r.recordedAt) : undefined };
  }

  putEffect(key: string, result: unknown, opts: WriteOptions = {}): Promise<Date> {
    return this.write("putEffect", () => ({
      key, ...opt("result", jsonIn(result === undefined ? null : result, "result")), ...fenceIn(opts.fence),
    }), (r: Resp<"putEffect">) => date(r.recordedAt), opts);
  }

  async kvGet(agent: string, key: string, options: CallOptions = {}): Promise<Lookup<unknown>> {
    const r = await this.read(compound(agent, key), (o, stub) => stub.kvGet({ agent, key }, o), options);
    return { found: r.found, value: r.found ? jsonOut(r.value) : undefined, at: r.updatedAt ? date(r.updatedAt) : undefined };
  }

  kvSet(agent: string, key: string, value: unknown, opts: WriteOptions = {}): Promise<Date> {
    return this.write("kvSet", () => ({
      agent, key, ...opt("value", jsonIn(value === undefined ? null : value, "value")), ...fenceIn(opts.fence),
    }), (r: Resp<"kvSet">) => date(r.updatedAt), opts);
  }

  /** Documents ordered by id whose top-level fields equal every field of `where`. */
  async docList(agent: string, collection: string, q: { where?: Record<string, unknown>; limit?: number } = {}, options: CallOptions = {}): Promise<EngineDoc[]> {
    const where = jsonIn(q.where, "where");
    const limit = q.limit === undefined ? undefined : toBigInt(q.limit, "limit");
    return this.read(compound(agent, collection), async (o, stub) => {
      const out: EngineDoc[] = [];
      for await (const page of stub.docList({ agent, collection, ...opt("where", where), ...opt("limit", limit) }, o)) {
        for (const d of page.docs) out.push(docFromPb(d));
      }
      return out;
    }, options);
  }

  docUpsert(agent: string, collection: string, id: string, doc: Record<string, unknown>, opts: WriteOptions = {}): Promise<{ created: boolean; doc: EngineDoc }> {
    return this.write("docUpsert", () => ({ agent, collection, id, ...opt("doc", jsonIn(doc, "doc")), ...fenceIn(opts.fence) }),
      (r: Resp<"docUpsert">) => ({ created: r.created, doc: docFromPb(r.doc!) }), opts);
  }

  docDelete(agent: string, collection: string, id: string, opts: WriteOptions = {}): Promise<boolean> {
    return this.write("docDelete", () => ({ agent, collection, id, ...fenceIn(opts.fence) }), (r: Resp<"docDelete">) => r.deleted, opts);
  }

  /**
   * Upload an artifact in chunks (insert-if-absent: `created` false keeps the
   * stored one). `data` is a Uint8Array (retried on UNAVAILABLE with the same
   * request id) or an (async) iterable of chunks (one attempt; needs
   * header.sizeBytes).
   */
  async putArtifact(header: ArtifactHeader, data: Uint8Array | Iterable<Uint8Array> | AsyncIterable<Uint8Array>, opts: WriteOptions = {}): Promise<{ created: boolean; artifact: EngineArtifact }> {
    const whole = data instanceof Uint8Array ? data.slice() : undefined;
    const size = whole ? whole.byteLength : header.sizeBytes;
    if (size === undefined) throw new ValidationError("header.size_bytes: required when the data is a stream", { field: "header.size_bytes" });
    if (whole && header.sizeBytes !== undefined && header.sizeBytes !== size) {
      throw new ValidationError(`header.size_bytes: ${header.sizeBytes} but the data has ${size} bytes`, { field: "header.size_bytes" });
    }
    const requestId = newRequestId();
    const h = create(EngineArtifactHeaderSchema, {
      id: header.id, runId: header.runId, name: header.name ?? "", contentType: header.contentType ?? "",
      sizeBytes: toBigInt(size, "header.size_bytes"), ...opt("sha256", header.sha256),
      ...opt("metadata", jsonIn(header.metadata, "header.metadata")),
      ...(opts.fence ? fenceIn(opts.fence) : opt("fence", this.view.fence)), requestId,
    });
    const messages = async function* (): AsyncGenerator<EnginePutArtifactRequest> {
      yield create(EnginePutArtifactRequestSchema, { part: { case: "header", value: h } });
      if (whole) {
        for (let i = 0; i < whole.byteLength; i += ARTIFACT_CHUNK_BYTES) {
          yield create(EnginePutArtifactRequestSchema, { part: { case: "chunk", value: whole.subarray(i, i + ARTIFACT_CHUNK_BYTES) } });
        }
      } else {
        for await (const chunk of data as AsyncIterable<Uint8Array>) {
          for (let i = 0; i < chunk.byteLength; i += ARTIFACT_CHUNK_BYTES) {
            yield create(EnginePutArtifactRequestSchema, { part: { case: "chunk", value: chunk.slice(i, i + ARTIFACT_CHUNK_BYTES) } });
          }
        }
      }
    };
    const policy = whole ? this.retry : { ...this.retry, maxAttempts: 1 };
    const limits: CallOptions = {};
    if (opts.signal) limits.signal = opts.signal;
    if (opts.timeoutMs !== undefined) limits.timeoutMs = opts.timeoutMs;
    const r = await this.refusals(withRetry(policy, true, (o) => this.route(header.runId, (stub) => stub.putArtifact(messages(), o)), limits));
    return { created: r.created, artifact: artifactFromPb(r.artifact!) };
  }

  async getArtifact(id: string, options: CallOptions = {}): Promise<EngineArtifact | undefined> {
    const r = await this.read(undefined, (o, stub) => stub.getArtifact({ id }, o), options);
    return r.found && r.artifact ? artifactFromPb(r.artifact) : undefined;
  }

  /** The artifact's bytes as they stream in, each chunk a plain Uint8Array. Throws RunNotFoundError. */
  async *readArtifactChunks(id: string): AsyncGenerator<Uint8Array> {
    try {
      for await (const m of this.stub.readArtifact({ id })) {
        if (m.chunk.byteLength) yield new Uint8Array(m.chunk);
      }
    } catch (e) {
      throw fromCallError(e);
    }
  }

  /** The whole artifact as one plain Uint8Array. Throws RunNotFoundError for an unknown id. */
  async readArtifact(id: string, options: CallOptions = {}): Promise<Uint8Array> {
    return this.read(undefined, async (o, stub) => {
      const parts: Uint8Array[] = [];
      let n = 0;
      for await (const m of stub.readArtifact({ id }, o)) {
        if (m.chunk.byteLength) { parts.push(m.chunk); n += m.chunk.byteLength; }
      }
      const out = new Uint8Array(n);
      let off = 0;
      for (const p of parts) { out.set(p, off); off += p.byteLength; }
      return out;
    }, options);
  }

  async listArtifacts(runId: string, options: CallOptions = {}): Promise<EngineArtifact[]> {
    return this.read(runId, async (o, stub) => {
      const out: EngineArtifact[] = [];
      for await (const page of stub.listArtifacts({ runId }, o)) for (const a of page.artifacts) out.push(artifactFromPb(a));
      return out;
    }, options);
  }

  /**
   * Delete an artifact, its metadata and bytes; false when there was none.
   * Retried on UNAVAILABLE with one request id; carries `opts.fence` or the
   * view's. Always unary: not part of a transaction.
   */
  async deleteArtifact(id: string, opts: WriteOptions = {}): Promise<boolean> {
    const request = { id, requestId: newRequestId(), ...(opts.fence ? fenceIn(opts.fence) : opt("fence", this.view.fence)) };
    const r = await this.refusals(withRetry(this.retry, true, (o) => this.route(undefined, (stub) => stub.deleteArtifact(request, o))));
    return r.deleted;
  }
}
