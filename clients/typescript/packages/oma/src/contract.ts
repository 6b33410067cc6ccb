// A reusable node:test suite for any implementation of open-multi-agent's
// RunStore seam, written from that seam's specification: create races,
// version-matched compare-and-set, concurrent swaps, lease expiry and
// takeover under an injected clock, stale-writer rejection, suspend/resume,
// terminal closure, duplicate commands converging, durability across two
// handles and delete-then-recreate.
//
//   import { runRunStoreContractSuite } from "@fencepost/oma/contract";
//   runRunStoreContractSuite("MyStore", () => new MyStore(...));
//
// Lease expiry, fencing and transitions live above the seam, so the suite
// drives the store through ContractLedger, a small ledger of its own with an
// injected clock: the store only has to keep storage semantics.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, describe, it } from "node:test";
import { RunStoreError, canTransitionRun, isTerminalRunStatus, type RunLifecycleStatus, type RunRecord, type RunStore, type RunStoreErrorCode } from "./types.js";

export interface Clock { now(): Date }

/** A clock tests move by hand. */
export class ManualClock implements Clock {
  constructor(private ms = Date.parse("2030-01-01T00:00:00.000Z")) {}
  now(): Date { return new Date(this.ms); }
  advance(ms: number): void { this.ms += ms; }
}

export interface LeaseHandle { runId: string; owner: string; fencingToken: number }

/** A minimal ledger over a RunStore, deciding with an injected clock (the suite's driver). */
export class ContractLedger {
  constructor(readonly store: RunStore, readonly owner: string, readonly clock: Clock, readonly leaseTtlMs = 60_000) {}

  private fail(code: RunStoreErrorCode, message: string, record?: RunRecord): never {
    throw new RunStoreError(code, message, record ? { record } : {});
  }

  async get(runId: string): Promise<RunRecord | null> { return this.store.get(runId); }

  /** Take the lease, creating the run when new. */
  async acquire(runId: string): Promise<LeaseHandle> {
    for (let i = 0; i < 20; i++) {
      const now = this.clock.now();
      const cur = await this.store.get(runId);
      const lease = { owner: this.owner, acquiredAt: now.toISOString(), expiresAt: new Date(now.getTime() + this.leaseTtlMs).toISOString() };
      if (!cur) {
        const rec: RunRecord = {
          schema: 1, runId, version: 1, status: "running", attempt: 1, fencingToken: 1, lease,
          createdAt: now.toISOString(), updatedAt: now.toISOString(),
        };
        if (await this.store.create(rec)) return { runId, owner: this.owner, fencingToken: 1 };
        continue;
      }
      if (isTerminalRunStatus(cur.status)) this.fail("RUN_ALREADY_TERMINAL", `${runId} is ${cur.status}`, cur);
      if (cur.status === "suspended") this.fail("RUN_SUSPENDED", `${runId} is suspended`, cur);
      const live = cur.lease !== undefined && now.getTime() < Date.parse(cur.lease.expiresAt);
      if (live && cur.lease!.owner !== this.owner) this.fail("RUN_LEASE_HELD", `${runId} is held by ${cur.lease!.owner}`, cur);
      const next: RunRecord = {
        ...cur, version: cur.version + 1, status: "running", lease, fencingToken: cur.fencingToken + 1,
        attempt: cur.lease !== undefined ? cur.attempt + 1 : cur.attempt, updatedAt: now.toISOString(),
      };
      delete next.suspension;
      if (await this.store.compareAndSet(runId, cur.version, next)) return { runId, owner: this.owner, fencingToken: next.fencingToken };
    }
    this.fail("RUN_CONFLICT", `${runId}: too much contention`);
  }

  /** A fenced write: refused with RUN_LEASE_LOST once the handle's token is not the run's. */
  private async fenced(h: LeaseHandle, change: (cur: RunRecord, now: Date) => RunRecord): Promise<RunRecord> {
    for (let i = 0; i < 20; i++) {
      const now = this.clock.now();
      const cur = await this.store.get(h.runId);
      if (!cur) this.fail("RUN_NOT_FOUND", `${h.runId} does not exist`);
      if (cur.fencingToken !== h.fencingToken || cur.lease?.owner !== h.owner) {
        this.fail("RUN_LEASE_LOST", `${h.runId}: token ${h.fencingToken} is no longer current (${cur.fencingToken})`, cur);
      }
      const next = { ...change(cur, now), version: cur.version + 1, updatedAt: now.toISOString() };
      if (!canTransitionRun(cur.status, next.status) && cur.status !== next.status) {
        this.fail("RUN_INVALID_TRANSITION", `${cur.status} -> ${next.status}`, cur);
      }
      if (await this.store.compareAndSet(h.runId, cur.version, next)) return next;
    }
    this.fail("RUN_CONFLICT", `${h.runId}: too much contention`);
  }

