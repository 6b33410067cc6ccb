// FencepostStore: chamvi's IStore over fencepost's EngineStore service. Every
// operation is one call decided inside the server's single writer, so the
// atomic ones (createRun, claimKey, claimRun, renewClaim, acquire,
// putArtifact) hold across every process.
//
// Time (rule 2). chamvi injects a clock so that tests can drive time and
// replicas agree on one expiry rule. Here the one clock every replica
// shares is the server's: expiry is decided where the write is serialized,
// so no two engine processes can disagree about it, whatever their own
// clocks say. Tests drive it through the server's test clock
// (`fencepost serve --test-hooks`): `store.testClock().advance(ms)` moves
// the server's time forward, and every claim, key and lock expires exactly
// as rule 1 says.
import { jumpClock } from "@fencepost/client/testing";
import {
  FencepostClient,
  InvalidRunStateError,
  RunNotFoundError,
  ValidationError,
  probeServer,
  type ClientOptions,
  type EngineArtifact,
  type EngineRun,
  type EngineRunPatch,
  type EngineStep,
} from "@fencepost/client";
import type { Artifact, Checkpoint, IStore, Run, RunStatusLiteral, Step, TestClock } from "./types.js";

export interface FencepostStoreOptions extends ClientOptions {
  /** Use this client (and its connection) instead of opening one; close() then leaves it open. */
  client?: FencepostClient;
}

const PATCHABLE: Record<string, string> = {
  concurrencyKey: "concurrency_key", input: "input", output: "output", error: "error", metadata: "metadata",
};

const VALUES = ["input", "output", "error", "metadata"] as const;

/** Copy the JSON values that are present (absent ones stay absent). */
function copyValues(to: Partial<Record<(typeof VALUES)[number], unknown>>, from: Partial<Record<(typeof VALUES)[number], unknown>>): void {
  for (const k of VALUES) if (from[k] !== undefined) to[k] = from[k];
}

function runFromEngine(r: EngineRun): Run {
  const run: Run = { id: r.id, agent: r.agent, status: r.status, createdAt: r.createdAt, updatedAt: r.updatedAt };
  if (r.concurrencyKey !== undefined) run.concurrencyKey = r.concurrencyKey;
  copyValues(run, r);
  if (r.claim) run.claim = { owner: r.claim.owner, expiresAt: r.claim.expiresAt };
  return run;
}

function stepFromEngine(s: EngineStep): Step {
  const step: Step = { runId: s.runId, name: s.name, seq: s.seq, createdAt: s.createdAt };
  if (s.status !== undefined) step.status = s.status;
  copyValues(step, s);
  return step;
}

function artifactFromEngine(a: EngineArtifact): Artifact {
  const out: Artifact = { id: a.id, runId: a.runId, size: a.sizeBytes, sha256: a.sha256, createdAt: a.createdAt };
  if (a.name) out.name = a.name;
  if (a.contentType) out.contentType = a.contentType;
  if (a.metadata !== undefined) out.metadata = a.metadata;
  return out;
}

export class FencepostStore implements IStore {
  readonly client: FencepostClient;
  private readonly ownsClient: boolean;

  constructor(address: string | readonly string[], options: FencepostStoreOptions = {}) {
    const { client, ...clientOptions } = options;
    this.client = client ?? new FencepostClient(address, clientOptions);
    this.ownsClient = client === undefined;
  }

  /** Open a store and check the server answers. */
  static async connect(address: string | readonly string[], options: FencepostStoreOptions = {}): Promise<FencepostStore> {
    const store = new FencepostStore(address, options);
    try {
      await probeServer(store.client);
    } catch (e) {
      await store.close();
      throw e;
    }
    return store;
  }

  /** The server's test clock (a server started with --test-hooks): advance(ms) moves every expiry decision's time. */
  testClock(): TestClock {
    return { advance: async (ms: number) => { await jumpClock(this.client, ms); } };
  }

  async close(): Promise<void> {
    if (this.ownsClient) await this.client.close();
  }

  // -- runs ---------------------------------------------------------------------

  async createRun(run: Run): Promise<boolean> {
    if (run.claim !== undefined) {
      throw new ValidationError("run.claim: must be absent on create (claimRun sets it)", { field: "run.claim" });
    }
    const input: Parameters<FencepostClient["store"]["createRun"]>[0] = { id: run.id, agent: run.agent, status: run.status };
    if (run.concurrencyKey !== undefined) input.concurrencyKey = run.concurrencyKey;
    copyValues(input, run);
    return (await this.client.store.createRun(input)).created;
  }

