// Routing by shard (docs/SPEC.md "Shards"): two real servers, each told by
// the test-only shard map (FENCEPOST_TEST_SHARD_MAP with --test-hooks) that
// it leads half of 4 shards, each over its own database. A call keyed in the
// other half is refused with NOT_OWNER naming its owner; the client routes.
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import type { Interceptor } from "@connectrpc/connect";
import { FencepostClient, NotOwnerError, ValidationError, fromCallError, shardOf, type RunRecord, type RunStatus } from "@fencepost/client";
import { diagnostics, freePort, startServer, type TestServer } from "@fencepost/client/testing";
import { FencepostRunStore } from "@fencepost/oma";
import { FencepostStore } from "@fencepost/chamvi";

const SHARDS = 4;

interface Pair { a: TestServer; b: TestServer; stop(): Promise<void> }

/** Two servers on ports picked first; `maps` gives each its own map (default both "A=0-1;B=2,3"). */
async function startPair(maps?: (a: string, b: string) => [string, string]): Promise<Pair> {
  const [pa, pb] = [await freePort(), await freePort()];
  const [addrA, addrB] = [`127.0.0.1:${pa}`, `127.0.0.1:${pb}`];
  const [mapA, mapB] = maps?.(addrA, addrB) ?? [`${addrA}=0-1;${addrB}=2,3`, `${addrA}=0-1;${addrB}=2,3`];
  const start = (port: number, map: string) =>
    startServer({ port, args: ["--shards", String(SHARDS)], env: { FENCEPOST_TEST_SHARD_MAP: map } });
  const [a, b] = await Promise.all([start(pa, mapA), start(pb, mapB)]);
  return { a, b, async stop() { await Promise.all([a.stop(), b.stop()]); } };
}

/** `count` distinct keys `${prefix}-N` whose shard is `shard`. */
function keysIn(shard: number, prefix: string, count = 1): string[] {
  const out: string[] = [];
  for (let i = 0; out.length < count; i++) if (shardOf(`${prefix}-${i}`, SHARDS) === shard) out.push(`${prefix}-${i}`);
  return out;
}

describe("NOT_OWNER", () => {
  let pair: Pair;
  before(async () => { pair = await startPair(); });
  after(async () => { await pair.stop(); });

  it("is a NotOwnerError naming the shard, its owner and epoch", async () => {
    const raw = new FencepostClient(pair.b.address, { owner: "ts-raw" });
    try {
      const [runId] = keysIn(1, "ts-err");
      const thrown = await raw.stubs.ledger.getRun({ runId: runId! }).then(() => undefined, (e: unknown) => e);
      const err = fromCallError(thrown);
      assert.ok(err instanceof NotOwnerError, `got ${String(err)}`);
      assert.equal(err.code, "NOT_OWNER");
      assert.equal(err.shard, 1);
      assert.equal(err.owner, pair.a.address);
      assert.equal(err.epoch, 1);
    } finally {
      await raw.close();
    }
  });
});

/** The run as the server at `address` has it (a raw stub: no routing), or the NotOwnerError it answers. */
async function at(address: string, runId: string): Promise<RunRecord | NotOwnerError> {
  const raw = new FencepostClient(address, { owner: "ts-raw", retry: { maxAttempts: 1 } });
  try {
    const { run } = await raw.stubs.ledger.getRun({ runId });
    const { recordFromPb } = await import("@fencepost/client");
    return recordFromPb(run!);
  } catch (e) {
    const err = fromCallError(e);
    if (err instanceof NotOwnerError) return err;
    throw err;
  } finally {
    await raw.close();
  }
}

/** Counts the Shards calls a client makes (an interceptor sees every call, on every connection). */
function countShards(): { interceptors: Interceptor[]; count: () => number } {
  let n = 0;
  return {
    interceptors: [(next) => (req) => { if (req.method.name === "Shards") n++; return next(req); }],
    count: () => n,
  };
}

