// The client across real failovers: two `fencepost serve` coordinators on
// one real PostgreSQL (helpers/pg_coordinators.py), the leader SIGKILLed or
// SIGSTOPped while TypeScript workers hold a lease, watch, and run whole
// lifecycles (acquire, checkpoint, finish) with commands in flight. Every
// lifecycle completes, each command is applied once (token 1, attempt 1),
// no lease is lost, and the watch goes on with no gap and no duplicate.
import assert from "node:assert/strict";
import type { ChildProcessWithoutNullStreams } from "node:child_process";
import { createInterface, type Interface } from "node:readline";
import { after, before, describe, it } from "node:test";
import { FencepostClient, LeaseLostError, type Lease } from "@fencepost/client";
import { startCoordinators } from "./pg-coordinators.js";

const BURST = 20; // acquires in flight when the leader dies
const WORKERS = 4; // lifecycles running through the failover
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function until(predicate: () => boolean, what: string, withinMs: number): Promise<void> {
  const deadline = performance.now() + withinMs;
  while (!predicate()) {
    assert.ok(performance.now() < deadline, `timed out waiting for ${what}`);
    await sleep(20);
  }
}

/** Two coordinators on one fresh PostgreSQL database, driven over the helper's stdin. */
class Group {
  private lines: Interface;
  private waiting: ((line: string) => void)[] = [];
  private constructor(private readonly child: ChildProcessWithoutNullStreams, readonly endpoints: string[]) {
    this.lines = createInterface({ input: child.stdout });
    this.lines.on("line", (l) => this.waiting.shift()?.(l));
  }

  static async start(): Promise<Group | string> {
    const { child, first } = await startCoordinators([]);
    const msg = JSON.parse(first) as { endpoints?: string[]; skip?: string };
    if (msg.skip) return msg.skip;
    return new Group(child, msg.endpoints!);
  }

  private ask<T>(command: string): Promise<T> {
    return new Promise<T>((resolve) => {
      this.waiting.push((l) => resolve(JSON.parse(l) as T));
      this.child.stdin.write(command + "\n");
    });
  }

  leader(): Promise<{ address: string; pid: number }> { return this.ask("leader"); }
  revive(): Promise<object> { return this.ask("revive"); }
  exitCode(address: string): Promise<{ code: number | null }> { return this.ask(`exitcode ${address}`); }

  async stop(): Promise<void> {
    const done = new Promise((r) => this.child.once("exit", r));
    this.child.stdin.end();
    await done;
  }
}

/** One worker's lifecycles, one after another until `stop`: acquire, checkpoint, finish. */
async function lifecycles(client: FencepostClient, worker: string, stop: () => boolean, done: string[]): Promise<void> {
  for (let i = 0; !stop(); i++) {
    const runId = `life-${worker}-${i}`;
    const lease = await client.acquire(runId, { ttlMs: 60_000 });
    await lease.recordCheckpoint(`ckpt/${runId}/1`, 1);
    await lease.finish("completed");
    done.push(runId);
  }
}

async function checkApplied(client: FencepostClient, runIds: string[]): Promise<void> {
  for (const id of runIds) {
    const rec = await client.get(id);
    assert.equal(rec.status, "completed", id);
    assert.deepEqual([rec.fencingToken, rec.attempt], [1, 1], `${id}: applied once`);
    assert.equal(rec.checkpointRef?.key, `ckpt/${id}/1`);
  }
}

let group: Group | undefined;
let skip: string | undefined;
before(async () => {
  const g = await Group.start();
  if (typeof g === "string") skip = g;
  else group = g;
});
after(async () => { await group?.stop(); });

