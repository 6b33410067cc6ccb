// The one KeepAlive stream a client shares among all its leases and fence
// watches (docs/STREAMS.md): hello, batched renewals at a third of the ttl,
// `track` for fences watched without renewing, pushed `lost` / `expiring`,
// and a reconnect with jittered backoff that renews every lease due or with
// a renewal unanswered and tracks the rest (a dropped stream revokes
// nothing: leases live by their ttl).
import { randomBytes } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { timestampMs } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, type Client } from "@connectrpc/connect";
import {
  KeepAliveRenewSchema,
  KeepAliveTrackSchema,
  KeepAliveUntrackSchema,
  KeepAliveRequestSchema,
  type KeepAliveRequest,
  type KeepAliveResponse,
  type Ledger,
} from "./gen/fencepost/v1/ledger_pb.js";
import { AsyncQueue } from "./queue.js";
import { errorFor, fromCallError, NotOwnerError, PermissionDeniedError, UnauthenticatedError } from "./errors.js";
import { lostReasonFromPb, recordFromPb, type LostReason, type RunRecord } from "./records.js";
import { backoffDelays, retryPolicy, sleep } from "./retry.js";

/** What a watcher of one run's fence hears. */
export interface FenceListener {
  /** A renewal was committed: `sentAt` (performance.now() when sent) + `ttlRemainingMs` is the new safe-until. */
  renewed?(sentAt: number, ttlRemainingMs: number, expiresAt: Date): void;
  /** The fence moved away from the watched token; final. `record` is absent when the run was deleted. */
  lost(reason: LostReason, record: RunRecord | undefined): void;
  /** The lease passed its expiry with no renewal; another owner may take it any moment. */
  expiring?(expiresAt: Date): void;
  /** A per-run failure the server reported on the stream (validation, not found...). */
  error?(code: string, message: string): void;
}

/** A lease or watch whose coordinator no longer leads its shard, to be tracked at the owner. */
export interface MovedLease {
  token: bigint;
  renewTtlMs: number | undefined;
  listeners: Set<FenceListener>;
  /** How many times in a row it was moved without an answered renewal. */
  moves: number;
}

interface Entry {
  token: bigint;
  /** Moves to another coordinator since its last answered renewal. */
  moves: number;
  /** ttl for renewals; undefined: track only (never renew). */
  renewTtlMs: number | undefined;
  dueAt: number;
  /** performance.now() of renewals sent on the current stream, oldest first. */
  sent: number[];
  listeners: Set<FenceListener>;
}

export class KeepAliveSession {
  private entries = new Map<string, Entry>();
  private queue: AsyncQueue<KeepAliveRequest> | undefined;
  private abort = new AbortController();
  /** Ends the open stream alone (a coordinator that stopped answering it). */
  private streamAbort: AbortController | undefined;
  private running = false;
  private timer: NodeJS.Timeout | undefined;
  private closed = false;
  /** How many times the stream was (re)opened; for tests and metrics. */
  connects = 0;
  /** Messages written on the stream (hello, renewals, track, untrack); for tests. */
  messages = 0;
  // Each stream's name (KeepAliveHello.stream_name): this client's prefix and
  // the stream's number, so that an acquire names the very stream it saw open.
  private readonly namePrefix = randomBytes(12).toString("hex");
  private name = "";

  /**
   * Renew every lease when the stream reopens, not only those due (routing):
   * the coordinator may no longer lead a lease's shard, which a renewal learns.
   */
  renewAllOnReconnect = false;
  /** Called (routing) when a renewal is refused with NOT_OWNER: the entry has left this stream. */
  onNotOwner: ((runId: string, moved: MovedLease, err: NotOwnerError) => void) | undefined;
  /** Called (routing) when the stream failed: its coordinator may be gone, its shards led elsewhere. */
  onDown: (() => void) | undefined;

  /** The runs this stream renews or watches. */
  runIds(): string[] { return [...this.entries.keys()]; }