  heartbeat(h: LeaseHandle): Promise<RunRecord> {
    return this.fenced(h, (cur, now) => ({ ...cur, lease: { ...cur.lease!, expiresAt: new Date(now.getTime() + this.leaseTtlMs).toISOString() } }));
  }

  checkpoint(h: LeaseHandle, key: string, snapshotVersion: number): Promise<RunRecord> {
    return this.fenced(h, (cur, now) => ({ ...cur, checkpointRef: { key, snapshotVersion, savedAt: now.toISOString() } }));
  }

  suspend(h: LeaseHandle, pendingApprovalIds: string[]): Promise<RunRecord> {
    return this.fenced(h, (cur, now) => {
      const next: RunRecord = { ...cur, status: "suspended", suspension: { suspendedAt: now.toISOString(), pendingApprovalIds } };
      delete next.lease;
      return next;
    });
  }

  finish(h: LeaseHandle, status: "completed" | "failed" | "cancelled", code: string, message?: string): Promise<RunRecord> {
    return this.fenced(h, (cur) => {
      const next: RunRecord = { ...cur, status, outcome: message === undefined ? { code } : { code, message } };
      delete next.lease;
      return next;
    });
  }

  /** Operator: cancel (moves the token so the worker is fenced); an already cancelled run converges. */
  async cancel(runId: string, message: string): Promise<RunRecord> {
    for (let i = 0; i < 20; i++) {
      const now = this.clock.now();
      const cur = await this.store.get(runId);
      if (!cur) this.fail("RUN_NOT_FOUND", `${runId} does not exist`);
      if (cur.status === "cancelled") return cur;
      if (isTerminalRunStatus(cur.status)) this.fail("RUN_ALREADY_TERMINAL", `${runId} is ${cur.status}`, cur);
      const next: RunRecord = {
        ...cur, version: cur.version + 1, status: "cancelled", fencingToken: cur.fencingToken + 1,
        outcome: { code: "cancelled", message }, updatedAt: now.toISOString(),
      };
      delete next.lease;
      delete next.suspension;
      if (await this.store.compareAndSet(runId, cur.version, next)) return next;
    }
    this.fail("RUN_CONFLICT", `${runId}: too much contention`);
  }

  /** Operator: make a suspended run eligible again (queued); a queued run converges. */
  async requestResume(runId: string): Promise<RunRecord> {
    for (let i = 0; i < 20; i++) {
      const now = this.clock.now();
      const cur = await this.store.get(runId);
      if (!cur) this.fail("RUN_NOT_FOUND", `${runId} does not exist`);
      if (cur.status === "queued") return cur;
      if (isTerminalRunStatus(cur.status)) this.fail("RUN_ALREADY_TERMINAL", `${runId} is ${cur.status}`, cur);
      if (cur.status !== "suspended") this.fail("RUN_INVALID_TRANSITION", `${runId} is ${cur.status}`, cur);
      const next: RunRecord = { ...cur, version: cur.version + 1, status: "queued", updatedAt: now.toISOString() };
      delete next.suspension;
      delete next.lease;
      if (await this.store.compareAndSet(runId, cur.version, next)) return next;
    }
    this.fail("RUN_CONFLICT", `${runId}: too much contention`);
  }
}

export interface SuiteOptions {
  /** How many concurrent callers the race tests use (default 16). */
  racers?: number;
}

async function rejectsWith(p: Promise<unknown>, code: RunStoreErrorCode): Promise<RunStoreError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof RunStoreError, `expected a RunStoreError ${code}, got ${String(e)}`);
    assert.equal(e.code, code);
    return e;
  }
  assert.fail(`expected RunStoreError ${code}, but the call succeeded`);
}

