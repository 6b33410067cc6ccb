// FencepostMemoryStore: open-multi-agent's MemoryStore over fencepost's
// engine store, so that one server holds run records, checkpoints,
// approvals and shared memory together.
//
// Layout. Each key is one engine-store run record (EngineStore.CreateRun /
// UpdateRun), used as a versioned register:
//   id      "oma-mem/<namespace>/<key>" ("oma-mem/<namespace>/#<sha256>" when that is
//           over 512 bytes or the key holds control characters)
//   agent   "oma-memory/<namespace>"
//   status  "live:<n>" or "gone:<n>": n counts the key's writes, deletes included
//   concurrencyKey "live" while the key is present (so list() skips deleted keys)
//   input   { key }
//   output  { value } for a value up to INLINE_VALUE_BYTES, else
//           { blob, bytes } naming an artifact that holds the value's JSON text
//   metadata { metadata?, createdAt, expiresAtTurn? }
// Every write reads the register and then updates it guarded by
// `expectStatus: [the status it read]` (CreateRun, insert-if-absent, for a
// key never written): the server's single writer refuses it if anything
// wrote the key in between, so compareAndSet is atomic across processes and
// set() never loses createdAt. A large value is uploaded first, in chunks,
// as an immutable artifact; only the small pointer goes through the guard.
//
// Blobs. Once a guarded write has replaced a pointer (overwrite, delete,
// clear), the blob it pointed at is deleted; a write refused for certain
// deletes the blob it uploaded. A crash or a lost connection between the two
// steps leaves that one blob behind. A reader that finds a blob gone reads
// the key again: the key moved on, and it returns the newer value.
import { createHash, randomUUID } from "node:crypto";
import {
  FencepostClient,
  InvalidRunStateError,
  LeaseLostError,
  LockLostError,
  RunNotFoundError,
  ValidationError,
  probeServer,
  type EngineRun,
  type EngineRunPatch,
  type FenceSpec,
} from "@fencepost/client";
import { decodeToken, encodeToken, type ConnectOptions } from "./store.js";

/** An entry as open-multi-agent's MemoryStore returns it. */
export interface MemoryEntry {
  readonly key: string;
  readonly value: string;
  readonly metadata?: Record<string, unknown>;
  /** When the key was first written (kept across overwrites; a delete forgets it). */
  readonly createdAt: Date;
  readonly expiresAtTurn?: number;
}

/** open-multi-agent's MemoryStore seam, with both optional methods. */
export interface MemoryStore {
  get(key: string): Promise<MemoryEntry | null>;
  set(key: string, value: string, metadata?: Record<string, unknown>): Promise<void>;
  compareAndSet?(key: string, expectedValue: string | null, value: string, metadata?: Record<string, unknown>): Promise<boolean>;
  setWithExpiry?(key: string, value: string, expiresAtTurn: number, metadata?: Record<string, unknown>): Promise<void>;
  list(): Promise<MemoryEntry[]>;
  delete(key: string): Promise<void>;
  clear(): Promise<void>;
}

/** The key prefix of open-multi-agent's checkpoints; writes under it may carry a fence. */
export const CHECKPOINT_KEY_PREFIX = "__oma_checkpoint__/";
/** The key prefix of MemoryStoreRunStore's run records. */
export const RUN_KEY_PREFIX = "__oma_run__/";
/** Values up to this many UTF-8 bytes (of their JSON text) are stored inline; larger ones as an artifact. */
export const INLINE_VALUE_BYTES = 64 * 1024;
/** Attempts of one write against concurrent writers of the same key before it gives up with a ConflictError. */
const MAX_ATTEMPTS = 200;
const MAX_ID_BYTES = 512;
const enc = new TextEncoder();

export interface MemoryStoreOptions extends ConnectOptions {
  /** Keeps this store's keys apart from other stores' on the same server (default "default"; 1-200 bytes). */
  namespace?: string;
}

interface Stored { value: string; metadata?: Record<string, unknown>; expiresAtTurn?: number }
type Guard = { id: string; status: string };

/** A blob read after its key moved on (its writer deleted it): read the key again. */
class Moved extends Error {}

function invalid(field: string, message: string): ValidationError {
  return new ValidationError(`${field}: ${message}`, { field });
}

