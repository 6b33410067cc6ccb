// FencepostClient: the ledger (acquire, leases, operator commands, reads,
// watchRuns), the raw RunStore and the EngineStore, over one gRPC connection
// per coordinator (routing.ts: by shard, once a coordinator says NOT_OWNER).
import { hostname } from "node:os";
import { randomBytes } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { Code, createClient, type Client, type Transport } from "@connectrpc/connect";
import {
  ChangeKind, Ledger, ListRunsRequestSchema, type Command, type ListRunsRequest, type ShardsResponse, type CommandResult,
} from "./gen/fencepost/v1/ledger_pb.js";
import { OutcomeSchema } from "./gen/fencepost/v1/record_pb.js";
import { RunStore } from "./gen/fencepost/v1/run_store_pb.js";
import { EngineStore } from "./gen/fencepost/v1/engine_store_pb.js";
import { TestHooks } from "./gen/fencepost/v1/testing_pb.js";
import { fromCallError, RevisionCompactedError, StreamTooSlowError, ValidationError, type FencepostError } from "./errors.js";
import { Endpoints, parseEndpoints, type ConnectionOptions } from "./endpoints.js";
import { acquireShared, releaseShared, shareKey } from "./shared.js";
import { shardKeys } from "./placement.js";
import { Router, type Coordinator, type OwnerMap, type Stubs } from "./routing.js";
import { KeepAliveSession, type FenceListener } from "./keepalive.js";
import { Lease, type LeaseHost } from "./lease.js";
import { recordFromPb, statusFromPb, statusToPb, toBigInt, toNumber, type RunRecord, type RunStatus } from "./records.js";
import { backoffDelays, newRequestId, retryPolicy, sleep, withRetry, type AttemptOptions, type CallOptions, type FullRetryPolicy, type RetryPolicy } from "./retry.js";
import { EngineStoreClient, fencePb } from "./store.js";
import { CommandChannel, type CommandKind, type Transport as CommandTransport } from "./execute.js";
import { watchByShards, WatchCursor, type RunChange, type WatchHost } from "./watch.js";

export type { CallOptions };

export interface ClientOptions extends ConnectionOptions {
  /** Worker identity for acquire and the KeepAlive stream (default: host-pid-random). */
  owner?: string;
  /** Lease ttl for acquire when none is given, ms (default 60 000). */
  defaultTtlMs?: number;
  /** How calls are retried while the server is unavailable. */
  retry?: RetryPolicy;
  /**
   * How mutations travel: "stream" (default) multiplexes them on one
   * Ledger.Execute stream, those of one event-loop turn in one message, with
   * unary calls while the stream is down; "unary" sends one call each.
   * Answers, errors, request ids and retries are the same either way.
   */
  transport?: CommandTransport;
  /** Use this Connect transport instead of opening a gRPC connection to the address (it follows no leader). */
  connectTransport?: Transport;
}

/** The request of a command kind, as an init object without its request id. */
export type CommandRequest<K extends CommandKind> =
  Omit<Partial<Extract<Command["kind"], { case: K }>["value"]>, "requestId" | "$typeName" | "$unknown">;
/** The response of a command kind. */
export type CommandResponse<K extends CommandKind> = Extract<CommandResult["kind"], { case: K }>["value"];

export interface AcquireOptions extends CallOptions {
  /** Lease ttl, ms (100 - 86 400 000; default the client's defaultTtlMs). */
  ttlMs?: number;
  /** Lock-delay, ms (SPEC §5.6; default 0). */
  lockDelayMs?: number;
  /** Renew in the background over the KeepAlive stream (default true). */
  renew?: boolean;
}

export interface ListRunsOptions extends CallOptions {
  statuses?: RunStatus[];
  owner?: string;
  pageSize?: number;
  pageToken?: string;
}

export interface RunPage {
  runs: RunRecord[];
  nextPageToken: string;
  revision: number;
}

export interface FenceStatus {
  current: boolean;
  found: boolean;
  fencingToken: number;
  status: RunStatus | undefined;
  revision: number;
}

