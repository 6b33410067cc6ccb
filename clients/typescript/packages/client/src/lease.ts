// A Lease: the capability a worker holds while it owns a run. It renews over
// the client's shared KeepAlive stream, learns of loss from the server's
// push, keeps a safe-until deadline on the local monotonic clock
// (performance.now()), and exposes both as an AbortSignal.
import { LeaseAtRiskError, LeaseLostError, fromCallError, type FencepostError, type LockLostError } from "./errors.js";
import type { FenceListener } from "./keepalive.js";
import { deriveLostReason, type LostReason, type Outcome, type RunRecord, type RunStatus } from "./records.js";
import type { EngineStoreClient } from "./store.js";
import type { CallOptions } from "./client.js";
import { StoreTransaction, type Answered, type TransactionLease } from "./transaction.js";

/** What a Lease needs from its client (kept narrow so the client stays the only RPC user). */
export interface LeaseHost {
  fenced(
    kind: "renew" | "recordCheckpoint" | "suspend" | "finish" | "release",
    lease: Lease,
    extra: Record<string, unknown>,
    options: CallOptions,
  ): Promise<RunRecord>;
  /** The client's engine store with every write fenced by `lease`, refusals reported to it. */
  fencedStore(lease: Lease): EngineStoreClient;
  startRenewing(lease: Lease, listener: FenceListener): void;
  /** `untrack` false: the lease's own finish, release or suspend ended the server's tracking. */
  stopRenewing(lease: Lease, listener: FenceListener, untrack?: boolean): void;
}

export class Lease implements TransactionLease, AsyncDisposable {
  readonly runId: string;
  readonly owner: string;
  readonly fencingToken: number;
  private _record: RunRecord;
  private _ttlMs: number;
  private _safeUntil: number;
  private _expiring = false;
  private _lost: LeaseLostError | undefined;
  private _done = false;
  private riskTimer: NodeJS.Timeout | undefined;
  private readonly controller = new AbortController();
  private readonly guards = new Set<AbortController>();
  private resolveLost!: (e: LeaseLostError) => void;
  /** Resolves with the loss (never rejects) when the lease is lost. */
  readonly lost: Promise<LeaseLostError>;
  private readonly listener: FenceListener;
  private _fenced: EngineStoreClient | undefined;

  /** @internal — use FencepostClient.acquire(). */
  constructor(private readonly host: LeaseHost, record: RunRecord, ttlMs: number, sentAt: number) {
    if (!record.lease) throw new TypeError("an acquired run has a lease");
    this.runId = record.runId;
    this.owner = record.lease.owner;
    this.fencingToken = record.fencingToken;
    this._record = record;
    this._ttlMs = ttlMs;
    // The server granted ttl from its now, which is after we sent: conservative.
    this._safeUntil = sentAt + ttlMs;
    this.lost = new Promise((resolve) => { this.resolveLost = resolve; });
    this.listener = {
      renewed: (sent, remaining) => this.renewedAt(sent, remaining),
      lost: (reason, rec) => this.markLost(reason, rec),
      expiring: () => { this._expiring = true; this.updateRisk(); },
      // A renewal the server refuses because the run is gone or finished: the fence is gone too.
      error: (code) => {
        if (code === "RUN_LEASE_LOST" || code === "RUN_NOT_FOUND" || code === "RUN_ALREADY_TERMINAL") {
          this.markLost(undefined, undefined);
        }
      },
    };
    this.armRiskTimer();
    host.startRenewing(this, this.listener);
  }

  /** This lease's fence, for engine-store writes that must commit only while it holds ({ fence: lease.fence }). */
  get fence(): { runId: string; fencingToken: number } { return { runId: this.runId, fencingToken: this.fencingToken }; }

  /**
   * The client's engine store with every write fenced by this lease: each
   * commits only while this lease's token is the run's current one, checked
   * by the server in the same step as the write. After a takeover (or a
   * cancel, delete, finish) a write throws LeaseLostError, writes nothing,
   * and marks this lease lost. Reads are unchanged.
   */
  fenced(): EngineStoreClient {
    this._fenced ??= this.host.fencedStore(this);
    return this._fenced;
  }

