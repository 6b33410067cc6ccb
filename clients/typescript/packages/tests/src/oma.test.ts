import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { createRouterTransport } from "@connectrpc/connect";
import { FencepostClient } from "@fencepost/client";
import { Atomicity, RunStore } from "@fencepost/client/gen/fencepost/v1/run_store_pb";
import { startServer, type TestServer } from "@fencepost/client/testing";
import { EPOCH_SPAN, FencepostRunStore, RunStoreError, type RunRecord } from "@fencepost/oma";
import { ContractLedger, ManualClock, runRunStoreContractSuite } from "@fencepost/oma/contract";

let server: TestServer;
before(async () => { server = await startServer(); });
after(async () => { await server.stop(); });

runRunStoreContractSuite("FencepostRunStore", () => FencepostRunStore.connect(server.address));

const t0 = "2030-01-01T00:00:00.000Z";
const rec = (runId: string, extra: Partial<RunRecord> = {}): RunRecord => ({
  schema: 1, runId, version: 1, status: "queued", attempt: 1, fencingToken: 1, createdAt: t0, updatedAt: t0, ...extra,
});

describe("FencepostRunStore on fencepost", () => {
  let store: FencepostRunStore;
  let other: FencepostRunStore;
  let client: FencepostClient;
  before(async () => {
    store = await FencepostRunStore.connect(server.address);
    other = await FencepostRunStore.connect(server.address);
    client = new FencepostClient(server.address);
  });
  after(async () => { await store.close(); await other.close(); await client.close(); });

  it("declares cross-process atomicity because Describe says so", async () => {
    assert.equal(store.atomicity, "cross-process");
    const d = await client.stubs.runStore.describe({});
    assert.equal(d.atomicity, 2);
  });

  it("takes its atomicity from Describe, not from itself", async () => {
    // A stand-in server that declares in-process atomicity: the adapter must repeat it.
    const declaring = (atomicity: Atomicity) => createRouterTransport(({ service }) => {
      service(RunStore, { describe: () => ({ atomicity, backend: "test", schema: 1 }) } as never);
    });
    const weak = await FencepostRunStore.connect("unused", { connectTransport: declaring(Atomicity.IN_PROCESS) });
    assert.equal(weak.atomicity, "process");
    await weak.close();
    const strong = await FencepostRunStore.connect("unused", { connectTransport: declaring(Atomicity.CROSS_PROCESS) });
    assert.equal(strong.atomicity, "cross-process");
    await strong.close();
  });

  it("re-creates a deleted id at OMA token 1 while the server's tokens keep rising", async () => {
    const clock = new ManualClock();
    const ledger = new ContractLedger(store, "w", clock, 1000);
    const id = "oma-recreate";
    let h = await ledger.acquire(id);
    for (let i = 0; i < 3; i++) { clock.advance(2000); h = await ledger.acquire(id); }
    assert.equal(h.fencingToken, 4);
    const first = await store.serverFencingToken(id);
    assert.equal(first, 4n);
    await store.delete(id);
    // the raw server refuses token 1 for this id (what OMA would send)...
    await assert.rejects(client.stubs.runStore.create({ run: { schema: 1, runId: id, version: 1n, status: 1, attempt: 1n, fencingToken: 1n } }));
    // ...the adapter creates it in the next epoch
    const again = await ledger.acquire(id);
    assert.equal(again.fencingToken, 1);
    const second = (await store.serverFencingToken(id))!;
    assert.equal(second, EPOCH_SPAN + 1n);
    assert.ok(second > first!);
    // another handle (a fresh process would be the same) decodes the same OMA token
    assert.equal((await other.get(id))?.fencingToken, 1);
    // the ledger's own fence check agrees with the server token
    const fence = await client.validateFence(id, Number(second));
    assert.equal(fence.current, true);
    // a stale handle whose cached epoch is from before the delete: refuses or swaps correctly
    clock.advance(2000);
    const h2 = await new ContractLedger(other, "w2", clock, 1000).acquire(id);
    assert.equal(h2.fencingToken, 2);
    assert.equal(await store.serverFencingToken(id), EPOCH_SPAN + 2n);
    // delete twice more: every epoch is above the last
    await store.delete(id);
    await ledger.acquire(id);
    await other.delete(id);
    const h3 = await ledger.acquire(id);
    assert.equal(h3.fencingToken, 1);
    assert.equal(await store.serverFencingToken(id), 3n * EPOCH_SPAN + 1n);
  });

  it("fixes a handle's stale epoch when another handle deleted and re-created the run", async () => {
    const id = "oma-stale-epoch";
    await store.create(rec(id));
    assert.equal((await store.get(id))?.version, 1); // caches epoch 0
    await other.delete(id);
    assert.equal(await other.create(rec(id)), true); // epoch 1, version 1
    // store still thinks epoch 0: its swap must land in epoch 1
    assert.equal(await store.compareAndSet(id, 1, rec(id, { version: 2, fencingToken: 2 })), true);
    assert.equal(await store.serverFencingToken(id), EPOCH_SPAN + 2n);
    assert.equal((await other.get(id))?.fencingToken, 2);
  });

  it("pushes a moved fence to onFenceMoved within milliseconds", async () => {
    const clock = new ManualClock();
    const worker = new ContractLedger(store, "worker", clock);
    const operator = new ContractLedger(other, "operator", clock);
    const id = "oma-push";
    const h = await worker.acquire(id);
    const events: unknown[] = [];
    const moved = new Promise<{ reason: string; record: RunRecord | null; fencingToken: number }>((resolve) => {
      void store.onFenceMoved(id, (e) => { events.push(e); resolve(e); }, h.fencingToken);
    });
    await new Promise((r) => setTimeout(r, 100)); // the track reaches the server
    const started = performance.now();
    await operator.cancel(id, "superseded");
    const e = await moved;
    const ms = performance.now() - started;
    assert.equal(e.fencingToken, 1);
    assert.equal(e.reason, "fence_moved");
    assert.equal(e.record?.status, "cancelled");
    assert.equal(e.record?.fencingToken, 2);
    assert.ok(ms < 1000, `the push took ${ms} ms`);
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(events.length, 1);
  });

  it("reports a watch on an already moved fence at once, and a delete", async () => {
    const id = "oma-push-late";
    const lease = { owner: "w", acquiredAt: t0, expiresAt: "2030-01-01T01:00:00.000Z" };
    await store.create(rec(id, { status: "running", fencingToken: 1, lease }));
    await store.compareAndSet(id, 1, rec(id, { version: 2, status: "running", fencingToken: 2, lease }));
    const late = await new Promise<string>((resolve) => { void store.onFenceMoved(id, (e) => resolve(e.reason), 1); });
    assert.equal(late, "taken_over", "a move learned late reads as a takeover (docs/STREAMS.md)");
    const gone = new Promise<RunRecord | null>((resolve) => { void other.onFenceMoved(id, (e) => resolve(e.record)); });
    await new Promise((r) => setTimeout(r, 100));
    await store.delete(id);
    assert.equal(await gone, null);
  });

  it("refuses malformed records with RUN_VALIDATION_ERROR naming the field, storing nothing", async () => {
    const id = "oma-bad";
    const cases: Array<[Partial<RunRecord> | Record<string, unknown>, string]> = [
      [{ createdAt: "yesterday" }, "run.createdAt"],
      [{ fencingToken: 0 }, "run.fencingToken"],
      [{ status: "paused" }, "run.status"],
      [{ version: 1.5 }, "run.version"],
    ];
    for (const [extra, field] of cases) {
      await assert.rejects(store.create(rec(id, extra as Partial<RunRecord>)), (e: unknown) =>
        e instanceof RunStoreError && e.code === "RUN_VALIDATION_ERROR" && e.field === field);
    }
    await assert.rejects(store.create(rec(id, { lease: { owner: "", acquiredAt: t0, expiresAt: t0 } })), (e: unknown) =>
      e instanceof RunStoreError && e.code === "RUN_VALIDATION_ERROR" && e.field === "run.lease.owner");
    await assert.rejects(store.create(rec(id, { lease: { owner: "w", acquiredAt: "2030-01-02T00:00:00.000Z", expiresAt: t0 } })), (e: unknown) =>
      e instanceof RunStoreError && e.code === "RUN_VALIDATION_ERROR" && e.field === "run.lease.expiresAt");
    assert.equal(await store.get(id), null);
    await store.create(rec(id));
    await assert.rejects(store.compareAndSet(id, 1, rec("other-id", { version: 2 })), (e: unknown) =>
      e instanceof RunStoreError && e.field === "next.runId");
    await assert.rejects(store.compareAndSet(id, 1, rec(id, { version: 3 })), (e: unknown) =>
      e instanceof RunStoreError && e.field === "next.version");
    assert.equal((await store.get(id))?.version, 1);
  });

  it("keeps records across a server restart", async () => {
    const id = "oma-restart";
    await store.create(rec(id, { status: "running", fencingToken: 3 }));
    await server.restart();
    const fresh = await FencepostRunStore.connect(server.address);
    try {
      assert.deepEqual(await fresh.get(id), rec(id, { status: "running", fencingToken: 3 }));
    } finally {
      await fresh.close();
    }
  });
});
