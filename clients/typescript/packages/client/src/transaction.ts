// Store transactions: several writes that commit together or not at all
// (docs/FENCING.md).
//
//   const { saved, step } = await lease.transaction((tx) => {
//     tx.putEffect(`${runId}/charge`, receipt);
//     tx.recordCheckpoint(`${runId}/cp`, 3);           // a lease's transaction only
//     return { saved: tx.saveCheckpoint({ runId, stepIndex: 3, state }), step: tx.appendStep({ runId, name: "charge" }) };
//   });
//
// Inside the callback a write is only queued: it is validated as the store
// validates it (bad input throws at once) and returns a QueuedWrite. When the
// callback returns, every queued write goes to the server in one
// Ledger.Transact (over the client's Execute stream when it is up, else
// unary; one request id for all its attempts), which applies them in one
// step of its single writer, each after checking the transaction's fence.
// Any refusal throws and nothing was written; if the callback throws,
// nothing is sent.
import { create } from "@bufbuild/protobuf";
import { ENGINE_COMMANDS, type WriteKind } from "./execute.js";
import { CommandSchema } from "./gen/fencepost/v1/ledger_pb.js";
import type { Fence } from "./gen/fencepost/v1/engine_store_pb.js";
import type { Run as PbRun } from "./gen/fencepost/v1/record_pb.js";
import { RpcError, ValidationError, type LeaseLostError } from "./errors.js";
import { recordFromPb, toBigInt, type RunRecord } from "./records.js";
import type { EngineStoreClient } from "./store.js";

/** The server's limit of commands per transaction. */
export const MAX_TRANSACTION_WRITES = 100;

/** The engine-store writes a transaction offers (reads and artifact uploads are not part of one). */
export type StoreWrite = (typeof ENGINE_COMMANDS)[number];

type Queueing<F> = F extends (...args: infer A) => Promise<infer T> ? (...args: A) => QueuedWrite<T> : never;

/** The store's writes with the store's signatures, each queued: it returns a QueuedWrite of what the store would return. */
export type TransactionWrites = { [K in StoreWrite]: Queueing<EngineStoreClient[K]> };

/**
 * One write queued in a transaction. It is not a promise: the transaction
 * sends nothing until its callback returns, so there is nothing to wait for
 * inside it. Once the transaction committed, `result` is the write's answer.
 */
export class QueuedWrite<T> {
  #answer: { value: T } | undefined;

  /** @internal */
  constructor(
    /** Its place in the transaction, from 0 (a refusal's `commandIndex`). */
    readonly index: number,
    /** The command kind (`saveCheckpoint`, `renew`, ...). */
    readonly kind: WriteKind,
  ) {}

  /** Whether its transaction committed. */
  get committed(): boolean { return this.#answer !== undefined; }

  /** The write's answer; throws until its transaction committed. */
  get result(): T {
    if (!this.#answer) throw new Error(`${this.kind} (commands[${this.index}]): its transaction has not committed`);
    return this.#answer.value;
  }

  /** @internal */
  settle(value: T): void { this.#answer = { value }; }
}

/**
 * What a transaction resolves to: the callback's value with each QueuedWrite
 * in it (alone, or in an array or plain object, at any depth) replaced by
 * its answer.
 */
export type Answered<R> =
  R extends QueuedWrite<infer T> ? T
    : R extends StoreTransaction | Date | Uint8Array | ((...args: never[]) => unknown) ? R
      : R extends readonly unknown[] ? { -readonly [K in keyof R]: Answered<R[K]> }
        : R extends object ? { [K in keyof R]: Answered<R[K]> }
          : R;

function answered(value: unknown): unknown {
  if (value instanceof QueuedWrite) return value.result;
  if (Array.isArray(value)) return value.map(answered);
  if (value !== null && typeof value === "object") {
    const proto = Object.getPrototypeOf(value) as unknown;
    if (proto === Object.prototype || proto === null) {
      return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, answered(v)]));
    }
  }
  return value;
}

/** @internal What a lease's transaction needs from its lease. */
export interface TransactionLease {
  readonly runId: string;
  readonly owner: string;
  readonly fencingToken: number;
  readonly ttlMs: number;
  /** The loss to throw without a round trip, once the lease is known to be lost. */
  knownLoss(): LeaseLostError | undefined;
  /** A renewing answer (renew, recordCheckpoint) this handle sent at `sentAt`. */
  answered(record: RunRecord, sentAt: number, grantedTtlMs: number | undefined): void;
}

type State = "open" | "sending" | "committed" | "failed" | "abandoned";

interface Queued {
  kind: WriteKind;
  request: Record<string, unknown>;
  convert: (response: never) => unknown;
  write: QueuedWrite<unknown>;
}

export interface StoreTransaction extends TransactionWrites {}

/**
 * The `tx` of `store.transaction(fn)` and `lease.transaction(fn)`: the
 * store's writes (createRun, updateRun, claimRun, renewClaim, appendStep,
 * saveCheckpoint, claimKey, acquireLock, releaseLock, putEffect, kvSet,
 * docUpsert, docDelete) with the store's signatures, each queued; for a
 * lease's transaction also `renew` and `recordCheckpoint`. Usable only
 * inside its callback.
 */
export class StoreTransaction {
  #state: State = "open";
  readonly #queued: Queued[] = [];
  #results: unknown[] | undefined;
  #sentAt = 0;
  readonly #lease: TransactionLease | undefined;