/** One shard of the map: the coordinator that leads it, its epoch (0 on SQLite), its ledger runs and live leases. */
function shardInfo(s: { index: number; owner: string; address: string; epoch: bigint; runs: bigint; leases: bigint }): ShardInfo {
  return {
    index: s.index, owner: s.owner, address: s.address, epoch: toNumber(s.epoch),
    runs: toNumber(s.runs), leases: toNumber(s.leases),
  };
}

/** How long a coordinator other than the home one is given to answer the shard map (ms). */
const MAP_ASK_MS = 2_000;

export interface ShardInfo {
  index: number;
  owner: string;
  address: string;
  epoch: number;
  runs: number;
  leases: number;
}

/** `client.shards()`: the database's shard count, every shard by index, and the revision the counts reflect. */
export interface ShardMap {
  shardCount: number;
  shards: ShardInfo[];
  revision: number;
}

export type { RunChange };

export interface WatchOptions {
  /** Only these runs (at most 1000); default every run. */
  runIds?: string[];
  /** Replay retained changes from this revision; default: changes after the watch starts. */
  fromRevision?: number;
  /**
   * Watch by shards: resume each shard after the cursor's revision for it
   * (a shard it lacks: from now), updating it in place as each change is
   * yielded. `fromRevision` must then be unset or 0.
   */
  cursor?: WatchCursor;
  /** Ends the iteration. */
  signal?: AbortSignal;
}

/** The map as routing needs it: each shard's owner address, by index, and which `from` (that answered) leads. */
function ownerMap(resp: ShardsResponse, from?: Coordinator): OwnerMap {
  const owners = new Array<string>(resp.shardCount).fill("");
  const led = new Array<boolean>(resp.shardCount).fill(false);
  for (const s of resp.shards) {
    if (s.index >= 0 && s.index < resp.shardCount) {
      owners[s.index] = s.address;
      led[s.index] = s.owner !== ""; // a coordinator names the owner of its own shards alone
    }
  }
  return from ? { shardCount: resp.shardCount, owners, from, led } : { shardCount: resp.shardCount, owners };
}

/** The order the server lists run ids in: their UTF-8 bytes (JavaScript's `<` compares UTF-16 units). */
function byteOrder(a: string, b: string): number {
  // UTF-8 byte order is code point order
  for (let i = 0; i < a.length && i < b.length; i++) {
    const [x, y] = [a.codePointAt(i)!, b.codePointAt(i)!];
    if (x !== y) return x - y;
    if (x > 0xffff) i++;
  }
  return a.length - b.length;
}

/**
 * A merged listing's page token: per owner not read to its end, its address
 * ("" for the given coordinator), its own page token and the last run id given.
 */
const MERGED_TOKEN = "fpm1.";
interface MergedCursor { a: string; t: string; l?: string | undefined }
interface ListCursor { c: Coordinator; address: string; token: string; next: string | undefined; buf: RunRecord[]; last?: string }

function parseMergedToken(token: string): MergedCursor[] {
  const bad = () => new ValidationError("page_token: not a next_page_token this client's list returned", { field: "page_token" });
  if (!token.startsWith(MERGED_TOKEN)) throw bad();
  let parsed: unknown;
  try {
    parsed = JSON.parse(Buffer.from(token.slice(MERGED_TOKEN.length), "base64url").toString("utf8"));
  } catch {
    throw bad();
  }
  const ok = (m: unknown): m is MergedCursor => typeof m === "object" && m !== null
    && typeof (m as MergedCursor).a === "string" && typeof (m as MergedCursor).t === "string"
    && ["string", "undefined"].includes(typeof (m as MergedCursor).l);
  if (!Array.isArray(parsed) || !parsed.every(ok)) throw bad();
  return parsed;
}

/** `{hostname}-{pid}-{random}`: two live processes never share one. */
export function defaultOwner(): string {
  return `${hostname()}-${process.pid}-${randomBytes(4).toString("hex")}`;
}

type Mutable = Record<string, unknown>;
type FencedKind = "renew" | "recordCheckpoint" | "suspend" | "finish" | "release";

/** @internal What the testing entry point reaches: test hooks and diagnostic counters. */
export const internals = Symbol("fencepost.internals");