/** Poll `ok` every 25 ms until it holds (at most `ms`). */
async function until(ok: () => boolean | Promise<boolean>, ms: number, what: string): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await ok())) {
    if (Date.now() > deadline) throw new Error(`not within ${ms} ms: ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

describe("routing by shard", () => {
  let pair: Pair;
  before(async () => { pair = await startPair(); });
  after(async () => { await pair.stop(); });

  for (const transport of ["stream", "unary"] as const) {
    it(`runs every shard's runs on its owner, given only one coordinator (${transport})`, async () => {
      const client = new FencepostClient(pair.b.address, { owner: `ts-route-${transport}`, transport });
      try {
        const runs = [0, 1, 2, 3].map((s) => keysIn(s, `ts-life-${transport}`)[0]!);
        for (const runId of runs) {
          const lease = await client.acquire(runId, { ttlMs: 30_000 });
          await lease.renew();
          await lease.recordCheckpoint(`cp/${runId}`, 1);
          const done = await lease.finish("completed");
          assert.equal(done.status, "completed");
          assert.equal(done.checkpointRef?.key, `cp/${runId}`);
          assert.equal((await client.get(runId)).status, "completed");
        }
        for (const [i, runId] of runs.entries()) {
          const [owner, other] = i < 2 ? [pair.a, pair.b] : [pair.b, pair.a];
          const there = await at(owner.address, runId);
          assert.ok(!(there instanceof NotOwnerError), `${runId} (shard ${i}) is at ${owner.address}`);
          assert.equal(there.status, "completed");
          const elsewhere = await at(other.address, runId);
          assert.ok(elsewhere instanceof NotOwnerError && elsewhere.owner === owner.address);
        }
        assert.deepEqual(diagnostics(client).coordinators.sort(), [pair.a.address, pair.b.address].sort());
      } finally {
        await client.close();
      }
    });
  }

  it("renews a lease in the other coordinator's shard on that coordinator's KeepAlive stream", async () => {
    const client = new FencepostClient(pair.b.address, { owner: "ts-route-renew" });
    try {
      const [runId] = keysIn(0, "ts-renew");
      const lease = await client.acquire(runId!, { ttlMs: 1500 });
      const first = lease.record.lease!.expiresAt.getTime();
      // renewed every 500 ms: A's record moves on, and the lease stays safe throughout
      await until(async () => {
        const r = await at(pair.a.address, runId!);
        return !(r instanceof NotOwnerError) && r.lease!.expiresAt.getTime() >= first + 1500;
      }, 10_000, "A's record shows renewals");
      assert.ok(!lease.atRisk && lease.isActive, "the lease is safe");
      assert.equal((await lease.finish()).status, "completed");
    } finally {
      await client.close();
    }
  });

  it("routes the engine store's writes, reads and transactions to each key's owner", async () => {
    const client = new FencepostClient(pair.b.address, { owner: "ts-route-store" });
    try {
      const store = client.store;
      const agents = [0, 1, 2, 3].map((s) => {
        for (let i = 0; ; i++) if (shardOf(`ts-ag${i}\x1fk`, SHARDS) === s) return `ts-ag${i}`;
      });
      for (const agent of agents) {
        await store.kvSet(agent, "k", { agent });
        assert.deepEqual((await store.kvGet(agent, "k")).value, { agent });
      }
      for (const s of [0, 1, 2, 3]) {
        const [id] = keysIn(s, "ts-erun");
        assert.ok((await store.createRun({ id: id!, agent: "ts", status: "queued" })).created);
        await store.appendStep({ runId: id!, name: "one" });
        await store.transaction((tx) => {
          tx.appendStep({ runId: id!, name: "two" });
          tx.saveCheckpoint({ runId: id!, stepIndex: 2, state: { s } });
        });
        assert.deepEqual((await store.listSteps(id!)).map((x) => x.name), ["one", "two"]);
        assert.deepEqual((await store.latestCheckpoint(id!))?.state, { s });
        await store.putArtifact({ id: `${id}-blob`, runId: id! }, new Uint8Array([s]));
        assert.deepEqual((await store.listArtifacts(id!)).map((a) => a.id), [`${id}-blob`]);
        const owner = s < 2 ? pair.a : pair.b;
        const raw = new FencepostClient(owner.address, { owner: "ts-raw" });
        try {
          assert.equal((await raw.stubs.engineStore.getRun({ id: id! })).found, true, `${id} is at its owner`);
        } finally {
          await raw.close();
        }
      }
    } finally {
      await client.close();
    }
  });

  it("routes the oma and chamvi adapters' calls to each run's owner", async () => {
    const oma = await FencepostRunStore.connect(pair.b.address);
    const chamvi = await FencepostStore.connect(pair.b.address);
    const t0 = "2030-01-01T00:00:00.000Z";
    try {
      for (const s of [0, 1, 2, 3]) {
        const owner = s < 2 ? pair.a : pair.b;
        const [runId, engineId] = [keysIn(s, "ts-oma")[0]!, keysIn(s, "ts-chamvi")[0]!];
        const rec = { schema: 1 as const, runId, version: 1, status: "queued" as const, attempt: 1, fencingToken: 1, createdAt: t0, updatedAt: t0 };
        assert.ok(await oma.create(rec));
        assert.ok(await oma.compareAndSet(runId, 1, { ...rec, version: 2, status: "running" }));
        assert.equal((await oma.get(runId))?.status, "running");
        const there = await at(owner.address, runId);
        assert.ok(!(there instanceof NotOwnerError), `${runId} is at ${owner.address}`);
        await oma.delete!(runId);
        assert.equal(await oma.get(runId), null);

        assert.ok(await chamvi.createRun({ id: engineId, agent: "ts", status: "queued" }));
        assert.ok(await chamvi.claimRun(engineId, "w", 30_000));
        await chamvi.appendStep({ runId: engineId, name: "one" });
        assert.deepEqual((await chamvi.listSteps(engineId)).map((x) => x.name), ["one"]);
        assert.equal((await chamvi.getRun(engineId))?.claim?.owner, "w");
        const raw = new FencepostClient(owner.address, { owner: "ts-raw" });
        try {
          assert.equal((await raw.stubs.engineStore.getRun({ id: engineId })).found, true, `${engineId} is at its owner`);
        } finally {
          await raw.close();
        }
      }
    } finally {
      await oma.close();
      await chamvi.close();
    }
  });

  it("places every store call by the server's shard keys: once the map is known, none is refused", async () => {
    const calls: string[] = [];
    const seen: Interceptor = (next) => (req) => { calls.push(req.method.name); return next(req); };
    const client = new FencepostClient(pair.b.address, { owner: "ts-route-place", transport: "unary", interceptors: [seen] });
    const store = client.store;
    // each part of a compound key alone is in B's shards, the whole in A's: a wrong key shows
    const bs = (k: string) => shardOf(k, SHARDS) >= 2;
    const first = (prefix: string, whole: (x: string) => string): string => {
      for (let i = 0; ; i++) if (bs(`${prefix}${i}`) && shardOf(whole(`${prefix}${i}`), SHARDS) === 0) return `${prefix}${i}`;
    };
    const sep = "\x1f";
    const k = keysIn(2, "k")[0]!;
    try {
      await client.get(keysIn(0, "ts-warm")[0]!).catch(() => undefined); // the first refusal: the map is fetched
      const id = keysIn(0, "ts-place")[0]!;
      const lock = keysIn(0, "ts-lock")[0]!;
      const [scope, agent] = [first("sc", (x) => `${x}${sep}${k}`), first("ag", (x) => `${x}${sep}${k}`)];
      const coll = first("co", (x) => `${agent}${sep}${x}`);
      const token = (await store.acquireLock(lock, "w", 30_000)).fencingToken;
      const steps: [string, () => Promise<unknown>][] = [
        ["CreateRun", () => store.createRun({ id, agent: "ts", status: "queued" })],
        ["UpdateRun", () => store.updateRun(id, { status: "running" })],
        ["ClaimRun", () => store.claimRun(id, "w", 30_000)],
        ["RenewClaim", () => store.renewClaim(id, "w", 30_000)],
        ["AppendStep", () => store.appendStep({ runId: id, name: "s" })],
        ["SaveCheckpoint", () => store.saveCheckpoint({ runId: id, stepIndex: 1, state: 1 })],
        ["ClaimKey", () => store.claimKey(scope, k, id, 30_000)],
        ["PutEffect", () => store.putEffect(lock, 1, { fence: { lockKey: lock, fencingToken: token } })],
        ["KvSet", () => store.kvSet(agent, k, 1)],
        ["DocUpsert", () => store.docUpsert(agent, coll, "d", { a: 1 })],
        ["GetRun", () => store.getRun(id)],
        ["ListSteps", () => store.listSteps(id)],
        ["LatestCheckpoint", () => store.latestCheckpoint(id)],
        ["GetEffect", () => store.getEffect(lock)],
        ["KvGet", () => store.kvGet(agent, k)],
        ["DocList", () => store.docList(agent, coll)],
        ["ListArtifacts", () => store.listArtifacts(id)],
        ["DocDelete", () => store.docDelete(agent, coll, "d")],
        ["ReleaseLock", () => store.releaseLock(lock, "w")],
      ];
      for (const [method, call] of steps) {
        calls.length = 0;
        await call();
        assert.deepEqual(calls, [method], `${method} went straight to its owner`);
      }
    } finally {
      await client.close();
    }
  });

  it("gathers the map's counts from each shard's owner", async () => {
    const client = new FencepostClient(pair.b.address, { owner: "ts-route-map" });
    try {
      const runs = [0, 1, 2, 3].flatMap((s) => keysIn(s, "ts-map", s + 1));
      const leases = await Promise.all(runs.map((id) => client.acquire(id, { ttlMs: 60_000 })));
      // every count is its owner's own: the runs this test made, plus any earlier test's in that shard
      // (a coordinator may answer a count begun under a second ago: asked again until it is newer)
      let map = await client.shards();
      const counted = () => [0, 1, 2, 3].every((s) => map.shards[s]!.runs >= s + 1 && map.shards[s]!.leases >= s + 1);
      await until(async () => counted() || (map = await client.shards(), counted()), 10_000,
        `each owner counts its runs: ${JSON.stringify(map.shards)}`);
      assert.deepEqual(map.shards.map((s) => s.address), [pair.a.address, pair.a.address, pair.b.address, pair.b.address]);
      assert.ok(map.shards.every((s) => s.owner !== ""), "every row names its owner");
      await Promise.all(leases.map((l) => l.release()));
    } finally {
      await client.close();
    }
  });

  it("sends no Shards call until a call is refused with NOT_OWNER, then fetches the map once", async () => {
    const shards = countShards();
    const client = new FencepostClient(pair.b.address, { owner: "ts-route-quiet", interceptors: shards.interceptors });
    try {
      for (const runId of keysIn(2, "ts-quiet", 3).concat(keysIn(3, "ts-quiet", 3))) await (await client.acquire(runId)).finish();
      assert.equal(shards.count(), 0, "one coordinator's shards: no map asked for");
      assert.deepEqual(diagnostics(client).coordinators, [pair.b.address]);
      for (const runId of keysIn(0, "ts-loud", 3)) await (await client.acquire(runId)).finish();
      assert.equal(shards.count(), 1, "the first NOT_OWNER fetched the map, and it served the rest");
    } finally {
      await client.close();
    }
  });
});

