import { randomUUID } from "node:crypto";
import { FencepostClient, LeaseLostError, LockLostError } from "@fencepost/client";

const address = process.env["FENCEPOST_ADDR"] ?? "127.0.0.1:50051";
const worker = new FencepostClient(address, { owner: "worker-1" });
const operator = new FencepostClient(address, { owner: "operator" });
const runId = `order-${randomUUID()}`; // fresh on every run
const lease = await worker.acquire(runId, { ttlMs: 10_000 });

// One checkpoint boundary: all of it commits under the lease's fence, or none of it.
// The writes are queued while the callback runs, and sent together when it returns.
const { saved, step, pointer } = await lease.transaction((tx) => {
  tx.putEffect(`${runId}/charge`, { chargeId: "ch_1" });
  return {
    saved: tx.saveCheckpoint({ runId, stepIndex: 1, state: { step: 1, charge: "ch_1" } }),
    step: tx.appendStep({ runId, name: "charge", status: "ok" }),
    pointer: tx.recordCheckpoint(`${runId}/cp`, 1), // the ledger's record, in the same step
  };
});
console.log(`committed: saved=${saved.saved} step=${step.seq} pointer=${pointer.checkpointRef?.snapshotVersion}`);

await lease.fenced().kvSet("checkout", runId, "charged"); // a single fenced write

// An operator cancels the run: the fence moves, and the worker is fenced out.
await operator.cancel(runId, "superseded");
try {
  await lease.transaction((tx) => {
    tx.saveCheckpoint({ runId, stepIndex: 2, state: { step: 2 } });
    tx.putEffect(`${runId}/refund`, { refundId: "rf_1" });
  });
} catch (e) {
  if (!(e instanceof LeaseLostError)) throw e;
  console.log(`refused: ${e.code}, lease lost: ${lease.isLost} (${lease.lostReason})`);
}
const checkpoint = await worker.store.latestCheckpoint(runId);
const refund = await worker.store.getEffect(`${runId}/refund`);
console.log(`visible: checkpoint ${checkpoint?.stepIndex}, refund recorded: ${refund.found}`);

// A keyed lock: its holder stalls past the ttl, and another takes it over.
const account = `account/${runId}`;
const mine = await worker.store.acquireLock(account, "worker-1", 200);
const locked = worker.store.fenced({ lockKey: account, fencingToken: mine.fencingToken });
await locked.docUpsert("billing", "accounts", account, { balance: 10 });
await new Promise((resolve) => setTimeout(resolve, 300));
await operator.store.acquireLock(account, "worker-2", 10_000);
try {
  await locked.docUpsert("billing", "accounts", account, { balance: 0 });
} catch (e) {
  if (!(e instanceof LockLostError)) throw e;
  console.log(`refused: ${e.code}, lock now held by ${e.owner} at token ${e.fencingToken}`);
}
await operator.store.releaseLock(account, "worker-2");
await operator.close();
await worker.close();