function checkMetadata(metadata: unknown): Record<string, unknown> | undefined {
  if (metadata === undefined) return undefined;
  if (metadata === null || typeof metadata !== "object" || Array.isArray(metadata)) throw invalid("metadata", "must be a plain object");
  try {
    return JSON.parse(JSON.stringify(metadata)) as Record<string, unknown>;
  } catch (e) {
    throw invalid("metadata", `must be JSON: ${String(e)}`);
  }
}

export class FencepostMemoryStore implements MemoryStore {
  /** From the server's Describe (probeServer): every write is decided by its one writer. */
  readonly atomicity: "process" | "cross-process";
  readonly client: FencepostClient;
  readonly namespace: string;
  private readonly agent: string;
  private readonly ownsClient: boolean;

  private constructor(client: FencepostClient, namespace: string, atomicity: "process" | "cross-process", ownsClient: boolean) {
    this.client = client;
    this.namespace = namespace;
    this.agent = `oma-memory/${namespace}`;
    this.atomicity = atomicity;
    this.ownsClient = ownsClient;
  }

  /** Connect with the same options as FencepostClient (passed on unchanged), plus `namespace` and `client`. */
  static async connect(address: string | readonly string[], options: MemoryStoreOptions = {}): Promise<FencepostMemoryStore> {
    const { client: given, namespace = "default", ...clientOptions } = options;
    if (typeof namespace !== "string" || namespace.length === 0 || enc.encode(namespace).byteLength > 200 || /[\u0000-\u001f\u007f/]/.test(namespace)) {
      throw invalid("namespace", "must be 1-200 bytes without control characters or '/'");
    }
    const client = given ?? new FencepostClient(address, clientOptions);
    try {
      const d = await probeServer(client);
      return new FencepostMemoryStore(client, namespace, d.atomicity, given === undefined);
    } catch (e) {
      if (given === undefined) await client.close();
      throw e;
    }
  }

  async get(key: string): Promise<MemoryEntry | null> {
    return this.read(this.idFor(checkKey(key)), (run) => this.entryOf(run));
  }

  /**
   * Upsert. `createdAt` is kept when the key exists; `expiresAtTurn` is dropped.
   * A checkpoint key whose metadata carries `fencingToken` is fenced (see fenceFor).
   */
  async set(key: string, value: string, metadata?: Record<string, unknown>): Promise<void> {
    await this.write(checkKey(key), { value: checkValue(value), ...opt("metadata", checkMetadata(metadata)) }, undefined);
  }

  async setWithExpiry(key: string, value: string, expiresAtTurn: number, metadata?: Record<string, unknown>): Promise<void> {
    if (typeof expiresAtTurn !== "number" || !Number.isFinite(expiresAtTurn)) throw invalid("expiresAtTurn", "must be a finite number");
    await this.write(checkKey(key), { value: checkValue(value), ...opt("metadata", checkMetadata(metadata)), expiresAtTurn }, undefined);
  }

  /**
   * Write `value` only if the key's current value is `expectedValue` (null:
   * only if the key is absent). Atomic across every process on the server.
   */
  async compareAndSet(key: string, expectedValue: string | null, value: string, metadata?: Record<string, unknown>): Promise<boolean> {
    if (expectedValue !== null && typeof expectedValue !== "string") throw invalid("expectedValue", "must be a string or null");
    return this.write(checkKey(key), { value: checkValue(value), ...opt("metadata", checkMetadata(metadata)) }, expectedValue);
  }

  /** Every present entry, in key order (by UTF-16 code units, as `[...keys].sort()`). */
  async list(): Promise<MemoryEntry[]> {
    const { runs } = await this.client.store.listRuns({ agent: this.agent, concurrencyKey: "live" });
    const entries = await Promise.all(runs.filter(isLive).map((r) => this.entryOf(r).catch((e: unknown) => {
      if (!(e instanceof Moved)) throw e;
      return this.read(r.id, (run) => this.entryOf(run)); // overwritten (or deleted) since the listing
    })));
    return entries.filter((e): e is MemoryEntry => e !== null).sort((a, b) => (a.key < b.key ? -1 : a.key > b.key ? 1 : 0));
  }