/** @internal */
export interface ClientInternals {
  testHooks: Client<typeof TestHooks>;
  executeConnects(): number;
  executeCommands(): number;
  keepAliveConnects(): number;
  keepAliveMessages(): number;
  coordinators(): string[];
}

export class FencepostClient {
  readonly owner: string;
  readonly defaultTtlMs: number;
  /**
   * The generated Connect clients, for anything the typed API does not cover
   * (each call goes to the endpoint believed to lead).
   */
  readonly stubs: {
    ledger: Client<typeof Ledger>;
    runStore: Client<typeof RunStore>;
    engineStore: Client<typeof EngineStore>;
  };
  /** The engine store (SPEC §11) with plain JavaScript values. */
  readonly store: EngineStoreClient;
  readonly retry: FullRetryPolicy;
  private readonly endpoints: Endpoints;
  private keepAlive: KeepAliveSession;
  private channel: CommandChannel;
  private readonly shareKey: string | undefined;
  private readonly sharedChannel: boolean;
  private _closed = false;
  /** @internal */
  readonly [internals]: ClientInternals;
  private readonly router: Router;
  private readonly connection: ClientOptions;
  private readonly transportKind: CommandTransport;
  /** The given coordinator's map, asked once by a listing while not routing. */
  private mapChecked: Promise<void> | undefined;

  /**
   * `address`: one coordinator (`"host:port"`), or several (an array, or one
   * comma-separated string): each call then goes to the one that leads.
   * Throws TypeError for an empty address or options that cannot work
   * (a token in plaintext to another machine, a certificate without its key).
   */
  constructor(address: string | readonly string[], options: ClientOptions = {}) {
    const addresses = parseEndpoints(address);
    this.owner = options.owner ?? defaultOwner();
    this.defaultTtlMs = options.defaultTtlMs ?? 60_000;
    this.retry = retryPolicy(options.retry);
    // clients of one process with the same endpoints and credentials share connections and one Execute stream
    this.shareKey = options.connectTransport ? undefined : shareKey(addresses, options);
    const sharing = this.shareKey !== undefined ? acquireShared(this.shareKey, addresses, options) : undefined;
    this.endpoints = sharing?.endpoints ?? new Endpoints(addresses, options, options.connectTransport);
    const transport: Transport = this.endpoints;
    this.stubs = {
      ledger: createClient(Ledger, transport),
      runStore: createClient(RunStore, transport),
      engineStore: createClient(EngineStore, transport),
    };
    const testHooks = createClient(TestHooks, transport);
    this.keepAlive = new KeepAliveSession(this.stubs.ledger, this.owner);
    const transportKind = options.transport ?? "stream";
    this.sharedChannel = sharing !== undefined && transportKind === "stream";
    this.channel = this.sharedChannel ? sharing!.channel()
      : new CommandChannel(this.stubs.ledger, this.stubs.engineStore, transportKind);
    this.connection = options;
    this.transportKind = transportKind;
    const endpoints = this.endpoints;
    const home: Coordinator = {
      get address() { return endpoints.address; },
      endpoints, stubs: this.stubs, channel: this.channel, keepAlive: this.keepAlive, close: async () => undefined,
    };
    this.router = new Router(home, (a) => (options.connectTransport ? undefined : this.openCoordinator(a)), () => this.owners());
    this.store = new EngineStoreClient(this.stubs.engineStore, this.retry, (kind, req, o) => this.command(kind, req as never, o) as never,
      {}, (key, call) => this.router.send(() => (key === undefined ? undefined : [key]), (c) => call(c.stubs.engineStore)));
    this[internals] = {
      coordinators: () => this.router.coordinators.map((c) => c.address),
      testHooks,
      executeConnects: () => this.channel.connects,
      executeCommands: () => this.channel.commandsSent,
      keepAliveConnects: () => this.keepAlive.connects,
      keepAliveMessages: () => this.keepAlive.messages,
    };
  }

  /** The endpoint calls go to now: the first given, or the one found to lead. */
  get address(): string { return this.endpoints.address; }

  /** The endpoints given, in order. */
  get endpointList(): readonly string[] { return this.endpoints.listed; }

