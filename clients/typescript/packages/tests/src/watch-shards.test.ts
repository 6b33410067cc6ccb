// watchRuns by shards: a WatchCursor (one revision per shard) resumes a
// watch with exactly the changes it missed, on one SQLite server and across
// real `fencepost serve --lead-shards` coordinators on one real PostgreSQL
// (helpers/pg_coordinators.py); a watch there follows a shard moved under
// writes without losing or repeating a change.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import {
  FencepostClient, RevisionCompactedError, UnavailableError, ValidationError, WatchCursor, shardOf, type Lease, type RunChange, type WatchOptions,
} from "@fencepost/client";
import { startServer, type TestServer } from "@fencepost/client/testing";
import { Group, until } from "./pg-coordinators.js";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A watch read in the background into `seen` until `stop()`. */
class Watching {
  readonly seen: RunChange[] = [];
  error: unknown;
  private readonly ac = new AbortController();
  private readonly done: Promise<void>;

  constructor(client: FencepostClient, options: Omit<WatchOptions, "signal"> = {}) {
    const changes = client.watchRuns({ ...options, signal: this.ac.signal });
    this.done = (async () => {
      try {
        for await (const c of changes) this.seen.push(c);
      } catch (e) {
        this.error = e;
      }
    })();
  }

  /** The highest version of `runId` seen (0: none). */
  version(runId: string): number {
    return Math.max(0, ...this.seen.filter((c) => c.runId === runId).map((c) => c.record?.version ?? 0));
  }

  async stop(): Promise<void> {
    this.ac.abort();
    await this.done;
  }
}

/** `count` run ids `${prefix}-N`. */
const ids = (prefix: string, count: number) => Array.from({ length: count }, (_, i) => `${prefix}-${i}`);

/** Each run's current version, as the cluster answers it now. */
async function finals(client: FencepostClient, runIds: string[]): Promise<Map<string, number>> {
  return new Map(await Promise.all(runIds.map(async (r): Promise<[string, number]> => [r, (await client.get(r)).version])));
}

/**
 * Every run changed k times (version k now) was seen at versions 1..k, each
 * once, across `watches`; every change names its run's shard, and each
 * watch's changes come in revision order within each shard.
 */
function exactlyOnce(watches: Watching[], versions: Map<string, number>, shards: number): void {
  for (const w of watches) {
    const last = new Map<number, number>();
    for (const c of w.seen) {
      assert.equal(c.shard, shardOf(c.runId, shards), `${c.runId}'s shard`);
      assert.ok(c.revision > (last.get(c.shard!) ?? 0), `shard ${c.shard}: revision ${c.revision} after ${last.get(c.shard!)}`);
      last.set(c.shard!, c.revision);
    }
  }
  const all = watches.flatMap((w) => w.seen);
  for (const [runId, k] of versions) {
    const got = all.filter((c) => c.runId === runId).map((c) => c.record?.version ?? -1).sort((x, y) => x - y);
    assert.deepEqual(got, Array.from({ length: k }, (_, i) => i + 1), `${runId}: versions 1..${k} each once`);
  }
}

describe("WatchCursor's text form", () => {
  it("reads the shared vector back exactly and refuses anything else naming cursor", () => {
    const c = WatchCursor.decode("fpw1:0=17,3=16777230");
    assert.deepEqual([...c.revisions], [[0, 17], [3, 16777230]]);
    assert.equal(c.encode(), "fpw1:0=17,3=16777230");
    assert.equal(new WatchCursor([[3, 16777230], [0, 17]]).encode(), "fpw1:0=17,3=16777230", "shards ascending");
    assert.equal(new WatchCursor().encode(), "fpw1:");
    assert.equal(WatchCursor.decode("fpw1:").revisions.size, 0);
    const big = WatchCursor.decode(`fpw1:4095=${Number.MAX_SAFE_INTEGER}`);
    assert.equal(big.revisions.get(4095), Number.MAX_SAFE_INTEGER);
    for (const bad of [
      "", "fpw1", "fpw2:0=1", "FPW1:0=1", "0=17", "fpw1:0=17,", "fpw1:,0=17", "fpw1:0", "fpw1:0=", "fpw1:=17",
      "fpw1:a=1", "fpw1:0=x", "fpw1:-1=5", "fpw1:0=-5", "fpw1:0=1.5", "fpw1: 0=1", "fpw1:0=1,0=2", "fpw1:0=1;3=2",
      "fpw1:4096=1", `fpw1:0=${2 ** 53}`,
    ]) {
      assert.throws(() => WatchCursor.decode(bad), (e: unknown) => e instanceof ValidationError && e.field === "cursor", JSON.stringify(bad));
    }
  });
});