describe("failover on PostgreSQL", { concurrency: false }, () => {
  it("keeps every lease and lifecycle when the leader is killed", async (t) => {
    if (!group) return t.skip(skip);
    await group.revive();
    const leader = await group.leader();
    const standby = group.endpoints.find((a) => a !== leader.address)!;
    const ttlMs = 6000; // must be renewed on the new leader to survive
    const client = new FencepostClient(group.endpoints, { owner: "worker", retry: { totalTimeoutMs: 20_000 } });
    const seen: number[] = [];
    const watch = new AbortController();
    try {
      const lease = await client.acquire("held", { ttlMs });
      assert.equal(client.address, leader.address);
      const watcher = (async () => {
        for await (const ev of client.watchRuns({ fromRevision: 1, signal: watch.signal })) seen.push(ev.revision);
      })();
      const renewed = lease.safeUntil;
      await until(() => lease.safeUntil > renewed, "a renewal on the old leader", 10_000);
      let stopping = false;
      const done: string[] = [];
      const workers = Array.from({ length: WORKERS }, (_, w) => lifecycles(client, `k${w}`, () => stopping, done));
      await until(() => done.length >= WORKERS, "lifecycles under way", 10_000);
      const burst = Array.from({ length: BURST }, (_, i) => client.acquire(`burst-${i}`, { ttlMs: 60_000 }));
      await Promise.resolve(); // on their way
      const killedAt = performance.now();
      process.kill(leader.pid, "SIGKILL");

      const rec = await lease.recordCheckpoint("ckpt/held/1", 1);
      assert.equal(client.address, standby);
      assert.equal(rec.fencingToken, 1);
      const before = done.length;
      await until(() => done.length >= before + WORKERS, "lifecycles on the new leader", 15_000);
      stopping = true;
      await Promise.all(workers);

      const leases = await Promise.all(burst);
      assert.deepEqual(leases.map((x) => [x.fencingToken, x.record.attempt]), Array(BURST).fill([1, 1]));
      await checkApplied(client, done);

      await until(() => lease.safeUntil > killedAt + ttlMs, "a renewal on the new leader", 15_000);
      assert.ok(lease.isActive && !lease.isLost);
      const now = await client.get("held");
      assert.equal(now.lease?.owner, "worker");
      assert.equal(now.fencingToken, 1);

      const last = (await client.listAll()).revision;
      await until(() => seen.length > 0 && seen[seen.length - 1]! >= last, "the watch to catch up", 10_000);
      assert.deepEqual(seen.slice(0, last), Array.from({ length: last }, (_, i) => i + 1));
      await lease.finish();
      for (const x of leases) await x.release();
      watch.abort();
      await watcher;
    } finally {
      watch.abort();
      await client.close();
    }
  });

  it("moves KeepAlive off a frozen leader once a renewal goes unanswered for a third of the ttl", async (t) => {
    if (!group) return t.skip(skip);
    await group.revive();
    const leader = await group.leader();
    const standby = group.endpoints.find((a) => a !== leader.address)!;
    const ttlMs = 9000;
    // no pings: only the unanswered renewal can tell the stream that its coordinator is gone
    const client = new FencepostClient(group.endpoints, { owner: "worker", transport: "unary", keepalive: false });
    try {
      const lease = await client.acquire(`frozen-ka-${leader.pid}`, { ttlMs });
      const renewed = lease.safeUntil;
      await until(() => lease.safeUntil > renewed, "a renewal on the old leader", 10_000);
      process.kill(leader.pid, "SIGSTOP");
      const frozenAt = performance.now();
      try {
        await until(() => lease.safeUntil > frozenAt + ttlMs, "a renewal on the new leader", 20_000);
        assert.ok(lease.isActive && !lease.atRisk);
        assert.equal(client.address, standby);
      } finally {
        process.kill(leader.pid, "SIGCONT");
      }
      assert.equal((await group.exitCode(leader.address)).code, 3);
      await lease.finish();
    } finally {
      await client.close();
    }
  });

  for (const transport of ["stream", "unary"] as const) {
    it(`answers calls in flight at a frozen leader on the new one (${transport})`, async (t) => {
      if (!group) return t.skip(skip);
      await group.revive();
      const leader = await group.leader();
      const standby = group.endpoints.find((a) => a !== leader.address)!;
      const ttlMs = 9000;
      // a 30 s attempt deadline: without pings the calls would wait that long
      const client = new FencepostClient(group.endpoints, {
        owner: "worker", transport, retry: { totalTimeoutMs: 30_000, attemptTimeoutMs: 30_000 },
      });
      const tag = `${transport}-${leader.pid}`;
      const lost: LeaseLostError[] = [];
      try {
        const held: Lease = await client.acquire(`frozen-held-${tag}`, { ttlMs });
        void held.lost.then((e) => lost.push(e));
        assert.equal(client.address, leader.address);
        const renewed = held.safeUntil;
        await until(() => held.safeUntil > renewed, "a renewal on the old leader", 10_000);
        let stopping = false;
        const done: string[] = [];
        const workers = Array.from({ length: WORKERS }, (_, w) => lifecycles(client, `${tag}-${w}`, () => stopping, done));
        await until(() => done.length >= WORKERS, "lifecycles under way", 10_000);
        process.kill(leader.pid, "SIGSTOP");
        const frozenAt = performance.now();
        try {
          const burst = Array.from({ length: BURST }, (_, i) => client.acquire(`frozen-${tag}-${i}`, { ttlMs: 60_000 }));
          const leases = await Promise.all(burst);
          const took = performance.now() - frozenAt;
          assert.deepEqual(leases.map((x) => [x.fencingToken, x.record.attempt]), Array(BURST).fill([1, 1]));
          assert.equal(client.address, standby);
          // the 2 s leader lease runs out, the standby takes over; pings give up on the frozen one after 2 s + 2 s
          assert.ok(took < 15_000, `the calls waited ${Math.round(took)} ms`);
          const before = done.length;
          await until(() => done.length >= before + WORKERS, "lifecycles on the new leader", 15_000);
          stopping = true;
          await Promise.all(workers);
          await checkApplied(client, done);
          await until(() => held.safeUntil > frozenAt + ttlMs, "a renewal on the new leader", 20_000);
          assert.ok(held.isActive && !held.atRisk);
          const rec = await held.recordCheckpoint("ckpt/held/1", 1);
          assert.equal(rec.fencingToken, 1);
          for (const x of leases) await x.release();
        } finally {
          process.kill(leader.pid, "SIGCONT"); // it finds itself deposed and exits 3
        }
        assert.equal((await group.exitCode(leader.address)).code, 3);
        await held.finish();
        assert.deepEqual(lost, [], "no lease lost");
      } finally {
        await client.close();
      }
    });
  }
});