  async delete(key: string): Promise<void> {
    await this.write(checkKey(key), null, undefined);
  }

  /** Deletes every present entry, each as delete() would (not one atomic step). */
  async clear(): Promise<void> {
    const { runs } = await this.client.store.listRuns({ agent: this.agent, concurrencyKey: "live" });
    await Promise.all(runs.filter(isLive).map((r) => this.write(keyOf(r), null, undefined)));
  }

  /**
   * A view of this store that stamps `runId` and `fencingToken` into the
   * metadata of every checkpoint write, so open-multi-agent's own checkpoint
   * saves are fenced without any change to it.
   */
  fencedFor(runId: string, fencingToken: number): MemoryStore {
    const stamp = (key: string, m?: Record<string, unknown>) =>
      key.startsWith(CHECKPOINT_KEY_PREFIX) ? { ...m, runId, fencingToken } : m;
    return {
      get: (k) => this.get(k),
      set: (k, v, m) => this.set(k, v, stamp(k, m)),
      compareAndSet: (k, e, v, m) => this.compareAndSet(k, e, v, stamp(k, m)),
      setWithExpiry: (k, v, t, m) => this.setWithExpiry(k, v, t, stamp(k, m)),
      list: () => this.list(),
      delete: (k) => this.delete(k),
      clear: () => this.clear(),
    };
  }

  /** Close the connection (when this store opened it). */
  async close(): Promise<void> {
    if (this.ownsClient) await this.client.close();
  }

  // -- internals -------------------------------------------------------------

  private idFor(key: string): string {
    const plain = `oma-mem/${this.namespace}/${key}`;
    if (enc.encode(plain).byteLength <= MAX_ID_BYTES && !/[\u0000-\u001f\u007f]/.test(plain)) return plain;
    return `oma-mem/${this.namespace}/#${createHash("sha256").update(key).digest("hex")}`;
  }

  private async entryOf(run: EngineRun): Promise<MemoryEntry> {
    const meta = (run.metadata ?? {}) as { metadata?: Record<string, unknown>; createdAt?: string; expiresAtTurn?: number };
    const entry: { -readonly [K in keyof MemoryEntry]: MemoryEntry[K] } = {
      key: keyOf(run), value: await this.valueOf(run), createdAt: new Date(meta.createdAt ?? run.createdAt),
    };
    if (meta.metadata !== undefined) entry.metadata = meta.metadata;
    if (meta.expiresAtTurn !== undefined) entry.expiresAtTurn = meta.expiresAtTurn;
    return entry;
  }

  /** The value; throws Moved when its blob was deleted because another write replaced it. */
  private async valueOf(run: EngineRun): Promise<string> {
    const blob = blobOf(run);
    if (blob === undefined) return (run.output as { value?: string } | undefined)?.value ?? "";
    let bytes: Uint8Array;
    try {
      bytes = await this.client.store.readArtifact(blob);
    } catch (e) {
      if (e instanceof RunNotFoundError) throw new Moved(blob);
      throw e;
    }
    return JSON.parse(new TextDecoder().decode(bytes)) as string;
  }

  /** `use` of the register `id` when live (null when not), read again while its blob moves away under it. */
  private async read<T>(id: string, use: (run: EngineRun) => Promise<T>): Promise<T | null> {
    let last: EngineRun | undefined;
    for (let attempt = 0; attempt < MAX_ATTEMPTS; attempt++) {
      const run = await this.client.store.getRun(id);
      if (!run || !isLive(run)) return null;
      if (last && run.status === last.status) throw new RunNotFoundError(`${id}: its value's artifact ${blobOf(run)} is missing`);
      try {
        return await use(run);
      } catch (e) {
        if (!(e instanceof Moved)) throw e;
        last = run;
      }
    }
    throw new InvalidRunStateError(`${id}: ${MAX_ATTEMPTS} reads each overtaken by a write of the key`);
  }

  /** Delete a blob nothing points at any more; a failure leaves it behind (best effort). */
  private async dropBlob(blob: string | undefined): Promise<void> {
    if (blob === undefined) return;
    try {
      await this.client.store.deleteArtifact(blob);
    } catch {
      // the write itself succeeded or failed already; an unreachable server keeps this one blob
    }
  }

