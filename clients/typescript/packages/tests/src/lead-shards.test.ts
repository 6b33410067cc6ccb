// The client over coordinators that lead shards apart: real `fencepost serve
// --lead-shards` processes on one real PostgreSQL (helpers/pg_coordinators.py
// --lead-shards, 8 shards, a 2 s shard lease renewed every 300 ms). A client
// given one coordinator sends each call to its shard's owner; leases held by
// TypeScript workers are kept when a coordinator is SIGKILLed or SIGTERMed
// and when an operator moves a shard, renewed at the shard's new owner.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import {
  FencepostClient, LeaseHeldError, NotOwnerError, ValidationError, fromCallError, recordFromPb, shardOf,
  type Lease, type LeaseLostError, type RunRecord,
} from "@fencepost/client";
import { diagnostics } from "@fencepost/client/testing";
import { FencepostRunStore } from "@fencepost/oma";
import { Group, until } from "./pg-coordinators.js";

/** The run as the coordinator at `address` has it (no routing), or the NotOwnerError it answers. */
async function at(address: string, runId: string): Promise<RunRecord | NotOwnerError> {
  const raw = new FencepostClient(address, { owner: "ts-raw", retry: { maxAttempts: 1 } });
  try {
    const { run } = await raw.stubs.ledger.getRun({ runId });
    return recordFromPb(run!);
  } catch (e) {
    const err = fromCallError(e);
    if (err instanceof NotOwnerError) return err;
    throw err;
  } finally {
    await raw.close();
  }
}

/** Every lost lease, as its `lost` promise reports it. */
function watchLost(leases: Lease[]): LeaseLostError[] {
  const lost: LeaseLostError[] = [];
  for (const l of leases) void l.lost.then((e) => lost.push(e));
  return lost;
}

let group: Group | undefined;
let skip: string | undefined;
before(async () => {
  const g = await Group.start();
  if (typeof g === "string") skip = g;
  else group = g;
});
after(async () => { await group?.stop(); });