describe("watchRuns by shards on one server (SQLite)", () => {
  let server: TestServer;
  let client: FencepostClient;
  before(async () => {
    server = await startServer();
    client = new FencepostClient(server.address, { owner: "ts-ws" });
  });
  after(async () => {
    await client?.close();
    await server?.stop();
  });

  it("resumes from a saved cursor with exactly the changes it missed", async () => {
    const { shardCount } = await client.shards();
    // from a database never written to: every shard's cursor is 0, a real place to resume after
    const cursor = new WatchCursor();
    const first = new Watching(client, { cursor });
    const runs = ids("ts-ws-one", 12);
    const more = "ts-ws-one-new";
    let second: Watching | undefined;
    try {
      // the first message of the stream pins every shard's start
      await until(() => cursor.revisions.size === shardCount, 10_000, "every shard's start in the cursor");
      const leases = await Promise.all(runs.map((r) => client.acquire(r, { ttlMs: 60_000, renew: false })));
      for (const l of leases) await l.recordCheckpoint(`cp/${l.runId}`, 1);
      await until(() => runs.every((r) => first.version(r) === 2), 10_000, "versions 1-2 watched");
      await first.stop();
      assert.equal(first.error, undefined);
      const saved = cursor.encode();

      for (const l of leases) await l.recordCheckpoint(`cp/${l.runId}`, 2);
      for (const l of leases.slice(0, 6)) await l.finish();
      await client.acquire(more, { ttlMs: 60_000, renew: false });
      const resumed = WatchCursor.decode(saved);
      second = new Watching(client, { cursor: resumed });
      const want = await finals(client, [...runs, more]);
      await until(() => [...want].every(([r, v]) => second!.version(r) === v), 10_000, "the missed versions watched");
      exactlyOnce([first, second], want, shardCount);
      assert.ok(second.seen.every((c) => (c.record?.version ?? 0) > 2 || c.runId === more), "only what the first missed");
      for (const c of second.seen) assert.ok(resumed.revisions.get(c.shard!)! >= c.revision, "the cursor follows what was yielded");
      assert.equal(resumed.revisions.size, shardCount);
    } finally {
      await first.stop();
      await second?.stop();
    }
  });

  it("refuses a fromRevision beside a cursor, and a cursor shard the database does not have", async () => {
    const refused = async (options: WatchOptions) => {
      try {
        for await (const c of client.watchRuns(options)) assert.fail(`a change: ${c.runId}`);
      } catch (e) {
        return e;
      }
      return undefined;
    };
    const both = await refused({ cursor: new WatchCursor(), fromRevision: 5 });
    assert.ok(both instanceof ValidationError && both.field === "fromRevision", String(both));
    const { shardCount } = await client.shards();
    const beyond = await refused({ cursor: new WatchCursor([[shardCount, 1]]) });
    assert.ok(beyond instanceof ValidationError && beyond.field === "cursor", String(beyond));
  });
});

describe("watchRuns by shards past the retained history (SQLite)", () => {
  let server: TestServer;
  before(async () => { server = await startServer({ env: { FENCEPOST_HISTORY_REVISIONS: "5" } }); });
  after(async () => { await server?.stop(); });

  it("ends with RevisionCompactedError when a shard's changes after its cursor were pruned", async () => {
    const client = new FencepostClient(server.address, { owner: "ts-ws-pruned" });
    try {
      const lease = await client.acquire("ts-ws-pruned", { ttlMs: 60_000, renew: false });
      const shard = shardOf(lease.runId, (await client.shards()).shardCount);
      for (let k = 1; k <= 20; k++) await lease.recordCheckpoint("cp", k);
      const watch = new Watching(client, { cursor: new WatchCursor([[shard, 1]]) });
      await until(() => watch.error !== undefined, 10_000, "the watch ends");
      await watch.stop();
      assert.ok(watch.error instanceof RevisionCompactedError, String(watch.error));
      assert.equal(watch.error.metadata["shard"], String(shard));
      assert.deepEqual(watch.seen, []);
    } finally {
      await client.close();
    }
  });
});

/** Changes each lease's run (a checkpoint, 5 ms apart) until stopped, counting the writes answered. */
class Writers {
  readonly answered = new Map<string, number>();
  readonly failed: unknown[] = [];
  private stopped = false;
  private readonly loops: Promise<void>[];