  async getRun(id: string): Promise<Run | undefined> {
    const r = await this.client.store.getRun(id);
    return r ? runFromEngine(r) : undefined;
  }

  /**
   * Apply `patch`: a field set to a value changes it; a field present with
   * the value `undefined` removes it (`claim: undefined` releases the claim).
   * id, agent, createdAt and updatedAt cannot change; a claim can only be
   * removed. Throws InvalidRunStateError when a guard fails, RunNotFoundError
   * for an unknown id.
   */
  async updateRun(id: string, patch: Partial<Run>, opts: { expectStatus?: RunStatusLiteral[]; expectOwner?: string } = {}): Promise<Run> {
    const p: EngineRunPatch = {};
    const clear: string[] = [];
    for (const [key, value] of Object.entries(patch)) {
      if (key === "status") {
        if (value === undefined) throw new ValidationError("patch.status: cannot be removed", { field: "patch.status" });
        p.status = value as string;
      } else if (key in PATCHABLE) {
        if (value === undefined) clear.push(PATCHABLE[key]!);
        else (p as Record<string, unknown>)[key] = value;
      } else if (key === "claim") {
        if (value !== undefined) throw new ValidationError("patch.claim: can only be removed (claimRun and renewClaim set it)", { field: "patch.claim" });
        clear.push("claim");
      } else if (key === "id" || key === "agent") {
        if (value !== undefined && value !== (key === "id" ? id : undefined)) {
          if (key === "id") throw new ValidationError("patch.id: cannot change", { field: "patch.id" });
          const cur = await this.client.store.getRun(id);
          if (cur && cur.agent !== value) throw new ValidationError("patch.agent: cannot change", { field: "patch.agent" });
        }
      } else if (key === "createdAt" || key === "updatedAt") {
        // set by the store
      } else {
        throw new ValidationError(`patch.${key}: not a run field`, { field: `patch.${key}` });
      }
    }
    if (clear.length) p.clear = clear;
    const guards: { expectStatus?: string[]; expectOwner?: string } = {};
    if (opts.expectStatus) guards.expectStatus = opts.expectStatus;
    if (opts.expectOwner !== undefined) guards.expectOwner = opts.expectOwner;
    return runFromEngine(await this.client.store.updateRun(id, p, guards));
  }

  async listRuns(q: { agent?: string; status?: RunStatusLiteral[]; concurrencyKey?: string; limit?: number; offset?: number } = {}): Promise<{ data: Run[]; total: number }> {
    const query: Parameters<FencepostClient["store"]["listRuns"]>[0] = {};
    if (q.agent !== undefined) query.agent = q.agent;
    if (q.status !== undefined) query.statuses = q.status;
    if (q.concurrencyKey !== undefined) query.concurrencyKey = q.concurrencyKey;
    if (q.limit !== undefined) query.limit = q.limit;
    if (q.offset !== undefined) query.offset = q.offset;
    const r = await this.client.store.listRuns(query);
    return { data: r.runs.map(runFromEngine), total: r.total };
  }

  async claimRun(id: string, owner: string, ttlMs: number): Promise<boolean> {
    return (await this.client.store.claimRun(id, owner, ttlMs)).claimed;
  }

  async renewClaim(id: string, owner: string, ttlMs: number): Promise<boolean> {
    return (await this.client.store.renewClaim(id, owner, ttlMs)).renewed;
  }

  // -- steps and checkpoints -------------------------------------------------------

  async appendStep(step: Step): Promise<void> {
    const s: Parameters<FencepostClient["store"]["appendStep"]>[0] = { runId: step.runId, name: step.name };
    if (step.status !== undefined) s.status = step.status;
    copyValues(s, step);
    await this.client.store.appendStep(s);
  }

  async listSteps(runId: string): Promise<Step[]> {
    return (await this.client.store.listSteps(runId)).map(stepFromEngine);
  }

  async saveCheckpoint(cp: Checkpoint): Promise<void> {
    await this.client.store.saveCheckpoint({ runId: cp.runId, stepIndex: cp.stepIndex, state: cp.state === undefined ? null : cp.state });
  }

  async latestCheckpoint(runId: string): Promise<Checkpoint | undefined> {
    const c = await this.client.store.latestCheckpoint(runId);
    return c ? { runId: c.runId, stepIndex: c.stepIndex, state: c.state, savedAt: c.savedAt } : undefined;
  }

  // -- keys, locks, effects ----------------------------------------------------------