/** Sorted as the server sorts run ids: by code point (their UTF-8 bytes), not by UTF-16 unit. */
function byCodePoint(a: string, b: string): number {
  const [x, y] = [Array.from(a, (c) => c.codePointAt(0)!), Array.from(b, (c) => c.codePointAt(0)!)];
  for (let i = 0; i < x.length && i < y.length; i++) if (x[i] !== y[i]) return x[i]! - y[i]!;
  return x.length - y.length;
}

/** Every run of `client.list` read page by page at `pageSize`. */
async function listPaged(client: FencepostClient, options: { statuses?: RunStatus[]; pageSize: number }): Promise<string[]> {
  const ids: string[] = [];
  let pageToken = "";
  for (let pages = 0; pages < 1000; pages++) {
    const page = await client.list({ ...options, pageToken });
    assert.ok(page.runs.length <= options.pageSize, `a page holds at most ${options.pageSize}`);
    ids.push(...page.runs.map((r) => r.runId));
    pageToken = page.nextPageToken;
    if (!pageToken) return ids;
  }
  throw new Error("list never ended");
}

describe("listing runs led by several coordinators", () => {
  let pair: Pair;
  before(async () => { pair = await startPair(); });
  after(async () => { await pair.stop(); });

  it("gathers every owner's runs, once each, in the server's order, with filters and small pages", async () => {
    const client = new FencepostClient(pair.b.address, { owner: "ts-list" });
    const shards = countShards();
    const fresh = new FencepostClient(pair.b.address, { owner: "ts-list-fresh", interceptors: shards.interceptors });
    try {
      // U+FF5E sorts before U+1F600 by code point, after it by UTF-16 unit
      const ids = [0, 1, 2, 3].flatMap((s) => ["ts-list-a", "ts-list-\uff5e", "ts-list-\u{1f600}"].flatMap((p) => keysIn(s, p, 2)));
      const failed = new Set(ids.filter((_, i) => i % 3 === 1));
      for (const runId of ids) await (await client.acquire(runId)).finish(failed.has(runId) ? "failed" : "completed", { code: "t" });
      const all = [...ids].sort(byCodePoint);
      const wide = all.filter((id) => id.includes("\uff5e")).pop()!;
      assert.ok(all.indexOf(wide) < all.findIndex((id) => id.includes("\u{1f600}")), "by code point");
      const ours = (got: string[]) => got.filter((id) => id.startsWith("ts-list-"));
      for (const c of [client, fresh]) {
        const listed = await c.listAll();
        assert.deepEqual(ours(listed.runs.map((r) => r.runId)), all);
        assert.deepEqual(listed.runs.map((r) => r.runId), [...listed.runs.map((r) => r.runId)].sort(byCodePoint));
        assert.deepEqual(ours((await c.listAll({ statuses: ["failed"], pageSize: 2 })).runs.map((r) => r.runId)),
          all.filter((id) => failed.has(id)));
        assert.deepEqual(ours(await listPaged(c, { pageSize: 3 })), all);
        assert.deepEqual(ours(await listPaged(c, { statuses: ["completed"], pageSize: 2 })), all.filter((id) => !failed.has(id)));
      }
      const bad = await fresh.list({ pageToken: "not-a-token" }).then(() => undefined, (e: unknown) => e);
      assert.ok(bad instanceof ValidationError && bad.field === "page_token", `got ${String(bad)}`);
      const tooBig = await fresh.list({ pageSize: 5000 }).then(() => undefined, (e: unknown) => e);
      assert.ok(tooBig instanceof ValidationError && tooBig.field === "page_size", `got ${String(tooBig)}`);
      assert.equal(shards.count(), 1, "the fresh client asked for the map once");
      assert.deepEqual(diagnostics(fresh).coordinators.sort(), [pair.a.address, pair.b.address].sort());
    } finally {
      await Promise.all([client.close(), fresh.close()]);
    }
  });

  it("lists one coordinator's runs as before, after asking its map once", async () => {
    const server = await startServer();
    const shards = countShards();
    const client = new FencepostClient(server.address, { owner: "ts-list-one", interceptors: shards.interceptors });
    try {
      for (const runId of ["ts-one-b", "ts-one-a"]) await (await client.acquire(runId)).finish();
      assert.deepEqual((await client.listAll()).runs.map((r) => r.runId), ["ts-one-a", "ts-one-b"]);
      assert.deepEqual(await listPaged(client, { pageSize: 1 }), ["ts-one-a", "ts-one-b"]);
      assert.equal(shards.count(), 1, "no routing needed: the map was asked once");
      assert.deepEqual(diagnostics(client).coordinators, [server.address]);
    } finally {
      await client.close();
      await server.stop();
    }
  });
});

