import { randomUUID } from "node:crypto";
import { FencepostClient, LeaseHeldError, LeaseLostError } from "@fencepost/client";

const client = new FencepostClient(process.env["FENCEPOST_ADDR"] ?? "127.0.0.1:50051", { owner: "worker-1" });
const runId = `nightly-report-${randomUUID()}`;

// Become the run's single owner. The lease renews itself over the client's
// one KeepAlive stream; lease.signal aborts the moment it is lost or at risk.
const lease = await client.acquire(runId, { ttlMs: 30_000 });
console.log(`holding ${runId} at fencing token ${lease.fencingToken}`);

// A second worker is refused, and the error carries the record it saw.
const rival = new FencepostClient(process.env["FENCEPOST_ADDR"] ?? "127.0.0.1:50051", { owner: "worker-2" });
try {
  await rival.acquire(runId);
} catch (e) {
  if (!(e instanceof LeaseHeldError)) throw e;
  console.log(`worker-2 refused: held by ${e.record?.lease?.owner}`);
}

for (let step = 1; step <= 3; step++) {
  lease.check(); // throws LeaseLostError / LeaseAtRiskError when this worker may no longer act
  await doStep(step, lease.signal);
  await lease.recordCheckpoint(`reports/${runId}`, step); // fenced: refused once the token moved
}
const done = await lease.finish("completed", { code: "ok" });
console.log(`${runId} is ${done.status}`);

// An operator's cancel reaches a working lease as a push, within milliseconds.
const other = await client.acquire(`${runId}-2`);
await rival.cancel(other.runId, "superseded");
const lost: LeaseLostError = await other.lost;
console.log(`second lease lost: ${lost.reason}`);

await rival.close();
await client.close();

async function doStep(step: number, signal: AbortSignal): Promise<void> {
  // pass `signal` to fetch(), child processes, timers...: they stop when the lease does
  await new Promise((resolve) => setTimeout(resolve, 10 * step));
  signal.throwIfAborted();
}