  /** Take `runId` off this stream (to be adopted by another). */
  take(runId: string): MovedLease | undefined {
    const e = this.entries.get(runId);
    if (!e) return undefined;
    this.entries.delete(runId);
    this.send({ kind: { case: "untrack", value: create(KeepAliveUntrackSchema, { runId }) } });
    return { token: e.token, renewTtlMs: e.renewTtlMs, listeners: e.listeners, moves: e.moves };
  }

  constructor(private readonly ledger: Client<typeof Ledger>, readonly owner: string) {}

  /** Whether this stream renews or watches `runId`. */
  holds(runId: string): boolean { return this.entries.has(runId); }

  /**
   * Take over a lease or watch refused elsewhere: track it here and renew it
   * after `delayMs` (the refused renewal renewed nothing).
   */
  adopt(runId: string, moved: MovedLease, delayMs = 0): void {
    if (this.closed) return;
    const known = this.entries.get(runId);
    let e = known;
    if (!e || e.token !== moved.token) {
      e = { token: moved.token, moves: 0, renewTtlMs: undefined, dueAt: Number.POSITIVE_INFINITY, sent: [], listeners: new Set() };
      this.entries.set(runId, e);
    }
    for (const l of moved.listeners) e.listeners.add(l);
    e.moves = moved.moves + 1;
    if (moved.renewTtlMs !== undefined) {
      e.renewTtlMs = moved.renewTtlMs;
      e.dueAt = performance.now() + delayMs;
    }
    this.ensureRunning();
    this.trackIfNew(runId, moved.token, known, "");
    this.schedule();
  }

  /** The open stream's name, for AcquireRequest.track_on ("" while none is open). */
  get streamName(): string { return this.name; }

  /**
   * Renew `runId` at `token` every ttl/3 over the shared stream (and watch its
   * fence from now on). `trackedOn`: the acquire's answer said the server
   * already tracks it on the stream of that name, so no `track` is needed.
   */
  renew(runId: string, token: bigint, ttlMs: number, listener: FenceListener, trackedOn = ""): void {
    const known = this.entries.get(runId);
    const e = this.entry(runId, token, listener);
    e.renewTtlMs = ttlMs;
    e.dueAt = performance.now() + ttlMs / 3;
    this.ensureRunning();
    // pushes must reach us from the acquire on, not from the first renewal
    this.trackIfNew(runId, token, known, trackedOn);
    this.schedule();
  }

  /** Watch `runId`'s fence at `token` without renewing (`trackedOn`: as in renew). */
  track(runId: string, token: bigint, listener: FenceListener, trackedOn = ""): void {
    const known = this.entries.get(runId);
    this.entry(runId, token, listener);
    this.ensureRunning();
    this.trackIfNew(runId, token, known, trackedOn);
  }

  /** Send `track` for a token not watched before, unless the acquire's commit tracked it on this stream. */
  private trackIfNew(runId: string, token: bigint, known: Entry | undefined, trackedOn: string): void {
    if (known?.token === token || (trackedOn && trackedOn === this.name)) return;
    this.send({ kind: { case: "track", value: create(KeepAliveTrackSchema, { runId, fencingToken: token }) } });
  }

  /**
   * Stop hearing about `runId` for this listener (and stop renewing it when
   * nobody else listens). `untrack` false: the server has stopped tracking it
   * already (the holder's own finish, release or suspend ends it in its commit).
   */
  forget(runId: string, listener: FenceListener, untrack = true): void {
    const e = this.entries.get(runId);
    if (!e || !e.listeners.delete(listener)) return;
    if (e.listeners.size === 0) {
      this.entries.delete(runId);
      if (untrack) this.send({ kind: { case: "untrack", value: create(KeepAliveUntrackSchema, { runId }) } });
    }
  }

