// Routing by shard (docs/SPEC.md "Shards", docs/TYPESCRIPT.md): a client
// sends every call to the coordinator(s) it was given, as it always did,
// until one answers NOT_OWNER. From then on it routes: it fetches the shard
// map (Ledger.Shards) and sends each call to the coordinator that leads the
// shard of its first shard key, over one connection, one Execute stream and
// one KeepAlive stream per coordinator. A call refused with NOT_OWNER is
// sent at once, with the same request id, to the owner the refusal names (a
// few hops in a row; one naming back the coordinator that sent it there is
// followed 25 ms later each time, for up to 2 s, then NotOwnerError);
// a later refusal refreshes the map,
// at most once every MAP_REFRESH_MS. A lease whose renewal is refused with
// NOT_OWNER is tracked and renewed at the new owner by itself.
import { Code, type Client } from "@connectrpc/connect";
import type { EngineStore } from "./gen/fencepost/v1/engine_store_pb.js";
import type { Ledger } from "./gen/fencepost/v1/ledger_pb.js";
import type { RunStore } from "./gen/fencepost/v1/run_store_pb.js";
import { fromCallError, NotOwnerError } from "./errors.js";
import type { Endpoints } from "./endpoints.js";
import type { CommandChannel } from "./execute.js";
import type { FenceListener, KeepAliveSession, MovedLease } from "./keepalive.js";
import { sleep } from "./retry.js";
import { shardOf } from "./shards.js";

/** A call refused with NOT_OWNER is sent on at most this many times. */
export const MAX_HOPS = 4;
/** The shard map is fetched again at most this often (ms). */
export const MAP_REFRESH_MS = 50;
/**
 * A NOT_OWNER naming no owner (the shard is being taken or handed over, done
 * within moments) is tried again after this long (ms), for up to IN_TRANSIT_LIMIT_MS.
 */
export const IN_TRANSIT_MS = 25;
export const IN_TRANSIT_LIMIT_MS = 10_000;
/**
 * Past MAX_HOPS in a row (owners naming each other: a shard mid-move), a call
 * is tried again every IN_TRANSIT_MS for up to this long (ms), then NotOwnerError.
 */
export const MOVE_WINDOW_MS = 2_000;

/** The stubs a call can be made on. */
export interface Stubs {
  ledger: Client<typeof Ledger>;
  runStore: Client<typeof RunStore>;
  engineStore: Client<typeof EngineStore>;
}

/** One coordinator a client talks to: its connection, Execute stream and KeepAlive stream. */
export interface Coordinator {
  /** The address calls go to (for the client's own endpoints, the one believed to lead). */
  readonly address: string;
  readonly endpoints: Endpoints;
  readonly stubs: Stubs;
  readonly channel: CommandChannel;
  readonly keepAlive: KeepAliveSession;
  close(): Promise<void>;
}

/** The map as routing needs it: the shard count and each shard's owner address ("" unknown). */
export interface OwnerMap {
  shardCount: number;
  owners: string[];
  /** The coordinator that answered the map, and by index whether it leads each shard itself. */
  from?: Coordinator;
  led?: boolean[];
}

export class Router {
  /** Whether a NOT_OWNER was seen: calls are routed by shard from then on. */
  on = false;
  private count = 0;
  private owners: string[] = [];
  private fetchedAt = Number.NEGATIVE_INFINITY;
  private fetching: Promise<void> | undefined;
  private readonly peers = new Map<string, Coordinator>();
  /** The coordinator whose KeepAlive stream holds a run's entry, when not the home one. */
  private readonly where = new Map<string, Coordinator>();
  private closed = false;

  constructor(
    readonly home: Coordinator,
    /** Opens a connection to another coordinator (undefined: this client cannot, e.g. a fixed transport). */
    private readonly open: (address: string) => Coordinator | undefined,
    private readonly fetchMap: () => Promise<OwnerMap>,
  ) {
    this.watchMoves(home);
  }

  /** Every coordinator this client has a connection to, the home one first. */
  get coordinators(): Coordinator[] { return [this.home, ...this.peers.values()]; }

  async close(): Promise<void> {
    this.closed = true;
    await Promise.all([...this.peers.values()].map((c) => c.close()));
    this.peers.clear();
  }

  /** The coordinator at `address`, connected on first use (undefined: this client cannot go there). */
  coordinator(address: string): Coordinator | undefined { return this.at(address); }

  private at(address: string): Coordinator | undefined {
    if (!address || address === this.home.address) return this.home;
    let c = this.peers.get(address);
    if (!c && !this.closed) {
      c = this.open(address);
      if (c) {
        this.peers.set(address, c);
        this.watchMoves(c);
      }
    }
    return c;
  }