  get closed(): boolean { return this._closed; }

  /** "stream" or "unary": how mutations travel. */
  get transport(): CommandTransport { return this.channel.transport; }

  /** Stop renewing, close the streams and connections. Leases live on by their ttl. */
  async close(): Promise<void> {
    if (this._closed) return;
    this._closed = true;
    await this.router.close();
    if (!this.sharedChannel) await this.channel.close();
    await this.keepAlive.close();
    if (this.shareKey !== undefined) await releaseShared(this.shareKey);
    else this.endpoints.close();
  }

  async [Symbol.asyncDispose](): Promise<void> { await this.close(); }

  /**
   * A mutation on a generated stub: one request id for every attempt. With
   * `shardKey` (the key of what it writes, docs/SPEC.md "Shards"), `call` is
   * given the stubs of the coordinator that leads its shard.
   */
  async mutate<T>(call: (requestId: string, opts: AttemptOptions, stubs: Stubs) => Promise<T>, options: CallOptions = {}, shardKey?: string): Promise<T> {
    const requestId = newRequestId();
    return withRetry(this.retry, true,
      (o) => this.router.send(() => (shardKey === undefined ? undefined : [shardKey]), (c) => call(requestId, o, c.stubs)), options, this.endpoints);
  }

  /**
   * A ledger command or engine-store mutation (its request without request
   * id) over the client's transport: one request id for every attempt.
   */
  async command<K extends CommandKind>(kind: K, request: CommandRequest<K>, options: CallOptions = {}): Promise<CommandResponse<K>> {
    return this.send(kind, request, options);
  }

  /** `command`, with `perTarget` adding fields for the coordinator each attempt goes to. */
  private send<K extends CommandKind>(kind: K, request: CommandRequest<K>, options: CallOptions,
    perTarget?: (c: Coordinator) => Mutable): Promise<CommandResponse<K>> {
    const req: Mutable = { ...request, requestId: newRequestId() };
    return withRetry(this.retry, true, (o) => this.router.send(() => shardKeys(kind, req),
      (c) => c.channel.run<CommandResponse<K>>(kind, perTarget ? { ...req, ...perTarget(c) } : req, o)), options, this.endpoints);
  }

  /**
   * A read on a generated stub, retried while the server is unavailable.
   * With `shardKey` (the key of what it reads), `call` is given the stubs of
   * the coordinator that leads its shard.
   */
  async read<T>(call: (opts: AttemptOptions, stubs: Stubs) => Promise<T>, options: CallOptions = {}, shardKey?: string): Promise<T> {
    return withRetry(this.retry, false,
      (o) => this.router.send(() => (shardKey === undefined ? undefined : [shardKey]), (c) => call(o, c.stubs)), options, this.endpoints);
  }

  /**
   * The map as routing needs it: each shard's owner address, by index. Asked
   * of the home coordinator, else of any other this client has reached (the
   * one given may be the one that went away).
   */
  private async owners(signal?: AbortSignal): Promise<OwnerMap> {
    // straight to the home coordinator: routing waits for this very fetch
    const others = this.router.coordinators.length > 1;
    try {
      return ownerMap(await withRetry(this.retry, false, (o) => this.stubs.ledger.shards({ ownersOnly: true }, o),
        { ...(others ? { timeoutMs: MAP_ASK_MS } : {}), ...(signal ? { signal } : {}) }, this.endpoints), this.router.home);
    } catch (e) {
      if (signal?.aborted) throw e;
      for (const c of this.router.coordinators.slice(1)) {
        try {
          return ownerMap(await c.stubs.ledger.shards({ ownersOnly: true }, { timeoutMs: MAP_ASK_MS, ...(signal ? { signal } : {}) }), c);
        } catch { /* the next one */ }
      }
      throw e;
    }
  }

  private watchHost(): WatchHost {
    return {
      map: (signal) => this.owners(signal),
      home: this.router.home,
      at: (address) => this.router.coordinator(address),
      closed: () => this._closed,
    };
  }