  async claimKey(scope: string, key: string, runId: string, ttlMs: number): Promise<{ created: boolean; runId: string }> {
    const r = await this.client.store.claimKey(scope, key, runId, ttlMs);
    return { created: r.created, runId: r.runId };
  }

  async acquire(key: string, owner: string, ttlMs: number): Promise<boolean> {
    return (await this.client.store.acquireLock(key, owner, ttlMs)).acquired;
  }

  async release(key: string, owner: string): Promise<void> {
    await this.client.store.releaseLock(key, owner);
  }

  async getEffect(key: string): Promise<{ result: unknown } | undefined> {
    const r = await this.client.store.getEffect(key);
    return r.found ? { result: r.value } : undefined;
  }

  async putEffect(key: string, result: unknown): Promise<void> {
    await this.client.store.putEffect(key, result === undefined ? null : result);
  }

  // -- state -----------------------------------------------------------------------

  async kvGet(agent: string, key: string): Promise<unknown> {
    const r = await this.client.store.kvGet(agent, key);
    return r.found ? r.value : undefined;
  }

  async kvSet(agent: string, key: string, value: unknown): Promise<void> {
    await this.client.store.kvSet(agent, key, value === undefined ? null : value);
  }

  async docList(agent: string, coll: string, q: { where?: Record<string, unknown>; limit?: number } = {}): Promise<Array<{ id: string; doc: unknown }>> {
    const docs = await this.client.store.docList(agent, coll, q);
    return docs.map((d) => ({ id: d.id, doc: d.doc }));
  }

  async docUpsert(agent: string, coll: string, id: string, doc: unknown): Promise<void> {
    if (doc === null || typeof doc !== "object" || Array.isArray(doc)) {
      throw new ValidationError("doc: must be a JSON object", { field: "doc" });
    }
    await this.client.store.docUpsert(agent, coll, id, doc as Record<string, unknown>);
  }

  async docDelete(agent: string, coll: string, id: string): Promise<void> {
    await this.client.store.docDelete(agent, coll, id);
  }

  // -- artifacts ---------------------------------------------------------------------

  /** Uploads the bytes in chunks; resolves false (keeping the stored artifact) when the id exists. */
  async putArtifact(artifact: Artifact, data: Uint8Array): Promise<boolean> {
    if (!(data instanceof Uint8Array)) throw new ValidationError("data: must be a Uint8Array", { field: "data" });
    const header: Parameters<FencepostClient["store"]["putArtifact"]>[0] = { id: artifact.id, runId: artifact.runId };
    if (artifact.name !== undefined) header.name = artifact.name;
    if (artifact.contentType !== undefined) header.contentType = artifact.contentType;
    if (artifact.metadata !== undefined) header.metadata = artifact.metadata;
    return (await this.client.store.putArtifact(header, data)).created;
  }

  async getArtifact(id: string): Promise<Artifact | undefined> {
    const a = await this.client.store.getArtifact(id);
    return a ? artifactFromEngine(a) : undefined;
  }

  /** The bytes as a plain Uint8Array, read in chunks; undefined for an unknown id. */
  async readArtifact(id: string): Promise<Uint8Array | undefined> {
    try {
      return await this.client.store.readArtifact(id);
    } catch (e) {
      if (e instanceof RunNotFoundError) return undefined;
      throw e;
    }
  }

  /** The bytes chunk by chunk (for artifacts too large to hold at once). */
  readArtifactChunks(id: string): AsyncIterable<Uint8Array> {
    return this.client.store.readArtifactChunks(id);
  }

  /** Upload from a stream of chunks; `artifact.size` (the exact byte count) is required. */
  async putArtifactStream(artifact: Artifact, chunks: AsyncIterable<Uint8Array> | Iterable<Uint8Array>): Promise<boolean> {
    if (artifact.size === undefined) throw new ValidationError("artifact.size: required for a streamed upload", { field: "artifact.size" });
    const header: Parameters<FencepostClient["store"]["putArtifact"]>[0] = { id: artifact.id, runId: artifact.runId, sizeBytes: artifact.size };
    if (artifact.name !== undefined) header.name = artifact.name;
    if (artifact.contentType !== undefined) header.contentType = artifact.contentType;
    if (artifact.metadata !== undefined) header.metadata = artifact.metadata;
    if (artifact.sha256 !== undefined) header.sha256 = artifact.sha256;
    return (await this.client.store.putArtifact(header, chunks)).created;
  }

  async listArtifacts(runId: string): Promise<Artifact[]> {
    return (await this.client.store.listArtifacts(runId)).map(artifactFromEngine);
  }
}

export { InvalidRunStateError, RunNotFoundError };