  constructor(readonly leases: Lease[]) {
    this.loops = leases.map(async (l) => {
      for (let k = 1; !this.stopped && this.failed.length < 20; k++) {
        try {
          await l.recordCheckpoint("cp", k);
          this.answered.set(l.runId, (this.answered.get(l.runId) ?? 0) + 1);
        } catch (e) {
          this.failed.push(e);
        }
        await sleep(5);
      }
    });
  }

  /** The writes answered to these runs so far. */
  count(runIds: string[]): number { return runIds.reduce((n, r) => n + (this.answered.get(r) ?? 0), 0); }

  async stop(): Promise<void> {
    this.stopped = true;
    await Promise.all(this.loops);
  }

  /** A planned move fails no write: each is answered, at one owner or the other. */
  noneFailed(): void {
    assert.deepEqual(this.failed.map(String), [], "writes failed during the move");
  }

  /** Every failed write went unanswered (its coordinator was killed). */
  onlyUnanswered(): void {
    assert.ok(this.failed.every((e) => e instanceof UnavailableError), `a write refused: ${this.failed.join("; ")}`);
  }
}

let group: Group | undefined;
let skip: string | undefined;

describe("watchRuns across coordinators leading shards apart on PostgreSQL", { concurrency: false }, () => {
  before(async () => {
    const g = await Group.start();
    if (typeof g === "string") skip = g;
    else group = g;
  });
  after(async () => { await group?.stop(); });

  /**
   * Once `watch` shows a change in a shard of each coordinator named (a
   * change made before a stream opened is not watched, so each probe run is
   * changed until one shows); the probes' ids.
   */
  async function ready(watch: Watching, writer: FencepostClient, owners: string[], prefix: string, coordinators: string[]): Promise<string[]> {
    const n = group!.shards;
    const probes: string[] = [];
    for (const owner of coordinators) {
      const probe = await writer.acquire(ids(`${prefix}-probe`, 100).find((r) => owners[shardOf(r, n)] === owner)!, { ttlMs: 60_000, renew: false });
      probes.push(probe.runId);
      for (let k = 1; watch.version(probe.runId) === 0; k++) {
        assert.ok(k <= 100, `no change of ${probe.runId} watched`);
        await probe.recordCheckpoint("probe", k);
        await sleep(100);
      }
    }
    return probes;
  }

  it("resumes a stopped watch from its encoded cursor, at another coordinator, with exactly the changes it missed", async (t) => {
    if (!group) return t.skip(skip);
    const n = group.shards;
    const { owners, alive: [a, b] } = await group.balanced();
    const runs = ids("ts-wsr", 16);
    assert.deepEqual(new Set(runs.map((r) => owners[shardOf(r, n)])), new Set([a, b]), "both own some");
    const client = new FencepostClient(a!, { owner: "ts-wsr" });
    const other = new FencepostClient(b!, { owner: "ts-wsr-b" });
    const cursor = new WatchCursor();
    const first = new Watching(client, { cursor });
    let second: Watching | undefined;
    try {
      // each stream's first message pins its shards' starts
      await until(() => cursor.revisions.size === n, 15_000, "every shard's start in the cursor");
      const leases = await Promise.all(runs.map((r) => client.acquire(r, { ttlMs: 60_000, renew: false })));
      for (const l of leases) await l.recordCheckpoint(`cp/${l.runId}`, 1);
      await until(() => runs.every((r) => first.version(r) === 2), 15_000, "versions 1-2 watched");
      await first.stop();
      assert.equal(first.error, undefined);
      const saved = cursor.encode();

      // every run changed again, so a repeat of an earlier change would show before these
      for (const l of leases) await l.recordCheckpoint(`cp/${l.runId}`, 2);
      for (const l of leases.slice(0, 8)) await l.finish();
      const added = ids("ts-wsr-new", 4);
      for (const r of added) await client.acquire(r, { ttlMs: 60_000, renew: false });
      second = new Watching(other, { cursor: WatchCursor.decode(saved) });
      const want = await finals(client, [...runs, ...added]);
      await until(() => [...want].every(([r, v]) => second!.version(r) === v), 15_000, "the missed versions watched");
      exactlyOnce([first, second], want, n);
      assert.ok(second.seen.every((c) => (c.record?.version ?? 0) > 2 || added.includes(c.runId)), "only what the first missed");
      assert.deepEqual(new Set(second.seen.map((c) => owners[c.shard!])), new Set([a, b]), "changes of both coordinators' shards");
    } finally {
      await first.stop();
      await second?.stop();
      await Promise.all([client.close(), other.close()]);
    }
  });

  it("follows a SIGKILLed coordinator's shards to the one that takes them, every change once", async (t) => {
    if (!group) return t.skip(skip);
    const n = group.shards;
    const { owners, alive: [a, b] } = await group.balanced();
    const client = new FencepostClient(b!, { owner: "ts-wsk" }); // given the one killed
    const writer = new FencepostClient(a!, { owner: "ts-wsk-w" });
    const watch = new Watching(client);
    let writers: Writers | undefined;
    try {
      await ready(watch, writer, owners, "ts-wsk", [a!, b!]);
      const runs = ids("ts-wsk", 40);
      const onB = runs.filter((r) => owners[shardOf(r, n)] === b).slice(0, 3);
      const onA = runs.filter((r) => owners[shardOf(r, n)] === a).slice(0, 2);
      writers = new Writers(await Promise.all([...onB, ...onA].map((r) => writer.acquire(r, { ttlMs: 60_000, renew: false }))));
      await until(() => writers!.count(onB) >= 15, 15_000, "writes to the shards of the one killed");
      await group.kill(b!);
      const { owners: now } = await group.balanced();
      assert.deepEqual(now, Array(n).fill(a), "the survivor leads every shard");
      const taken = writers.count(onB);
      await until(() => writers!.count(onB) >= taken + 15, 20_000, "writes to those shards at the survivor");
      await writers.stop();
      writers.onlyUnanswered();
      for (const l of writers.leases) await l.finish();

      const want = await finals(writer, [...onB, ...onA]);
      await until(() => [...want].every(([r, v]) => watch.version(r) === v), 20_000, "every version watched");
      assert.equal(watch.error, undefined);
      exactlyOnce([watch], want, n);
      t.diagnostic(`${b} killed under ${taken} + ${writers.count(onB) - taken} writes to its shards (${writers.failed.length} `
        + `unanswered); ${watch.seen.length} changes watched`);
    } finally {
      await writers?.stop();
      await watch.stop();
      await Promise.all([client.close(), writer.close()]);
      await group.add(); // two coordinators again for the next test
    }
  });

  // last: the moved shard stays pinned where it was moved, so the shares stay uneven
  it("sees both coordinators' shards, and every change to a shard moved under writes exactly once", async (t) => {
    if (!group) return t.skip(skip);
    const n = group.shards;
    const { owners, alive: [a, b] } = await group.balanced();
    const client = new FencepostClient(a!, { owner: "ts-wsm" });
    const writer = new FencepostClient(a!, { owner: "ts-wsm-w" });
    const watch = new Watching(client); // no cursor: shards led by two coordinators are watched by shards
    let writers: Writers | undefined;
    try {
      const probes = await ready(watch, writer, owners, "ts-wsm", [a!, b!]);
      assert.deepEqual(probes.map((r) => watch.seen.find((c) => c.runId === r)?.shard), probes.map((r) => shardOf(r, n)),
        "each change names its shard");

      const shard = owners.indexOf(a!);
      const movers = ids("ts-wsm-mv", 400).filter((r) => shardOf(r, n) === shard).slice(0, 4);
      const rest = ids("ts-wsm-rest", 40).filter((r) => shardOf(r, n) !== shard);
      const elsewhere = [rest.find((r) => owners[shardOf(r, n)] === a)!, rest.find((r) => owners[shardOf(r, n)] === b)!];
      writers = new Writers(await Promise.all([...movers, ...elsewhere].map((r) => writer.acquire(r, { ttlMs: 60_000, renew: false }))));
      await until(() => writers!.count(movers) >= 20, 15_000, "writes to the shard before the move");
      await client.moveShard(shard, b!);
      await until(async () => (await client.shards()).shards[shard]!.address === b, 15_000, `shard ${shard} led at ${b}`);
      const moved = writers.count(movers);
      await until(() => writers!.count(movers) >= moved + 20, 20_000, "writes to the shard after the move");
      await writers.stop();
      writers.noneFailed();
      for (const l of writers.leases) await l.finish();

      const want = await finals(writer, [...movers, ...elsewhere]);
      await until(() => [...want].every(([r, v]) => watch.version(r) === v), 20_000, "every version watched");
      assert.equal(watch.error, undefined);
      exactlyOnce([watch], want, n);
      assert.deepEqual(new Set(watch.seen.map((c) => owners[c.shard!])), new Set([a, b]), "changes of both coordinators' shards");
      t.diagnostic(`shard ${shard} moved under ${moved} + ${writers.count(movers) - moved} writes to it (${writers.failed.length} unanswered); `
        + `${watch.seen.length} changes watched`);
    } finally {
      await writers?.stop();
      await watch.stop();
      await Promise.all([client.close(), writer.close()]);
    }
  });
});