  /** A connection, Execute stream and KeepAlive stream to another coordinator (shared as the home one is). */
  private openCoordinator(address: string): Coordinator | undefined {
    try {
      const key = this.shareKey !== undefined ? shareKey([address], this.connection) : undefined;
      const sharing = key !== undefined ? acquireShared(key, [address], this.connection) : undefined;
      const endpoints = sharing?.endpoints ?? new Endpoints([address], this.connection);
      const stubs: Stubs = {
        ledger: createClient(Ledger, endpoints), runStore: createClient(RunStore, endpoints), engineStore: createClient(EngineStore, endpoints),
      };
      const sharedChannel = sharing !== undefined && this.transportKind === "stream";
      const channel = sharedChannel ? sharing!.channel() : new CommandChannel(stubs.ledger, stubs.engineStore, this.transportKind);
      const keepAlive = new KeepAliveSession(stubs.ledger, this.owner);
      return {
        address, endpoints, stubs, channel, keepAlive,
        close: async () => {
          if (!sharedChannel) await channel.close();
          await keepAlive.close();
          if (key !== undefined) await releaseShared(key);
          else endpoints.close();
        },
      };
    } catch (why) {
      // an address this client may not connect to (a token in plaintext to another machine, say)
      if (process.env["FENCEPOST_DEBUG"]) console.error(`not routing to ${address}:`, why);
      return undefined;
    }
  }

  /**
   * Become the single active owner of `runId` (creating it when new). The
   * lease renews itself over the client's one KeepAlive stream until it is
   * finished, suspended, released or lost.
   * Throws LeaseHeldError, AlreadyTerminalError, RunSuspendedError, ValidationError.
   */
  async acquire(runId: string, options: AcquireOptions = {}): Promise<Lease> {
    const ttlMs = options.ttlMs ?? this.defaultTtlMs;
    const sentAt = performance.now();
    // The server tracks the lease on our KeepAlive stream at the acquire's
    // commit when we name it: no `track` message after the answer.
    let trackOn = "";
    let landed: Coordinator | undefined;
    const resp = await this.send("acquire", {
      runId, owner: this.owner, leaseTtlMs: toBigInt(ttlMs, "ttl_ms"),
      lockDelayMs: toBigInt(options.lockDelayMs ?? 0, "lock_delay_ms"),
    }, options, (c) => {
      // each attempt names the KeepAlive stream of the coordinator it goes to
      landed = c;
      trackOn = c.keepAlive.streamName;
      return { trackOn };
    });
    const record = recordFromPb(resp.run!);
    const renew = options.renew ?? true;
    return new Lease(this.leaseHost(renew, resp.tracked ? trackOn : "", landed), record, ttlMs, sentAt);
  }

  private leaseHost(renew: boolean, trackedOn = "", landed?: Coordinator): LeaseHost {
    let at = landed; // the first renewal goes where the acquire was granted; later ones where the lease is
    return {
      fenced: (kind, lease, extra, options) => this.fenced(kind, lease, extra, options),
      fencedStore: (lease) => this.store.withView({ fence: fencePb(lease.fence), onRefused: (e) => lease.fenceRefused(e) }),
      startRenewing: (lease, listener) => {
        const token = BigInt(lease.fencingToken);
        const where = at;
        at = undefined;
        if (renew) this.router.renew(lease.runId, token, lease.ttlMs, listener, trackedOn, where);
        else this.router.track(lease.runId, token, listener, trackedOn, where);
      },
      stopRenewing: (lease, listener, untrack) => this.router.stopRenewing(lease.runId, listener, untrack),
    };
  }

  private async fenced(kind: FencedKind, lease: Lease, extra: Mutable, options: CallOptions): Promise<RunRecord> {
    const req: Mutable = { runId: lease.runId, owner: lease.owner, fencingToken: BigInt(lease.fencingToken), ...extra };
    if (kind === "finish") {
      req["status"] = statusToPb((extra["status"] as RunStatus | undefined) ?? "completed");
      const outcome = extra["outcome"] as { code: string; message?: string } | undefined;
      if (outcome) req["outcome"] = create(OutcomeSchema, outcome);
      else delete req["outcome"];
    }
    const resp = await this.command(kind, req as CommandRequest<FencedKind>, options);
    return recordFromPb(resp.run!);
  }

