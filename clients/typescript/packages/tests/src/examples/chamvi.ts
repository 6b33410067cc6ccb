import { randomUUID } from "node:crypto";
import { FencepostStore, InvalidRunStateError } from "@fencepost/chamvi";

const store = await FencepostStore.connect(process.env["FENCEPOST_ADDR"] ?? "127.0.0.1:50051");
const order = `order-${randomUUID()}`;

// One run per order, however often it is submitted: the first claimKey wins.
const { created, runId } = await store.claimKey("orders", order, `run-${order}`, 24 * 3600_000);
console.log(`key ${created ? "claimed" : "already claimed"} for ${runId}`);
await store.createRun({ id: runId, agent: "billing", status: "queued", input: { order, cents: 1999 } });

// One worker runs it: claimRun is atomic across processes.
if (await store.claimRun(runId, "worker-1", 30_000)) {
  await store.updateRun(runId, { status: "running" }, { expectStatus: ["queued"], expectOwner: "worker-1" });
  await store.appendStep({ runId, name: "charge", output: { charged: 1999 } });
  await store.saveCheckpoint({ runId, stepIndex: 1, state: { charged: true } });
  await store.putArtifact({ id: `${runId}/receipt`, runId, name: "receipt.txt", contentType: "text/plain" },
    new TextEncoder().encode(`receipt for ${order}\n`));
  const done = await store.updateRun(runId, { status: "completed", output: { ok: true } }, { expectOwner: "worker-1" });
  console.log(`${done.id} is ${done.status}`);
}

// Guards throw, and change nothing.
try {
  await store.updateRun(runId, { status: "running" }, { expectStatus: ["queued"] });
} catch (e) {
  if (!(e instanceof InvalidRunStateError)) throw e;
  console.log("a finished run cannot be restarted");
}
const receipt = await store.readArtifact(`${runId}/receipt`);
console.log(new TextDecoder().decode(receipt).trim(), `(${(await store.listSteps(runId)).length} step)`);
await store.close();