  /** @internal — use store.transaction() or lease.transaction(). */
  constructor(store: EngineStoreClient, lease?: TransactionLease) {
    this.#lease = lease;
    const recorder = store.withView({ queue: (kind, request, convert) => this.#add(kind, request, convert) });
    for (const name of ENGINE_COMMANDS) {
      const method = recorder[name] as (...args: unknown[]) => unknown;
      Object.defineProperty(this, name, {
        value: (...args: unknown[]) => {
          this.#checkOpen();
          return method.apply(recorder, args);
        },
      });
    }
  }

  /**
   * @internal Run `fn` with a fresh transaction, then commit what it queued
   * under `fence` through `store` (which reports a refused fence to its owner).
   */
  static async run<R>(
    store: EngineStoreClient, fence: Fence | undefined, lease: TransactionLease | undefined,
    fn: (tx: StoreTransaction) => R | PromiseLike<R>,
  ): Promise<Answered<R>> {
    const tx = new StoreTransaction(store, lease);
    let value: R;
    try {
      value = await fn(tx);
    } catch (e) {
      tx.#state = "abandoned"; // nothing was sent
      throw e;
    }
    await tx.#commit(store, fence);
    return answered(value) as Answered<R>;
  }

  /** How many writes are queued. */
  get size(): number { return this.#queued.length; }

  /** Each write's answer, in the order made (once the transaction committed). */
  get results(): readonly unknown[] {
    if (!this.#results) throw new Error(`the transaction is ${this.#state}: no results`);
    return this.#results;
  }

  /** A lease's transaction: renew the lease (to server-now + ttl; default the lease's ttl). */
  renew(ttlMs?: number): QueuedWrite<RunRecord> {
    const lease = this.#leaseOnly("renew");
    const ttl = ttlMs ?? lease.ttlMs;
    return this.#add("renew", {
      runId: lease.runId, owner: lease.owner, fencingToken: BigInt(lease.fencingToken), leaseTtlMs: toBigInt(ttl, "lease_ttl_ms"),
    }, (r: { run?: PbRun }) => this.#record(r, ttl)) as QueuedWrite<RunRecord>;
  }

  /** A lease's transaction: point the run's record at a checkpoint (renews the lease too). */
  recordCheckpoint(key: string, snapshotVersion: number): QueuedWrite<RunRecord> {
    const lease = this.#leaseOnly("recordCheckpoint");
    return this.#add("recordCheckpoint", {
      runId: lease.runId, owner: lease.owner, fencingToken: BigInt(lease.fencingToken),
      key, snapshotVersion: toBigInt(snapshotVersion, "snapshot_version"),
    }, (r: { run?: PbRun }) => this.#record(r, undefined)) as QueuedWrite<RunRecord>;
  }

  #record(response: { run?: PbRun }, grantedTtlMs: number | undefined): RunRecord {
    const record = recordFromPb(response.run!);
    this.#lease?.answered(record, this.#sentAt, grantedTtlMs);
    return record;
  }

  #leaseOnly(name: string): TransactionLease {
    this.#checkOpen();
    if (!this.#lease) throw new Error(`${name}: only a lease's transaction (lease.transaction()) carries ledger commands`);
    return this.#lease;
  }

  #checkOpen(): void {
    if (this.#state !== "open") {
      throw new Error(`the transaction is ${this.#state}: make its writes inside its callback, before it returns`);
    }
    if (this.#queued.length >= MAX_TRANSACTION_WRITES) {
      throw new ValidationError(`commands: a transaction holds at most ${MAX_TRANSACTION_WRITES} writes`, { field: "commands" });
    }
  }

  #add<R>(kind: WriteKind, request: Record<string, unknown>, convert: (response: R) => unknown): QueuedWrite<unknown> {
    this.#checkOpen();
    const write = new QueuedWrite<unknown>(this.#queued.length, kind);
    this.#queued.push({ kind, request, convert: convert as (response: never) => unknown, write });
    return write;
  }

  async #commit(store: EngineStoreClient, fence: Fence | undefined): Promise<void> {
    this.#state = "failed";
    if (this.#queued.length === 0) {
      this.#results = [];
      this.#state = "committed";
      return;
    }
    const lost = this.#lease?.knownLoss();
    if (lost) throw lost; // known already: no round trip
    this.#state = "sending";
    const commands = this.#queued.map((q, i) =>
      create(CommandSchema, { id: BigInt(i + 1), kind: { case: q.kind, value: q.request } as never }));
    this.#sentAt = performance.now();
    let response;
    try {
      response = await store.transact({ ...(fence ? { fence } : {}), commands });
    } finally {
      this.#state = "failed";
    }
    if (response.results.length !== this.#queued.length) {
      throw new RpcError("INTERNAL", `the transaction answered ${response.results.length} results for ${this.#queued.length} commands`);
    }
    const results = this.#queued.map((q, i) => {
      const r = response.results[i]!;
      if (r.kind.case !== q.kind) throw new RpcError("INTERNAL", `commands[${i}]: answered ${String(r.kind.case)} for ${q.kind}`);
      const value = q.convert(r.kind.value as never);
      q.write.settle(value);
      return value;
    });
    this.#results = results;
    this.#state = "committed";
  }
}