  /** Read one run. Throws RunNotFoundError. */
  async get(runId: string, options: CallOptions = {}): Promise<RunRecord> {
    const resp = await this.read((o, stubs) => stubs.ledger.getRun({ runId }, o), options, runId);
    return recordFromPb(resp.run!);
  }

  /**
   * One page of runs ordered by run id (byte order of their UTF-8). Where
   * coordinators each lead some shards, the page merges every owner's runs,
   * and `nextPageToken` is this client's (pass it back to `list` as it is).
   */
  async list(options: ListRunsOptions = {}): Promise<RunPage> {
    const req = create(ListRunsRequestSchema, {
      statuses: (options.statuses ?? []).map((s, i) => statusToPb(s, `statuses[${i}]`)),
      owner: options.owner ?? "",
      pageSize: options.pageSize ?? 0,
      pageToken: options.pageToken ?? "",
    });
    const owners = await this.listedOwners(options);
    if (!owners) return this.homePage(req, options);
    return this.mergedPage(owners, req, options);
  }

  /**
   * Every run (all pages, from every shard's owner), and the revision to
   * watch from: the first page's + 1, as the given coordinator answered it.
   */
  async listAll(options: Omit<ListRunsOptions, "pageToken"> = {}): Promise<{ runs: RunRecord[]; revision: number }> {
    const runs: RunRecord[] = [];
    let token = "";
    let revision = -1;
    do {
      const page = await this.list({ ...options, pageToken: token, pageSize: options.pageSize ?? 1000 });
      if (revision < 0) revision = page.revision;
      runs.push(...page.runs);
      token = page.nextPageToken;
    } while (token);
    return { runs, revision };
  }

  /** One page as the given coordinator answers it (its own shards' runs). */
  private async homePage(req: ListRunsRequest, options: CallOptions): Promise<RunPage> {
    const resp = await this.read((o) => this.stubs.ledger.listRuns(req, o), options);
    return { runs: resp.runs.map(recordFromPb), nextPageToken: resp.nextPageToken, revision: toNumber(resp.revision) };
  }

  /**
   * The coordinators a listing must ask, or undefined when the given one
   * leads every shard. Not routing yet, its map is asked once per client.
   */
  private async listedOwners(options: CallOptions): Promise<Coordinator[] | undefined> {
    if (!this.router.on) {
      this.mapChecked ??= withRetry(this.retry, false, (o) => this.stubs.ledger.shards({ ownersOnly: true }, o), options, this.endpoints)
        .then((resp) => { if (resp.shards.some((s) => !s.owner)) this.router.route(ownerMap(resp)); })
        .catch((e: unknown) => { this.mapChecked = undefined; throw e; });
      await this.mapChecked;
      if (!this.router.on) return undefined;
    }
    return this.router.owning();
  }