/** Register the contract tests for the RunStore `factory` makes (called once per handle). */
export function runRunStoreContractSuite(name: string, factory: () => RunStore | Promise<RunStore>, options: SuiteOptions = {}): void {
  const racers = options.racers ?? 16;
  const prefix = `contract-${randomBytes(4).toString("hex")}`;
  let n = 0;
  const newId = (what: string) => `${prefix}-${what}-${++n}`;
  const opened: RunStore[] = [];
  const open = async () => { const s = await factory(); opened.push(s); return s; };
  const t0 = "2030-01-01T00:00:00.000Z";
  const base = (runId: string, extra: Partial<RunRecord> = {}): RunRecord => ({
    schema: 1, runId, version: 1, status: "queued", attempt: 1, fencingToken: 1, createdAt: t0, updatedAt: t0, ...extra,
  });

  describe(`RunStore contract: ${name}`, () => {
    after(async () => {
      for (const s of opened) await (s as { close?: () => Promise<void> }).close?.();
    });

    it("reads an unknown run as null", async () => {
      const store = await open();
      assert.equal(await store.get(newId("unknown")), null);
    });

    it("creates only when absent and keeps the first record", async () => {
      const store = await open();
      const id = newId("create");
      assert.equal(await store.create(base(id)), true);
      assert.equal(await store.create(base(id, { status: "running", attempt: 7 })), false);
      const got = await store.get(id);
      assert.deepEqual(got, base(id));
    });

    it("lets exactly one of many concurrent creates win", async () => {
      const store = await open();
      const id = newId("create-race");
      const results = await Promise.all(Array.from({ length: racers }, (_, i) =>
        store.create(base(id, { checkpointRef: { key: `racer-${i}`, snapshotVersion: i, savedAt: t0 } }))));
      assert.equal(results.filter(Boolean).length, 1);
      const winner = results.indexOf(true);
      assert.equal((await store.get(id))?.checkpointRef?.key, `racer-${winner}`);
    });

    it("round-trips every field of a record", async () => {
      const store = await open();
      const id = newId("fields");
      const rec = base(id, {
        status: "suspended", attempt: 3, fencingToken: 5,
        lease: { owner: "w-1", acquiredAt: "2030-01-01T00:00:01.000Z", expiresAt: "2030-01-01T00:01:01.000Z" },
        checkpointRef: { key: "ckpt/1", snapshotVersion: 4, savedAt: "2030-01-01T00:00:02.500Z" },
        outcome: { code: "waiting", message: "for an approval" },
        suspension: { suspendedAt: "2030-01-01T00:00:03.000Z", pendingApprovalIds: ["a-2", "a-1"] },
        updatedAt: "2030-01-01T00:00:03.000Z",
      });
      assert.equal(await store.create(rec), true);
      assert.deepEqual(await store.get(id), rec);
    });

    it("swaps only at the stored version, never creates, and needs next.version = expected + 1", async () => {
      const store = await open();
      const id = newId("cas");
      await store.create(base(id));
      const v2 = base(id, { version: 2, status: "running", updatedAt: "2030-01-01T00:00:05.000Z" });
      assert.equal(await store.compareAndSet(id, 2, { ...v2, version: 3 }), false);
      assert.deepEqual(await store.get(id), base(id));
      assert.equal(await store.compareAndSet(id, 1, v2), true);
      assert.deepEqual(await store.get(id), v2);
      assert.equal(await store.compareAndSet(id, 1, v2), false, "a stale version must not swap");
      // next.version must be expectedVersion + 1: refused (thrown or false), nothing changes
      const bad = store.compareAndSet(id, 2, { ...v2, version: 5 }).catch((e: unknown) => e);
      const outcome = await bad;
      assert.ok(outcome === false || outcome instanceof RunStoreError, `got ${String(outcome)}`);
      assert.deepEqual(await store.get(id), v2);
      const missing = newId("cas-missing");
      assert.equal(await store.compareAndSet(missing, 1, base(missing, { version: 2 })), false);
      assert.equal(await store.get(missing), null, "compareAndSet must never create");
    });

    it("lets exactly one of many concurrent swaps from one version win", async () => {
      const store = await open();
      const id = newId("cas-race");
      await store.create(base(id));
      const results = await Promise.all(Array.from({ length: racers }, (_, i) =>
        store.compareAndSet(id, 1, base(id, { version: 2, checkpointRef: { key: `w-${i}`, snapshotVersion: i, savedAt: t0 } }))));
      assert.equal(results.filter(Boolean).length, 1);
      const got = await store.get(id);
      assert.equal(got?.version, 2);
      assert.equal(got?.checkpointRef?.key, `w-${results.indexOf(true)}`);
    });

    it("expires a lease at exactly expiresAt and lets another worker take over (injected clock)", async () => {
      const store = await open();
      const clock = new ManualClock();
      const a = new ContractLedger(store, "worker-a", clock, 1000);
      const b = new ContractLedger(store, "worker-b", clock, 1000);
      const id = newId("takeover");
      const ha = await a.acquire(id);
      assert.equal(ha.fencingToken, 1);
      clock.advance(999);
      const held = await rejectsWith(b.acquire(id), "RUN_LEASE_HELD");
      assert.equal(held.record?.lease?.owner, "worker-a");
      clock.advance(1);
      const hb = await b.acquire(id);
      assert.equal(hb.fencingToken, 2);
      const rec = await store.get(id);
      assert.equal(rec?.attempt, 2);
      assert.equal(rec?.lease?.owner, "worker-b");
    });

    it("rejects the stale writer after a takeover", async () => {
      const store = await open();
      const clock = new ManualClock();
      const a = new ContractLedger(store, "worker-a", clock, 1000);
      const b = new ContractLedger(store, "worker-b", clock, 1000);
      const id = newId("stale");
      const ha = await a.acquire(id);
      await a.checkpoint(ha, "k", 1);
      clock.advance(1500);
      const hb = await b.acquire(id);
      const lost = await rejectsWith(a.checkpoint(ha, "k", 2), "RUN_LEASE_LOST");
      assert.equal(lost.record?.fencingToken, hb.fencingToken);
      await rejectsWith(a.finish(ha, "completed", "ok"), "RUN_LEASE_LOST");
      const rec = await store.get(id);
      assert.equal(rec?.checkpointRef?.snapshotVersion, 1, "the stale writer changed nothing");
      assert.equal(rec?.status, "running");
      await b.finish(hb, "completed", "ok");
      assert.equal((await store.get(id))?.status, "completed");
    });

    it("suspends without a lease and resumes to a new lease", async () => {
      const store = await open();
      const clock = new ManualClock();
      const a = new ContractLedger(store, "worker-a", clock);
      const op = new ContractLedger(store, "operator", clock);
      const id = newId("suspend");
      const h = await a.acquire(id);
      const s = await a.suspend(h, ["approval-1"]);
      assert.equal(s.status, "suspended");
      assert.equal(s.lease, undefined);
      assert.deepEqual((await store.get(id))?.suspension?.pendingApprovalIds, ["approval-1"]);
      await rejectsWith(a.acquire(id), "RUN_SUSPENDED");
      const q1 = await op.requestResume(id);
      const q2 = await op.requestResume(id);
      assert.equal(q1.status, "queued");
      assert.deepEqual(q2, q1, "a duplicate resume converges");
      const h2 = await a.acquire(id);
      assert.equal(h2.fencingToken, 2);
      assert.equal((await store.get(id))?.suspension, undefined);
    });

    it("closes terminal runs for good and lets duplicate cancels converge", async () => {
      const store = await open();
      const clock = new ManualClock();
      const a = new ContractLedger(store, "worker-a", clock);
      const op = new ContractLedger(store, "operator", clock);
      const done = newId("terminal");
      const h = await a.acquire(done);
      await a.finish(h, "completed", "ok");
      await rejectsWith(a.acquire(done), "RUN_ALREADY_TERMINAL");
      await rejectsWith(op.cancel(done, "late"), "RUN_ALREADY_TERMINAL");
      const cancelled = newId("cancel");
      const hc = await a.acquire(cancelled);
      const c1 = await op.cancel(cancelled, "superseded");
      const c2 = await op.cancel(cancelled, "superseded");
      assert.deepEqual(c2, c1);
      assert.equal(c1.fencingToken, hc.fencingToken + 1, "a cancel moves the token");
      await rejectsWith(a.finish(hc, "completed", "ok"), "RUN_LEASE_LOST");
      assert.equal((await store.get(cancelled))?.status, "cancelled");
    });

    it("is durable across two handles", async () => {
      const one = await open();
      const two = await open();
      const id = newId("handles");
      await one.create(base(id));
      assert.deepEqual(await two.get(id), base(id));
      const v2 = base(id, { version: 2, status: "running", fencingToken: 2 });
      assert.equal(await two.compareAndSet(id, 1, v2), true);
      assert.deepEqual(await one.get(id), v2);
      assert.equal(await one.compareAndSet(id, 1, { ...v2, attempt: 9 }), false);
    });

    it("deletes, and creates the same id again from token 1", async (t) => {
      const store = await open();
      if (!store.delete) return t.skip("the store has no delete");
      const clock = new ManualClock();
      const a = new ContractLedger(store, "worker-a", clock);
      const id = newId("recreate");
      const h = await a.acquire(id);
      await a.cancel(id, "x");
      void h;
      await store.delete(id);
      assert.equal(await store.get(id), null);
      await store.delete(id); // deleting nothing is fine
      const again = await a.acquire(id);
      assert.equal(again.fencingToken, 1);
      assert.equal((await store.get(id))?.fencingToken, 1);
      await a.checkpoint(again, "k", 1);
      assert.equal((await store.get(id))?.version, 2);
    });
  });
}

export type { RunLifecycleStatus };
export { runMemoryStoreContractSuite, runRunJournalContractSuite } from "./contract-memory.js";
export type { MemoryStoreSuiteOptions } from "./contract-memory.js";