  /** Stop renewing `runId` (its lease is finished or given up) but keep watchers. */
  stopRenewing(runId: string, listener: FenceListener, untrack = true): void {
    const e = this.entries.get(runId);
    // The entry may already be a newer token's (a later lease of the run): leave it alone.
    if (!e || !e.listeners.has(listener)) return;
    e.renewTtlMs = undefined;
    this.forget(runId, listener, untrack);
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.timer) clearTimeout(this.timer);
    this.queue?.close();
    this.abort.abort();
    this.streamAbort?.abort();
  }

  private entry(runId: string, token: bigint, listener: FenceListener): Entry {
    let e = this.entries.get(runId);
    if (!e || e.token !== token) {
      // A new token replaces the old watch: the server tracks one token per run and stream.
      e = { token, moves: 0, renewTtlMs: undefined, dueAt: Number.POSITIVE_INFINITY, sent: [], listeners: new Set() };
      this.entries.set(runId, e);
    }
    e.listeners.add(listener);
    return e;
  }

  private send(msg: Omit<Partial<KeepAliveRequest>, "$typeName">): void {
    this.push(this.queue, create(KeepAliveRequestSchema, msg));
  }

  private push(queue: AsyncQueue<KeepAliveRequest> | undefined, msg: KeepAliveRequest): void {
    if (!queue) return;
    this.messages++;
    queue.push(msg);
  }

  private schedule(): void {
    if (this.closed) return;
    let next = Number.POSITIVE_INFINITY;
    for (const e of this.entries.values()) if (e.renewTtlMs !== undefined) next = Math.min(next, e.dueAt);
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    if (next === Number.POSITIVE_INFINITY) return;
    this.timer = setTimeout(() => this.flushDue(), Math.max(0, next - performance.now()));
    this.timer.unref();
  }

  /** Send every renewal due within the next 50 ms in one message. */
  private flushDue(): void {
    // no stream: its reconnect renews what is due and schedules the rest
    if (!this.queue) return;
    const now = performance.now();
    // a renewal unanswered for a third of its ttl: that coordinator stopped answering
    // (frozen, or behind something that answers pings); reopen on the one that leads
    for (const e of this.entries.values()) {
      if (e.renewTtlMs !== undefined && e.sent.length && now - e.sent[0]! >= e.renewTtlMs / 3) {
        this.streamAbort?.abort(new ConnectError("a renewal went unanswered for a third of its ttl", Code.DeadlineExceeded));
        return;
      }
    }
    const renews = [];
    for (const [runId, e] of this.entries) {
      if (e.renewTtlMs === undefined || e.dueAt > now + 50) continue;
      renews.push(create(KeepAliveRenewSchema, { runId, fencingToken: e.token, leaseTtlMs: BigInt(e.renewTtlMs) }));
      e.sent.push(now);
      e.dueAt = now + e.renewTtlMs / 3;
    }
    if (renews.length) this.send({ renews });
    this.schedule();
  }

  private ensureRunning(): void {
    if (this.running || this.closed) return;
    this.running = true;
    void this.loop();
  }

  private async loop(): Promise<void> {
    const policy = retryPolicy({ initialBackoffMs: 50, maxBackoffMs: 2000 });
    let delay = backoffDelays(policy);
    while (!this.closed && this.entries.size > 0) {
      const queue = new AsyncQueue<KeepAliveRequest>();
      this.queue = queue;
      const name = `${this.namePrefix}-${this.connects}`;
      this.push(queue, create(KeepAliveRequestSchema, { kind: { case: "hello", value: { owner: this.owner, streamName: name } } }));
      this.name = name;
      const renews = [];
      const now = performance.now();
      for (const [runId, e] of this.entries) {
        // A reconnect renews what is due and what had a renewal unanswered
        // (which do we still hold?); the rest is tracked and renews on time.
        const unanswered = e.sent.length > 0;
        e.sent = [];
        if (e.renewTtlMs !== undefined && (unanswered || this.renewAllOnReconnect || e.dueAt <= now + 50)) {
          renews.push(create(KeepAliveRenewSchema, { runId, fencingToken: e.token, leaseTtlMs: BigInt(e.renewTtlMs) }));
          e.sent.push(now);
          e.dueAt = now + e.renewTtlMs / 3;
        } else {
          this.push(queue, create(KeepAliveRequestSchema, { kind: { case: "track", value: { runId, fencingToken: e.token } } }));
        }
      }
      if (renews.length) this.push(queue, create(KeepAliveRequestSchema, { renews }));
      this.schedule();
      this.connects++;
      let answered = false;
      try {
        const streamAbort = new AbortController();
        this.streamAbort = streamAbort;
        if (this.closed) break;
        for await (const resp of this.ledger.keepAlive(queue, { signal: streamAbort.signal })) {
          this.handle(resp);
          answered = true;
        }
      } catch (e) {
        // dropped: reconnect below unless closing
        if (process.env["FENCEPOST_DEBUG"]) console.error("KeepAlive stream ended:", e);
        const err = fromCallError(e);
        if (!this.closed) this.onDown?.();
        if (!this.closed && (err instanceof PermissionDeniedError || err instanceof UnauthenticatedError)) {
          // refused for this owner or these credentials: every reconnect would be too
          const refused = [...this.entries.values()];
          this.entries.clear();
          for (const entry of refused) for (const l of entry.listeners) l.error?.(err.code, err.message);
        }
      }
      queue.close();
      if (this.queue === queue) {
        this.queue = undefined;
        this.name = "";
      }
      if (this.closed || this.entries.size === 0) break;
      if (answered) delay = backoffDelays(policy); // a stream that worked starts the backoff over
      try {
        await sleep(delay(), this.abort.signal);
      } catch {
        break;
      }
    }
    this.running = false;
    // A lease added while the loop was winding down starts it again.
    if (!this.closed && this.entries.size > 0) this.ensureRunning();
  }

  private handle(resp: KeepAliveResponse): void {
    for (const r of resp.batch) this.handle(r);
    const k = resp.kind;
    switch (k.case) {
      case "renewed": {
        const e = this.entries.get(k.value.runId);
        if (!e || e.token !== k.value.fencingToken) return;
        const sentAt = e.sent.shift();
        if (sentAt === undefined) return;
        e.moves = 0;
        const expiresAt = new Date(k.value.expiresAt ? timestampMs(k.value.expiresAt) : 0);
        for (const l of e.listeners) l.renewed?.(sentAt, Number(k.value.ttlRemainingMs), expiresAt);
        return;
      }
      case "lost": {
        const e = this.entries.get(k.value.runId);
        if (!e || e.token !== k.value.fencingToken) return;
        this.entries.delete(k.value.runId);
        const record = k.value.record ? recordFromPb(k.value.record) : undefined;
        for (const l of e.listeners) l.lost(lostReasonFromPb(k.value.reason), record);
        return;
      }
      case "expiring": {
        const e = this.entries.get(k.value.runId);
        if (!e || e.token !== k.value.fencingToken) return;
        const expiresAt = new Date(k.value.expiresAt ? timestampMs(k.value.expiresAt) : 0);
        for (const l of e.listeners) l.expiring?.(expiresAt);
        return;
      }
      case "error": {
        const e = this.entries.get(k.value.runId);
        if (!e) return;
        e.sent.shift();
        if (k.value.code === NotOwnerError.code && this.onNotOwner) {
          // another coordinator leads its shard: it leaves this stream for the owner's
          this.entries.delete(k.value.runId);
          this.send({ kind: { case: "untrack", value: create(KeepAliveUntrackSchema, { runId: k.value.runId }) } });
          const err = errorFor(k.value.code, k.value.message, { metadata: { ...k.value.metadata } }) as NotOwnerError;
          this.onNotOwner(k.value.runId, { token: e.token, renewTtlMs: e.renewTtlMs, listeners: e.listeners, moves: e.moves }, err);
          return;
        }
        for (const l of e.listeners) l.error?.(k.value.code, k.value.message);
        return;
      }
      default:
        return;
    }
  }
}