  /** The value as the register's output: inline, or uploaded first as an artifact. */
  private async outputFor(value: string, fence: FenceSpec | Guard | undefined): Promise<unknown> {
    const text = JSON.stringify(value);
    const bytes = enc.encode(text);
    if (bytes.byteLength <= INLINE_VALUE_BYTES) return { value };
    const blob = `oma-mem-blob/${this.namespace}/${randomUUID()}`;
    // A stale holder's upload is refused at its header, before any bytes move.
    const opts = fence && "fencingToken" in fence ? { fence } : {};
    await this.client.store.putArtifact({ id: blob, runId: this.agent, contentType: "application/json" }, bytes, opts);
    return { blob, bytes: bytes.byteLength };
  }

  /**
   * One guarded write (next null: delete). `expected` undefined: unconditional;
   * a string or null: compareAndSet. Retries while other writers get in between.
   */
  private async write(key: string, next: Stored | null, expected: string | null | undefined): Promise<boolean> {
    const fencing = next !== null && key.startsWith(CHECKPOINT_KEY_PREFIX) ? fencingOf(next.metadata) : undefined;
    const uploaded: { output?: unknown } = {};
    let done: boolean;
    try {
      done = await this.attempts(key, next, expected, fencing, uploaded);
    } catch (e) {
      // Refused for certain: our blob was never pointed at. Otherwise (an
      // unknown outcome) it may be the key's value now, and is kept.
      if (e instanceof InvalidRunStateError || e instanceof LeaseLostError || e instanceof LockLostError
        || e instanceof RunNotFoundError || e instanceof ValidationError) await this.dropBlob(outputBlob(uploaded.output));
      throw e;
    }
    if (!done) await this.dropBlob(outputBlob(uploaded.output));
    return done;
  }

  private async attempts(
    key: string, next: Stored | null, expected: string | null | undefined,
    fencing: { runId: string; token: number } | undefined, uploaded: { output?: unknown },
  ): Promise<boolean> {
    const id = this.idFor(key);
    for (let attempt = 0; attempt < MAX_ATTEMPTS; attempt++) {
      const cur = await this.client.store.getRun(id);
      const live = cur !== undefined && isLive(cur);
      if (expected === null && live) return false;
      if (typeof expected === "string") {
        let same: boolean;
        try {
          same = live && (await this.valueOf(cur!)) === expected;
        } catch (e) {
          if (e instanceof Moved) continue; // the key moved on since we read it
          throw e;
        }
        if (!same) return false;
      }
      if (next === null && !live) return true;
      const fence = fencing ? await this.fenceFor(fencing.runId, fencing.token) : undefined;
      const n = cur ? Number(cur.status.slice(5)) + 1 : 1;
      let patch: EngineRunPatch;
      if (next === null) {
        patch = { status: `gone:${n}`, clear: ["concurrency_key", "output", "metadata"] };
      } else {
        uploaded.output ??= await this.outputFor(next.value, fence);
        const output = uploaded.output;
        const createdAt = live ? ((cur!.metadata as { createdAt?: string } | undefined)?.createdAt ?? cur!.createdAt.toISOString()) : new Date().toISOString();
        patch = {
          status: `live:${n}`, concurrencyKey: "live", input: { key }, output,
          metadata: { ...opt("metadata", next.metadata), createdAt, ...opt("expiresAtTurn", next.expiresAtTurn) },
        };
      }
      try {
        if (await this.apply(id, cur, patch, fence)) {
          const old = cur ? blobOf(cur) : undefined;
          if (old !== outputBlob(uploaded.output)) await this.dropBlob(old); // superseded: nothing points at it
          return true;
        }
      } catch (e) {
        if (!(e instanceof InvalidRunStateError)) throw e;
      }
      await backoff(attempt);
    }
    throw new InvalidRunStateError(`${key}: ${MAX_ATTEMPTS} attempts each lost to another writer of the key`);
  }