  /**
   * Writes that commit together, under this lease's fence, or not at all:
   * the store writes `fn` makes on `tx` (and `tx.renew()`,
   * `tx.recordCheckpoint()`) are queued, and sent as one Ledger.Transact
   * when `fn` returns. Resolves to what `fn` returned, each QueuedWrite in it
   * replaced by its answer (`tx.results` has them all, in order). A stale
   * fence throws LeaseLostError (and marks this lease lost), any other
   * refusal its error; either way nothing of it was written. If `fn` throws,
   * nothing is sent; once this lease is known to be lost, nothing is sent either.
   */
  transaction<R>(fn: (tx: StoreTransaction) => R | PromiseLike<R>): Promise<Answered<R>> {
    const store = this.fenced();
    return StoreTransaction.run(store, store.viewFence, this, fn);
  }

  /** The latest record this handle has seen. */
  get record(): RunRecord { return this._record; }
  /** The ttl background renewals ask for. */
  get ttlMs(): number { return this._ttlMs; }
  /** True once the server told us the fence moved (or a fenced call was refused for it). */
  get isLost(): boolean { return this._lost !== undefined && !(this._lost instanceof LeaseAtRiskError); }
  get lostReason(): LostReason | undefined { return this.isLost ? this._lost?.reason : undefined; }
  /** Neither lost nor given up (finished, suspended, released). */
  get isActive(): boolean { return !this.isLost && !this._done; }
  /**
   * Until when this process may assume it holds the lease, as a
   * performance.now() reading (ms): the send time of the latest answered
   * renewal plus the ttl the server granted. -Infinity once lost or given up.
   */
  get safeUntil(): number { return this.isActive ? this._safeUntil : Number.NEGATIVE_INFINITY; }
  /** Past safe-until, or the server said the lease is expiring: stop side effects. */
  get atRisk(): boolean {
    return !this.isActive || this._expiring || performance.now() >= this._safeUntil;
  }
  /**
   * Aborted (with a LeaseLostError or LeaseAtRiskError as its reason) the
   * first time the lease is lost or at risk. Pass it to anything that must
   * stop when this worker may no longer own the run.
   */
  get signal(): AbortSignal { return this.controller.signal; }

  /**
   * A fresh AbortSignal for one block of work: aborted at once when the lease
   * is already lost or at risk, else when it becomes so. The TypeScript form
   * of the Python SDK's guard().
   */
  guard(): AbortSignal {
    const c = new AbortController();
    if (this.atRisk) c.abort(this.riskError());
    else this.guards.add(c);
    return c.signal;
  }

  /** Throws LeaseLostError / LeaseAtRiskError unless the lease is safe right now. */
  check(): void {
    if (this.atRisk) throw this.riskError();
  }

  /** Renew now; a new ttl also becomes the one background renewals ask for. */
  async renew(ttlMs?: number, options: CallOptions = {}): Promise<RunRecord> {
    const rec = await this.call("renew", ttlMs === undefined ? {} : { leaseTtlMs: BigInt(ttlMs) }, options, true);
    if (ttlMs !== undefined && ttlMs !== this._ttlMs) {
      this._ttlMs = ttlMs;
      if (this.isActive) this.host.startRenewing(this, this.listener);
    }
    return rec;
  }

  recordCheckpoint(key: string, snapshotVersion: number, options: CallOptions = {}): Promise<RunRecord> {
    return this.call("recordCheckpoint", { key, snapshotVersion: BigInt(snapshotVersion) }, options, true);
  }

  async suspend(pendingApprovalIds: string[] = [], options: CallOptions = {}): Promise<RunRecord> {
    const r = await this.call("suspend", { pendingApprovalIds }, options);
    this.markDone();
    return r;
  }

  async finish(status: Extract<RunStatus, "completed" | "failed" | "cancelled"> = "completed", outcome?: Outcome, options: CallOptions = {}): Promise<RunRecord> {
    const r = await this.call("finish", { status, outcome }, options);
    this.markDone();
    return r;
  }

  async release(options: CallOptions = {}): Promise<RunRecord> {
    const r = await this.call("release", {}, options);
    this.markDone();
    return r;
  }

  /**
   * `await using lease = await client.acquire(...)`: leaving the block
   * releases the lease unless it was finished, suspended, released or lost.
   */
  async [Symbol.asyncDispose](): Promise<void> {
    if (!this.isActive) return;
    try {
      await this.release();
    } catch (e) {
      if (!(e instanceof LeaseLostError)) throw e; // lost meanwhile: nothing left to give up
    }
  }

