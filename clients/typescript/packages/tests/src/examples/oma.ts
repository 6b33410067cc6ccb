import { randomUUID } from "node:crypto";
import { FencepostRunStore, type RunRecord } from "@fencepost/oma";

// Reads the server's Describe: atomicity is 'cross-process' because the server says so.
const store = await FencepostRunStore.connect(process.env["FENCEPOST_ADDR"] ?? "127.0.0.1:50051");
console.log(`atomicity: ${store.atomicity}`);
// Hand it to open-multi-agent as it is:
//   new OpenMultiAgent({ runStore: store, checkpoint: true })

const runId = `run-${randomUUID()}`;
const now = new Date().toISOString();
const record: RunRecord = {
  schema: 1, runId, version: 1, status: "queued", attempt: 1, fencingToken: 1, createdAt: now, updatedAt: now,
};
console.log(`created: ${await store.create(record)}`);           // true
console.log(`created again: ${await store.create(record)}`);     // false: insert only when absent

const lease = { owner: "worker-1", acquiredAt: now, expiresAt: new Date(Date.now() + 60_000).toISOString() };
const running: RunRecord = { ...record, version: 2, status: "running", fencingToken: 2, lease };
console.log(`swapped: ${await store.compareAndSet(runId, 1, running)}`);        // true
console.log(`stale swap: ${await store.compareAndSet(runId, 1, running)}`);     // false

// The push OMA's ledger lacks: hear at once when the fence moves.
const moved = new Promise<string>((resolve) => {
  void store.onFenceMoved(runId, (e) => resolve(`${e.reason}, now at token ${e.record?.fencingToken}`));
});
await new Promise((r) => setTimeout(r, 100));
const cancelled: RunRecord = { ...running, version: 3, status: "cancelled", fencingToken: 3, outcome: { code: "cancelled" } };
delete cancelled.lease;
await store.compareAndSet(runId, 2, cancelled);
console.log(`fence moved: ${await moved}`);

// Delete and create the id again: OMA numbers it from 1, the server's tokens keep rising.
await store.delete(runId);
await store.create(record);
console.log(`OMA token ${(await store.get(runId))?.fencingToken}, server token ${await store.serverFencingToken(runId)}`);
await store.close();
