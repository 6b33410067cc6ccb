import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { FencepostClient, OwnerNotPermittedError } from "@fencepost/client";

// Every coordinator of the group (a list, or "a:50051,b:50051"): each call
// goes to the one that leads, and follows a takeover by itself.
const endpoints = process.env["FENCEPOST_ENDPOINTS"] ?? "10.0.0.1:50051,10.0.0.2:50051";
// Mutual TLS: the CA that signed the servers, and this worker's certificate,
// whose identity (here the principal "alice") its owners must be under.
const pki = process.env["FENCEPOST_PKI"] ?? "pki";
const tls = {
  ca: readFileSync(`${pki}/ca.pem`),
  cert: readFileSync(`${pki}/alice.pem`),
  key: readFileSync(`${pki}/alice-key.pem`),
};

await using client = new FencepostClient(endpoints, { owner: "alice/worker-1", tls });
const runId = `invoice-${randomUUID()}`;
{
  // released when the block is left without finishing (an exception, say)
  await using lease = await client.acquire(runId, { ttlMs: 30_000, timeoutMs: 15_000 });
  await lease.recordCheckpoint(`invoices/${runId}`, 1);
  const done = await lease.finish("completed");
  console.log(`finished: ${done.status}`);
}

// An owner outside this certificate's identity is refused, and never retried.
await using posing = new FencepostClient(endpoints, { owner: "bob/worker-1", tls });
try {
  await posing.acquire(`${runId}-2`);
} catch (e) {
  if (!(e instanceof OwnerNotPermittedError)) throw e;
  console.log(`refused: ${e.metadata["owner"]} is not under ${e.metadata["principal"]}`);
}