  /** One page merged from each owner's own pages; the token keeps each owner's token and last run id given. */
  private async mergedPage(owners: Coordinator[], req: ListRunsRequest, options: CallOptions): Promise<RunPage> {
    const size = req.pageSize || 100;
    const home = this.router.home;
    const cursors = (req.pageToken ? parseMergedToken(req.pageToken) : owners.map((c): MergedCursor => ({ a: c === home ? "" : c.address, t: "" })))
      .map((m): ListCursor => ({
        c: this.router.coordinator(m.a) ?? home, address: m.a, token: m.t, next: m.t, buf: [], ...(m.l === undefined ? {} : { last: m.l }),
      }));
    let revision: number | undefined;
    const fetch = async (cur: ListCursor): Promise<void> => {
      // an owner's page may be asked again: skip what an earlier page gave
      while (!cur.buf.length && cur.next !== undefined) {
        cur.token = cur.next;
        const page = create(ListRunsRequestSchema, { ...req, pageToken: cur.token });
        const resp = cur.c === home ? await this.read((o) => home.stubs.ledger.listRuns(page, o), options)
          : await withRetry(this.retry, false, (o) => cur.c.stubs.ledger.listRuns(page, o), options, cur.c.endpoints);
        if (cur.c === home && revision === undefined) revision = toNumber(resp.revision);
        cur.buf = resp.runs.map(recordFromPb).filter((r) => cur.last === undefined || byteOrder(r.runId, cur.last) > 0);
        cur.next = resp.nextPageToken || undefined;
      }
    };
    await Promise.all(cursors.map(fetch)); // a bad filter or page size is refused here, even for an empty page
    const runs: RunRecord[] = [];
    while (runs.length < size) {
      await Promise.all(cursors.map(fetch));
      let least: ListCursor | undefined;
      for (const cur of cursors) if (cur.buf.length && (!least || byteOrder(cur.buf[0]!.runId, least.buf[0]!.runId) < 0)) least = cur;
      if (!least) break;
      const run = least.buf.shift()!;
      runs.push(run);
      // the same run from two addresses of one coordinator is given once
      for (const cur of cursors) {
        cur.last = run.runId; // every owner's rest sorts after it
        if (cur.buf[0]?.runId === run.runId) cur.buf.shift();
      }
    }
    const rest = cursors.flatMap((cur): MergedCursor[] =>
      cur.buf.length ? [{ a: cur.address, t: cur.token, l: cur.last }]
        : cur.next !== undefined ? [{ a: cur.address, t: cur.next, l: cur.last }] : []);
    if (revision === undefined) {
      revision = (await this.homePage(create(ListRunsRequestSchema, { ...req, pageSize: 1, pageToken: "" }), options)).revision;
    }
    return { runs, nextPageToken: rest.length ? MERGED_TOKEN + Buffer.from(JSON.stringify(rest)).toString("base64url") : "", revision };
  }

  /** Operator: cancel a run, fencing its worker. */
  async cancel(runId: string, message?: string, options: CallOptions = {}): Promise<RunRecord> {
    const resp = await this.command("cancel", { runId, ...(message === undefined ? {} : { message }) }, options);
    return recordFromPb(resp.run!);
  }

  /** Operator: make a suspended run (or one whose lease expired) queued again. */
  async requestResume(runId: string, options: CallOptions = {}): Promise<RunRecord> {
    const resp = await this.command("requestResume", { runId }, options);
    return recordFromPb(resp.run!);
  }

  /** Admin: hard-delete a run; its last token is kept so a later acquire continues above it. */
  async delete(runId: string, options: CallOptions = {}): Promise<{ revision: number; fencingToken: number }> {
    const resp = await this.command("deleteRun", { runId }, options);
    return { revision: toNumber(resp.revision), fencingToken: toNumber(resp.fencingToken) };
  }

  /** Whether `fencingToken` is still the run's current one (for downstream resources). */
  async validateFence(runId: string, fencingToken: number, options: CallOptions = {}): Promise<FenceStatus> {
    const resp = await this.read((o, stubs) =>
      stubs.ledger.validateFence({ runId, fencingToken: toBigInt(fencingToken, "fencing_token") }, o), options, runId);
    return {
      current: resp.current, found: resp.found, fencingToken: toNumber(resp.fencingToken),
      status: resp.found ? statusFromPb(resp.status) : undefined, revision: toNumber(resp.revision),
    };
  }

  /**
   * The shard map (docs/SPEC.md §13): the database's shard count and, per
   * shard, the coordinator that leads it, its epoch, and its runs and live
   * leases (the rows of shards another coordinator leads are asked of it).
   * `shardOf(key, map.shardCount)` places a key.
   */
  async shards(options: CallOptions = {}): Promise<ShardMap> {
    const resp = await this.read((o) => this.stubs.ledger.shards({}, o), options);
    // a coordinator answers only for the shards it leads: the others' rows are asked of their owners
    const others = [...new Set(resp.shards.filter((s) => !s.owner && s.address).map((s) => s.address))].sort();
    for (const address of others) {
      const there = this.router.coordinator(address);
      if (!there || there === this.router.home) continue;
      const theirs = await withRetry(this.retry, false, (o) => there.stubs.ledger.shards({}, o), options, there.endpoints);
      for (const s of theirs.shards) {
        if (s.owner && s.address === address && s.index >= 0 && s.index < resp.shards.length) resp.shards[s.index] = s;
      }
    }
    return {
      shardCount: resp.shardCount,
      shards: resp.shards.map(shardInfo),
      revision: toNumber(resp.revision),
    };
  }