  /** Route from now on by `map` (the given coordinator's, showing shards led elsewhere), as a NOT_OWNER would. */
  route(map: OwnerMap): void {
    if (!this.count) {
      this.count = map.shardCount;
      this.owners = map.owners;
      this.fetchedAt = performance.now();
    }
    this.start();
  }

  private start(): void {
    if (this.on) return;
    this.on = true;
    for (const c of this.coordinators) c.keepAlive.renewAllOnReconnect = true;
  }

  /** Each distinct coordinator that leads a shard by the map (fetched first when none is known yet). */
  async owning(): Promise<Coordinator[]> {
    if (this.fetching) await this.fetching;
    if (!this.count) await this.refresh().catch(() => undefined);
    const out = new Set<Coordinator>();
    for (let s = 0; s < this.count; s++) out.add(this.at(this.owners[s] ?? "") ?? this.home);
    if (!out.size) out.add(this.home);
    return [...out];
  }

  /** Where a call keyed by `keys` goes now: its first key's owner, else the home coordinator. */
  private target(keys: readonly string[] | undefined): Coordinator {
    const first = keys?.[0];
    if (!this.on || first === undefined || !this.count) return this.home;
    return this.at(this.owners[shardOf(first, this.count)] ?? "") ?? this.home;
  }

  /**
   * One attempt of a call keyed by `keys()` (computed only once routing is
   * on): to the home coordinator until a NOT_OWNER, then to the owner.
   */
  send<T>(keys: () => readonly string[] | undefined, attempt: (c: Coordinator) => Promise<T>): Promise<T> {
    if (!this.on) return attempt(this.home).catch((e: unknown) => this.hop(e, this.home, attempt, 0));
    return this.routed(keys(), attempt);
  }

  private async routed<T>(keys: readonly string[] | undefined, attempt: (c: Coordinator) => Promise<T>): Promise<T> {
    if (this.fetching) await this.fetching;
    const c = this.target(keys);
    try {
      return await attempt(c);
    } catch (e) {
      return this.hop(e, c, attempt, 0);
    }
  }

  /** `thrown` by an attempt at `from`: a NOT_OWNER is sent on to the owner it names (bounded). */
  private async hop<T>(thrown: unknown, from: Coordinator, attempt: (c: Coordinator) => Promise<T>, hops: number): Promise<T> {
    let err = thrown;
    let c = from;
    const since = performance.now();
    let crossed: number | undefined; // when owners first kept naming each other
    const named = new Map<string, string>(); // coordinator -> the owner it named
    for (let hop = hops; ; ) {
      const refused = fromCallError(err);
      if (!(refused instanceof NotOwnerError)) {
        // no answer from a coordinator: it may be gone, its shards led elsewhere now
        if (this.on && refused.grpcCode === Code.Unavailable) void this.refresh().catch(() => undefined);
        throw err;
      }
      const transit = !refused.owner; // counted in time, not in hops
      // naming back the one that sent the call here (owners naming each other mid-move,
      // one of them not told yet): followed still, a moment later each time
      const back = !transit && (named.get(refused.owner) === c.address || hop >= MAX_HOPS);
      if (!transit) named.set(c.address, refused.owner);
      if (back) crossed ??= performance.now();
      if (transit ? performance.now() - since > IN_TRANSIT_LIMIT_MS
        : crossed !== undefined && performance.now() - crossed > MOVE_WINDOW_MS) {
        const why = transit ? `for ${IN_TRANSIT_LIMIT_MS} ms`
          : `after ${MAX_HOPS} hops between coordinators, for ${MOVE_WINDOW_MS} ms`;
        throw new NotOwnerError(`${refused.message} (still refused ${why})`, {
          metadata: { ...refused.metadata }, cause: refused, ...(refused.grpcCode !== undefined ? { grpcCode: refused.grpcCode } : {}),
        });
      }
      if (back) {
        await sleep(IN_TRANSIT_MS); // followed still, a moment later: one of them leads it soon
        hop = 0;
      }
      c = await this.refused(refused, c, hop);
      if (!transit && !back) hop++;
      try {
        return await attempt(c);
      } catch (e) {
        err = e;
      }
    }
  }