describe("two coordinators naming each other", () => {
  let pair: Pair;
  // A says shards 2 and 3 are B's; B says they are A's
  before(async () => { pair = await startPair((a, b) => [`${a}=0-1;${b}=2,3`, `${b}=0-1;${a}=2,3`]); });
  after(async () => { await pair.stop(); });

  it("ends in NotOwnerError after a bounded number of hops", async () => {
    const client = new FencepostClient(pair.b.address, { owner: "ts-route-loop" });
    try {
      const [runId] = keysIn(2, "ts-loop");
      const err = await client.acquire(runId!).then(() => undefined, (e: unknown) => e);
      assert.ok(err instanceof NotOwnerError, `got ${String(err)}`);
      assert.equal(err.shard, 2);
      assert.match(err.message, /hops/);
    } finally {
      await client.close();
    }
  });
});

describe("a shard that moves under a lease", () => {
  it("re-tracks the lease at the new owner when a renewal is refused with NOT_OWNER, and never loses it", async () => {
    const dir = mkdtempSync(join(tmpdir(), "fencepost-ts-move-"));
    const [pa, pa2, pb] = [await freePort(), await freePort(), await freePort()];
    const [a, a2, b] = [`127.0.0.1:${pa}`, `127.0.0.1:${pa2}`, `127.0.0.1:${pb}`];
    const serve = (port: number, map: string, db?: string) =>
      startServer({ port, args: ["--shards", String(SHARDS)], env: { FENCEPOST_TEST_SHARD_MAP: map }, ...(db ? { db } : {}) });
    const before = `${a}=0-1;${b}=2,3`;
    const servers: TestServer[] = [];
    const client = new FencepostClient(b, { owner: "ts-route-move" });
    try {
      const dbA = join(dir, "a.db");
      const [sa, sb] = await Promise.all([serve(pa, before, dbA), serve(pb, before)]);
      servers.push(sb);
      const [runId] = keysIn(0, "ts-move");
      const lease = await client.acquire(runId!, { ttlMs: 9000 });
      // shard 0 (and A's database) moves to a coordinator at another address; A's address now leads shard 1 only
      await sa.stop();
      const after = `${a2}=0;${a}=1;${b}=2,3`;
      servers.push(await serve(pa2, after, dbA), await serve(pa, after));
      const moved = performance.now();
      await until(() => diagnostics(client).coordinators.includes(a2) && lease.safeUntil > moved + 9000, 20_000,
        "a renewal answered at the new owner");
      assert.ok(lease.isActive && !lease.atRisk, "the lease was never lost nor at risk");
      const there = await at(a2, runId!);
      assert.ok(!(there instanceof NotOwnerError) && there.lease!.owner === "ts-route-move");
      assert.equal((await lease.finish()).status, "completed");
    } finally {
      await client.close();
      await Promise.all(servers.map((s) => s.stop()));
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe("a coordinator that goes away", () => {
  it("follows its shards, leases and calls, to the coordinator the map names now", async () => {
    const dir = mkdtempSync(join(tmpdir(), "fencepost-ts-gone-"));
    const [pa, pa2, pb] = [await freePort(), await freePort(), await freePort()];
    const [a, a2, b] = [`127.0.0.1:${pa}`, `127.0.0.1:${pa2}`, `127.0.0.1:${pb}`];
    const [dbA, dbB] = [join(dir, "a.db"), join(dir, "b.db")];
    const serve = (port: number, map: string, db: string) =>
      startServer({ port, args: ["--shards", String(SHARDS)], env: { FENCEPOST_TEST_SHARD_MAP: map }, db });
    const servers: TestServer[] = [];
    const worker = new FencepostClient(b, { owner: "ts-route-gone" });
    const reader = new FencepostClient(b, { owner: "ts-route-gone-reader" });
    try {
      const before = `${a}=0-1;${b}=2,3`;
      const [sa, sb] = await Promise.all([serve(pa, before, dbA), serve(pb, before, dbB)]);
      const [leased, read] = [keysIn(0, "ts-gone")[0]!, keysIn(1, "ts-gone")[0]!];
      const lease = await worker.acquire(leased, { ttlMs: 9000 });
      await (await worker.acquire(read)).finish();
      assert.equal((await reader.get(read)).status, "completed"); // the reader routes to A too
      // A is gone; its database is served at another address, and B's map says so
      await Promise.all([sa.stop(), sb.stop()]);
      const after = `${a2}=0-1;${b}=2,3`;
      servers.push(...await Promise.all([serve(pa2, after, dbA), serve(pb, after, dbB)]));
      const moved = performance.now();
      await until(() => diagnostics(worker).coordinators.includes(a2) && lease.safeUntil > moved + 9000, 20_000,
        "the lease renewed at the coordinator now leading its shard");
      assert.ok(lease.isActive && !lease.atRisk, "the lease was never lost nor at risk");
      assert.equal((await reader.get(read, { timeoutMs: 8000 })).status, "completed");
      assert.ok(diagnostics(reader).coordinators.includes(a2));
      assert.equal((await lease.finish()).status, "completed");
    } finally {
      await Promise.all([worker.close(), reader.close()]);
      await Promise.all(servers.map((s) => s.stop()));
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