describe("coordinators leading shards apart on PostgreSQL", { concurrency: false }, () => {
  /** `count` run ids `${prefix}-N`, spread over every shard. */
  const runs = (prefix: string, count: number) => Array.from({ length: count }, (_, i) => `${prefix}-${i}`);

  it("routes every call of a client given one coordinator to its shard's owner", async (t) => {
    if (!group) return t.skip(skip);
    const { owners, alive: [a, b] } = await group.balanced();
    const ids = runs("ts-ls-both", 24);
    assert.deepEqual(new Set(ids.map((r) => owners[shardOf(r, group!.shards)])), new Set([a, b]), "both own some");
    const client = new FencepostClient(a!, { owner: "ts-ls-w" });
    try {
      const leases = await Promise.all(ids.map((r) => client.acquire(r, { ttlMs: 30_000 })));
      for (const lease of leases) {
        await lease.renew();
        await lease.recordCheckpoint(`cp/${lease.runId}`, 1);
      }
      for (const lease of leases.slice(0, 12)) assert.equal((await lease.finish()).status, "completed");
      for (const r of ids) {
        const owner = owners[shardOf(r, group.shards)]!;
        const there = await at(owner, r);
        assert.ok(!(there instanceof NotOwnerError), `${r} is at its owner ${owner}`);
        assert.equal(there.checkpointRef?.key, `cp/${r}`);
        const elsewhere = await at(owner === a ? b! : a!, r);
        assert.ok(elsewhere instanceof NotOwnerError && elsewhere.owner === owner, `${r} is refused elsewhere`);
      }
      assert.deepEqual(diagnostics(client).coordinators.sort(), [a, b].sort());

      let map = await client.shards();
      assert.deepEqual(map.shards.map((s) => s.address), owners);
      assert.ok(map.shards.every((s) => s.owner !== ""), "every shard names its owner");
      // a count begun under a second ago may be answered again: asked until it shows this test's runs
      await until(async () => (map = await client.shards()).shards.reduce((n, s) => n + s.runs, 0) >= ids.length,
        10_000, `every owner counts its runs: ${JSON.stringify(map.shards)}`);
      const listed = (await client.listAll()).runs.map((r) => r.runId).filter((r) => r.startsWith("ts-ls-both-"));
      assert.deepEqual(listed.sort(), [...ids].sort(), "every run listed once");

      for (const lease of leases.slice(12)) assert.equal((await lease.finish()).status, "completed");
      for (const r of ids) assert.equal((await client.get(r)).status, "completed");
    } finally {
      await client.close();
    }
  });

  it("routes the oma RunStore's calls to each run's owner", async (t) => {
    if (!group) return t.skip(skip);
    const { owners, alive: [a, b] } = await group.balanced();
    const oma = await FencepostRunStore.connect(a!);
    const t0 = "2030-01-01T00:00:00.000Z";
    try {
      const ids = runs("ts-ls-oma", 8);
      assert.deepEqual(new Set(ids.map((r) => owners[shardOf(r, group!.shards)])), new Set([a, b]), "both own some");
      for (const runId of ids) {
        const rec = { schema: 1 as const, runId, version: 1, status: "queued" as const, attempt: 1, fencingToken: 1, createdAt: t0, updatedAt: t0 };
        assert.ok(await oma.create(rec));
        assert.ok(await oma.compareAndSet(runId, 1, { ...rec, version: 2, status: "running" }));
        assert.equal((await oma.get(runId))?.status, "running");
        const owner = owners[shardOf(runId, group.shards)]!;
        const there = await at(owner, runId);
        assert.ok(!(there instanceof NotOwnerError), `${runId} is at its owner ${owner}`);
      }
    } finally {
      await oma.close();
    }
  });

  for (const how of ["SIGKILL", "SIGTERM"] as const) {
    it(`keeps every lease when a coordinator goes (${how}) and another takes its shards`, async (t) => {
      if (!group) return t.skip(skip);
      const { owners, alive: [a, b] } = await group.balanced();
      const ids = runs(`ts-ls-${how}`, 20);
      const onB = ids.filter((r) => owners[shardOf(r, group!.shards)] === b);
      assert.ok(onB.length > 0 && onB.length < ids.length, "both own some");
      const ttlMs = 4000; // kept only by renewals answered once the survivor leads every shard
      const client = new FencepostClient(a!, { owner: `ts-ls-${how}` });
      const thief = new FencepostClient(a!, { owner: `ts-ls-${how}-thief` });
      try {
        const leases = await Promise.all(ids.map((r) => client.acquire(r, { ttlMs })));
        const lost = watchLost(leases);
        const acquired = performance.now();
        await until(() => leases.every((l) => l.safeUntil > acquired + ttlMs), 10_000, "a renewal of every lease");
        const gone = performance.now();
        if (how === "SIGKILL") await group.kill(b!);
        else assert.equal(await group.term(b!), 0);
        const { owners: now } = await group.balanced();
        assert.deepEqual(now, Array(group.shards).fill(a), "the survivor leads every shard");
        for (const r of ids) {
          const err = await thief.acquire(r, { ttlMs: 5000, renew: false }).then(() => undefined, (e: unknown) => e);
          assert.ok(err instanceof LeaseHeldError, `${r}: another owner is refused, got ${String(err)}`);
        }
        await until(() => leases.every((l) => l.safeUntil > gone + ttlMs), 20_000, "a renewal of every lease at the survivor");
        assert.deepEqual(lost, [], "no lease lost");
        for (const lease of leases) {
          assert.ok(lease.isActive, lease.runId);
          const done = await lease.finish();
          assert.deepEqual([done.status, done.fencingToken], ["completed", 1], lease.runId);
        }
      } finally {
        await Promise.all([client.close(), thief.close()]);
        await group.add(); // two coordinators again for the next test
      }
    });
  }

  // last: the moved shard stays pinned where it was moved, so the shares stay uneven
  it("moves one shard to the other coordinator with its leases kept", async (t) => {
    if (!group) return t.skip(skip);
    const { owners, alive: [a, b] } = await group.balanced();
    const shard = owners.indexOf(a!);
    const ids = runs("ts-ls-move", 200).filter((r) => shardOf(r, group!.shards) === shard).slice(0, 6);
    const ttlMs = 3000;
    const client = new FencepostClient(a!, { owner: "ts-ls-move" });
    try {
      const leases = await Promise.all(ids.map((r) => client.acquire(r, { ttlMs })));
      const lost = watchLost(leases);
      const nowhere = await client.moveShard(shard, "127.0.0.1:1").then(() => undefined, (e: unknown) => e);
      assert.ok(nowhere instanceof ValidationError && nowhere.field === "to", `got ${String(nowhere)}`);
      const tooBig = await client.moveShard(group.shards, b!).then(() => undefined, (e: unknown) => e);
      assert.ok(tooBig instanceof ValidationError && tooBig.field === "shard", `got ${String(tooBig)}`);
      assert.deepEqual(await group.owners(), owners, "a refused move moves nothing");

      const was = await client.moveShard(shard, b!);
      assert.deepEqual([was.index, was.address], [shard, a]);
      await until(async () => (await client.shards()).shards[shard]!.address === b, 15_000, `shard ${shard} led at ${b}`);
      assert.equal((await group.owners())[shard], b);
      const moved = performance.now();
      // past a ttl after the move: only renewals answered at the new owner keep them
      await until(() => leases.every((l) => l.safeUntil > moved + ttlMs) && performance.now() > moved + ttlMs, 15_000,
        "a ttl past the move, every lease renewed since");
      assert.deepEqual(lost, [], "no lease lost");
      for (const r of ids) {
        const there = await at(b!, r);
        assert.ok(!(there instanceof NotOwnerError) && there.lease?.owner === "ts-ls-move", `${r} is held at ${b}`);
        assert.ok(there.lease!.expiresAt.getTime() > Date.now(), `${r}'s lease is live`);
      }
      for (const lease of leases) assert.equal((await lease.finish()).status, "completed", lease.runId);
      assert.equal((await client.shards()).shards[shard]!.address, b, "the shard stays where it was moved");
    } finally {
      await client.close();
    }
  });
});