  /**
   * Move `shard` to the coordinator advertised at `to`, where the
   * coordinators lead shards apart (`--lead-shards`, docs/SPEC.md §13).
   * Resolves with who led it when the move was stored; `shards()` shows it
   * arrive. Needs the operator role; a `ValidationError` names `shard` or `to`.
   */
  async moveShard(shard: number, to: string, options: CallOptions = {}): Promise<ShardInfo> {
    const resp = await this.read((o) => this.stubs.ledger.moveShard({ shard, to }, o), options);
    return shardInfo(resp.before ?? { index: shard, owner: "", address: "", epoch: 0n, runs: 0n, leases: 0n });
  }

  /**
   * Watch a fence without holding the lease: `listener.lost` is called (once)
   * when `runId`'s fence moves away from `fencingToken`, within milliseconds
   * of the commit that moved it. Returns a function that stops watching.
   */
  watchFence(runId: string, fencingToken: number | bigint, listener: FenceListener): () => void {
    this.router.track(runId, typeof fencingToken === "bigint" ? fencingToken : toBigInt(fencingToken, "fencing_token"), listener);
    return () => this.router.forget(runId, listener);
  }

  /**
   * Every committed change, as an async iterator. By revision (a
   * `fromRevision`, or one coordinator leading every shard): in revision
   * order, a dropped stream (or STREAM_TOO_SLOW) resumed from the last
   * revision received + 1, with no gap and no duplicate. By shards (a
   * `cursor`, or shards led by several coordinators): one stream per owner,
   * in order within each shard, each shard resumed after the last revision
   * delivered in it wherever it is led now. Throws RevisionCompactedError
   * when what it resumes from is no longer retained.
   */
  async *watchRuns(options: WatchOptions = {}): AsyncGenerator<RunChange, void, undefined> {
    const runIds = options.runIds ?? [];
    const { cursor, signal } = options;
    if (cursor !== undefined) {
      if (!(cursor instanceof WatchCursor)) throw new ValidationError("cursor: not a WatchCursor", { field: "cursor" });
      if (options.fromRevision) {
        throw new ValidationError("fromRevision: must be unset or 0 with a cursor (each shard resumes after the cursor's revision)",
          { field: "fromRevision" });
      }
      yield* watchByShards(this.watchHost(), cursor, runIds, await this.owners(signal), signal);
      return;
    }
    if (!options.fromRevision) {
      // shards led apart: revisions order changes only within a shard, so follow each shard's own
      const map = await this.owners(signal).catch(() => undefined);
      if (map && new Set(map.owners.filter((a) => a)).size > 1) {
        yield* watchByShards(this.watchHost(), new WatchCursor(), runIds, map, signal);
        return;
      }
    }
    let next = options.fromRevision;
    if (next === undefined || next === 0) {
      // Pin the start so a reconnect before the first change leaves no gap.
      const page = await this.homePage(create(ListRunsRequestSchema, { pageSize: 1 }), {});
      next = page.revision + 1;
    }
    const delay = backoffDelays(this.retry);
    while (!options.signal?.aborted) {
      try {
        const stream = this.stubs.ledger.watchRuns({ runIds, fromRevision: BigInt(next) },
          options.signal ? { signal: options.signal } : {});
        for await (const m of stream) {
          const change: RunChange = {
            revision: toNumber(m.revision), kind: m.kind === ChangeKind.DELETE ? "delete" : "put", runId: m.runId,
          };
          if (m.record) change.record = recordFromPb(m.record);
          next = change.revision + 1;
          yield change;
        }
      } catch (e) {
        if (options.signal?.aborted) return;
        const err: FencepostError = fromCallError(e);
        if (err instanceof RevisionCompactedError || !(err.grpcCode === Code.Unavailable || err instanceof StreamTooSlowError)) throw err;
      }
      if (options.signal?.aborted) return;
      await sleep(delay()).catch(() => undefined);
    }
  }
}