  private async call(kind: Parameters<LeaseHost["fenced"]>[0], extra: Record<string, unknown>, options: CallOptions, renews = false): Promise<RunRecord> {
    if (this.isLost) throw this._lost;
    const sentAt = performance.now();
    try {
      const rec = await this.host.fenced(kind, this, extra, options);
      if (renews) this.answered(rec, sentAt, typeof extra["leaseTtlMs"] === "bigint" ? Number(extra["leaseTtlMs"]) : undefined);
      else this._record = rec;
      return rec;
    } catch (e) {
      const err: FencepostError = fromCallError(e);
      if (err instanceof LeaseLostError) this.fenceRefused(err);
      throw err;
    }
  }

  /** @internal A renewing answer (renew, recordCheckpoint) to a call sent at `sentAt`. */
  answered(record: RunRecord, sentAt: number, grantedTtlMs: number | undefined): void {
    this._record = record;
    if (record.lease) this.renewedAt(sentAt, grantedTtlMs ?? (record.lease.ttlMs || this._ttlMs));
  }

  /** @internal The loss a fenced call would end with, once it is known. */
  knownLoss(): LeaseLostError | undefined {
    return this.isLost ? this._lost : undefined;
  }

  /**
   * @internal A fenced call or write was refused: RUN_LEASE_LOST for this run
   * means the lease is lost (unless this handle gave it up itself), with the
   * reason judged from the record the server refused with.
   */
  fenceRefused(err: LeaseLostError | LockLostError): void {
    if (!(err instanceof LeaseLostError) || err instanceof LeaseAtRiskError) return;
    const rec = err.record;
    if (rec && rec.runId !== this.runId) return;
    // the server's push may have told this handle already: then its reason is the one
    const reason = err.reason ?? this.lostReason ?? deriveLostReason(rec, this.fencingToken);
    (err as { reason: LostReason | undefined }).reason = reason;
    if (this.isActive) this.markLost(reason, rec, err);
  }

  private riskError(): LeaseLostError {
    if (this._lost) return this._lost;
    if (this._done) return new LeaseLostError(`the lease on ${this.runId} was given up`, { record: this._record });
    return new LeaseAtRiskError(
      this._expiring
        ? `the lease on ${this.runId} is expiring: another owner may take it`
        : `the lease on ${this.runId} is past its safe-until deadline`,
      { record: this._record },
    );
  }

  private renewedAt(sentAt: number, ttlRemainingMs: number): void {
    const until = sentAt + ttlRemainingMs;
    if (until > this._safeUntil) this._safeUntil = until;
    this._expiring = false;
    this.armRiskTimer();
  }

  private armRiskTimer(): void {
    if (this.riskTimer) clearTimeout(this.riskTimer);
    this.riskTimer = undefined;
    if (!this.isActive) return;
    const wait = this._safeUntil - performance.now();
    if (wait <= 0) return this.updateRisk();
    this.riskTimer = setTimeout(() => this.updateRisk(), wait + 1);
    this.riskTimer.unref();
  }

  private updateRisk(): void {
    if (this.atRisk) this.fire(this.riskError());
    else this.armRiskTimer();
  }

  private fire(err: LeaseLostError): void {
    if (!this.controller.signal.aborted) this.controller.abort(err);
    for (const g of this.guards) g.abort(err);
    this.guards.clear();
  }

  /** @internal */
  markLost(reason: LostReason | undefined, record: RunRecord | undefined, from?: LeaseLostError): void {
    if (this.isLost || this._done) return;
    if (record) this._record = record;
    const options: ConstructorParameters<typeof LeaseLostError>[1] = {};
    if (record) options.record = record;
    if (reason) options.reason = reason;
    const err = from ?? new LeaseLostError(`the lease on ${this.runId} at token ${this.fencingToken} was lost (${reason ?? "fence moved"})`, options);
    this._lost = err;
    if (this.riskTimer) clearTimeout(this.riskTimer);
    this.host.stopRenewing(this, this.listener);
    this.fire(err);
    this.resolveLost(err);
  }

  private markDone(): void {
    if (this._done) return;
    this._done = true;
    if (this.riskTimer) clearTimeout(this.riskTimer);
    this.host.stopRenewing(this, this.listener, false);
    this.fire(this.riskError());
  }
}