  /**
   * A NOT_OWNER from `from`: route from now on, note the owner it names,
   * refresh the map (at most every MAP_REFRESH_MS), and say where to go next.
   */
  private async refused(err: NotOwnerError, from: Coordinator, hop: number): Promise<Coordinator> {
    this.start();
    const shard = err.shard;
    if (err.owner) {
      void this.refresh().catch(() => undefined);
      if (this.count && shard >= 0 && shard < this.count) this.owners[shard] = err.owner;
      const named = this.at(err.owner);
      if (named && named !== from) return named;
    }
    if (!err.owner) {
      // the one asked is taking the shard (or learning who leads it): ask it again
      // shortly, not the map's (older) owner, which would only name it
      await sleep(IN_TRANSIT_MS);
      void this.refresh().catch(() => undefined);
      return from;
    }
    // the one that refused named itself: wait for a newer map
    await sleep(MAP_REFRESH_MS * 2 ** hop);
    await this.refresh().catch(() => undefined);
    const owner = this.count && shard >= 0 && shard < this.count ? this.owners[shard] ?? "" : "";
    return this.at(owner) ?? this.home;
  }

  /** Fetch the map unless one was fetched (or asked for) under MAP_REFRESH_MS ago. */
  private refresh(): Promise<void> {
    if (this.fetching) return this.fetching;
    if (performance.now() - this.fetchedAt < MAP_REFRESH_MS) return Promise.resolve();
    this.fetchedAt = performance.now();
    const done = this.fetchMap().then((m) => {
      this.count = m.shardCount;
      this.owners = m.owners;
    });
    const settled: Promise<void> = done.catch(() => undefined).finally(() => {
      this.fetchedAt = performance.now();
      if (this.fetching === settled) this.fetching = undefined;
    });
    this.fetching = settled;
    return done;
  }

  // -- leases: renewed on their owner's KeepAlive stream -----------------------------

  /** The KeepAlive stream `runId`'s renewals go to: where it is, else its owner's. */
  private holder(runId: string, at: Coordinator | undefined): Coordinator {
    const c = at ?? this.where.get(runId) ?? (this.on ? this.target([runId]) : this.home);
    if (c !== this.home) this.where.set(runId, c);
    else this.where.delete(runId);
    return c;
  }

  /** Renew `runId` on the stream of `at` (the coordinator its acquire went to), else of its owner. */
  renew(runId: string, token: bigint, ttlMs: number, listener: FenceListener, trackedOn = "", at?: Coordinator): void {
    this.holder(runId, at).keepAlive.renew(runId, token, ttlMs, listener, trackedOn);
  }

  /** Watch `runId`'s fence on its owner's stream. */
  track(runId: string, token: bigint, listener: FenceListener, trackedOn = "", at?: Coordinator): void {
    this.holder(runId, at).keepAlive.track(runId, token, listener, trackedOn);
  }

  forget(runId: string, listener: FenceListener, untrack = true): void {
    for (const c of this.coordinators) c.keepAlive.forget(runId, listener, untrack);
    this.settled(runId);
  }

  stopRenewing(runId: string, listener: FenceListener, untrack = true): void {
    for (const c of this.coordinators) c.keepAlive.stopRenewing(runId, listener, untrack);
    this.settled(runId);
  }

  private settled(runId: string): void {
    const c = this.where.get(runId);
    if (c && !c.keepAlive.holds(runId)) this.where.delete(runId);
  }

  private watchMoves(c: Coordinator): void {
    c.keepAlive.onNotOwner = (runId, moved, err) => { void this.moveLease(c, runId, moved, err); };
    c.keepAlive.renewAllOnReconnect = this.on;
    c.keepAlive.onDown = () => { if (this.on) void this.rehome(c); };
  }

  /**
   * `from`'s KeepAlive stream failed: with a fresh map, move the leases and
   * watches whose shard another coordinator leads now to that one's stream.
   */
  private async rehome(from: Coordinator): Promise<void> {
    await this.refresh().catch(() => undefined);
    if (this.closed) return;
    for (const runId of from.keepAlive.runIds()) {
      const to = this.target([runId]);
      if (to === from) continue;
      const moved = from.keepAlive.take(runId);
      if (!moved) continue;
      if (to !== this.home) this.where.set(runId, to);
      else this.where.delete(runId);
      to.keepAlive.adopt(runId, { ...moved, moves: moved.moves - 1 });
    }
  }

  /** A renewal refused with NOT_OWNER at `from`: track and renew the lease at the owner instead. */
  private async moveLease(from: Coordinator, runId: string, moved: MovedLease, err: NotOwnerError): Promise<void> {
    // a lease refused over and over (two coordinators naming each other) backs off
    const next = await this.refused(err, from, Math.min(moved.moves, 4));
    if (this.closed) return;
    if (next !== this.home) this.where.set(runId, next);
    else this.where.delete(runId);
    next.keepAlive.adopt(runId, moved, moved.moves < 2 ? 0 : Math.min(2000, 25 * 2 ** moved.moves));
  }
}