  /** Apply a patch guarded by the status read; false when another writer got in first. */
  private async apply(id: string, cur: EngineRun | undefined, patch: EngineRunPatch, fence: FenceSpec | Guard | undefined): Promise<boolean> {
    const ledger = fence && "fencingToken" in fence ? fence : undefined;
    const guard = fence && "status" in fence ? fence : undefined;
    const opts = ledger ? { fence: ledger } : {};
    const fresh = { id, agent: this.agent, status: patch.status!, concurrencyKey: "live", input: patch.input, output: patch.output, metadata: patch.metadata };
    if (!guard) {
      if (!cur) return (await this.client.store.createRun(fresh, opts)).created;
      await this.client.store.updateRun(id, patch, { expectStatus: [cur.status], ...opts });
      return true;
    }
    // The run record lives in this store: hold its register still while writing.
    const r = await this.client.store.transaction((tx) => {
      tx.updateRun(guard.id, { status: guard.status }, { expectStatus: [guard.status] });
      return cur
        ? tx.updateRun(id, patch, { expectStatus: [cur.status] })
        : tx.createRun(fresh);
    });
    return "created" in r ? r.created : true;
  }

  /**
   * The fence of a checkpoint write carrying `fencingToken` for `runId`:
   * the server's own fence when the run is in fencepost's ledger
   * (FencepostRunStore), else a guard on its record in this store
   * (MemoryStoreRunStore). Throws LeaseLostError when the token is not the
   * run's current one, RunNotFoundError when there is no such run.
   */
  private async fenceFor(runId: string, token: number): Promise<FenceSpec | Guard> {
    // the ledger's GetRun, not the raw seam's Get: a worker's role may call it
    const r = await this.client.read((o, stubs) => stubs.ledger.getRun({ runId }, o), {}, runId).catch((e: unknown) => {
      if (e instanceof RunNotFoundError) return undefined;
      throw e;
    });
    if (r?.run) {
      const epoch = decodeToken(r.run.fencingToken)[0];
      return { runId, fencingToken: Number(encodeToken(epoch, token)) };
    }
    const found = await this.read(this.idFor(RUN_KEY_PREFIX + runId), async (run) => ({ rec: run, text: await this.valueOf(run) }));
    if (!found) throw new RunNotFoundError(`metadata.runId: run ${runId} has no record to fence on`, { field: "metadata.runId" });
    const { rec } = found;
    const record = JSON.parse(found.text) as { fencingToken?: number; status?: string; lease?: unknown };
    if (record.fencingToken !== token || record.status !== "running" || record.lease === undefined) {
      throw new LeaseLostError(
        `checkpoint of run ${runId} at fencing token ${token} refused: the run is ${record.status} at token ${record.fencingToken}; nothing was written`,
      );
    }
    return { id: rec.id, status: rec.status };
  }
}

function checkKey(key: unknown): string {
  if (typeof key !== "string") throw invalid("key", "must be a string");
  return key;
}

function checkValue(value: unknown): string {
  if (typeof value !== "string") throw invalid("value", "must be a string");
  return value;
}

function fencingOf(metadata: Record<string, unknown> | undefined): { runId: string; token: number } | undefined {
  if (metadata?.["fencingToken"] === undefined) return undefined;
  const token = metadata["fencingToken"];
  const runId = metadata["runId"];
  if (typeof token !== "number" || !Number.isInteger(token) || token < 1 || token >= 2 ** 32) {
    throw invalid("metadata.fencingToken", "must be an integer in 1 - 2^32-1 (the run record's fencingToken)");
  }
  if (typeof runId !== "string" || runId.length === 0) throw invalid("metadata.runId", "must name the run whose fencingToken is given");
  return { runId, token };
}

function outputBlob(output: unknown): string | undefined {
  return (output as { blob?: string } | undefined)?.blob;
}

function blobOf(run: EngineRun): string | undefined {
  return outputBlob(run.output);
}

function isLive(run: EngineRun): boolean {
  return run.status.startsWith("live:");
}

function keyOf(run: EngineRun): string {
  return (run.input as { key: string }).key;
}

function opt<K extends string, V>(k: K, v: V | undefined): { [P in K]?: V } {
  return (v === undefined ? {} : { [k]: v }) as { [P in K]?: V };
}

/** A short jittered pause after losing a race, so that writers of one key do not retry in lockstep. */
function backoff(attempt: number): Promise<void> {
  return new Promise((r) => setTimeout(r, Math.random() * Math.min(50, 2 ** attempt)));
}
