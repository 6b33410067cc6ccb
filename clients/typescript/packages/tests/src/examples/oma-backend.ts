import { randomUUID } from "node:crypto";
import { LeaseLostError, type ClientOptions } from "@fencepost/client";
import { FencepostMemoryStore, FencepostRunJournal, FencepostRunStore, type RunRecord } from "@fencepost/oma";

const address = process.env["FENCEPOST_ADDR"] ?? "127.0.0.1:50051";
const options: ClientOptions = { owner: "worker-1" }; // what FencepostClient takes, passed on unchanged
const runId = `run-${randomUUID()}`; // fresh on every run

// fencepost as open-multi-agent's only backend: run records, memory and checkpoints, the journal.
const runStore = await FencepostRunStore.connect(address, options);
const memory = await FencepostMemoryStore.connect(address, { ...options, namespace: "research-team" });
const journal = await FencepostRunJournal.connect(address, runId, options);
// Hand them to open-multi-agent as they are:
//   const orchestrator = new OpenMultiAgent({ runStore, checkpoint: true });
//   const team = new Team({ name: "research", agents, sharedMemoryStore: memory });
//   await orchestrator.runTasks(team, tasks, { checkpoint: { store: memory.fencedFor(runId, token) }, journal });
// Below, the same calls open-multi-agent makes through them.

// The ledger takes the run: a record at fencing token 1, leased to worker-1.
const now = new Date();
const lease = { owner: "worker-1", acquiredAt: now.toISOString(), expiresAt: new Date(now.getTime() + 60_000).toISOString() };
const record: RunRecord = {
  schema: 1, runId, version: 1, status: "running", attempt: 1, fencingToken: 1, lease,
  createdAt: now.toISOString(), updatedAt: now.toISOString(),
};
console.log(`run created: ${await runStore.create(record)}`);

// Journal events, numbered by the run; lastSeq() saves reading the whole tail at start.
await journal.append([{ seq: 1, type: "run/start", runId }, { seq: 2, type: "turn/start", runId, turn: 1 }]);
console.log(`journal at seq ${await journal.lastSeq()}: ${(await journal.readFrom(2)).map((e) => e["type"]).join(", ")}`);

// A checkpoint through the fenced view: it commits only while token 1 holds the run.
const checkpoints = memory.fencedFor(runId, record.fencingToken);
const key = `__oma_checkpoint__/${runId}/latest`;
const conversation = "a long conversation ".repeat(200_000); // 4 MB: stored as an artifact
await checkpoints.set(key, JSON.stringify({ version: 5, conversation }), { namespace: "checkpoint", runId });
console.log(`checkpoint saved: ${(await memory.get(key))!.value.length} characters`);

// A durable approval: the request is created once, and the first decision wins.
const approval = `__oma_approval__/apr_${runId}`;
await memory.compareAndSet(approval, null, JSON.stringify({ request: runId }));
const pending = (await memory.get(approval))!.value;
const alice = await memory.compareAndSet(approval, pending, JSON.stringify({ request: runId, decision: "approved", by: "alice" }));
const bob = await memory.compareAndSet(approval, pending, JSON.stringify({ request: runId, decision: "rejected", by: "bob" }));
console.log(`alice decided: ${alice}, bob decided: ${bob}`);

// Another worker takes the run over (token 2): worker-1's next checkpoint is refused, nothing written.
const takeover: RunRecord = { ...record, version: 2, attempt: 2, fencingToken: 2, lease: { ...lease, owner: "worker-2" } };
await runStore.compareAndSet(runId, 1, takeover);
try {
  await checkpoints.set(key, JSON.stringify({ version: 5, conversation: "stale" }), { namespace: "checkpoint", runId });
} catch (e) {
  if (!(e instanceof LeaseLostError)) throw e;
  console.log(`stale checkpoint refused: ${e.code}`);
}
console.log(`checkpoint still worker-1's last good one: ${(await memory.get(key))!.value.length} characters`);

await journal.close();
await memory.close();
await runStore.close();
