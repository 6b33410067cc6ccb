// A second process for oma-memory.test.ts. Modes:
//   cas <address> <namespace> <me> <startAt> <n>
//       n compareAndSet increments of one counter, n sets of one shared key,
//       then a race to decide the approvals req-0 .. req-(n-1); prints what it won
//   journal <address> <name> <me> <startAt> <batches>
//       appends batches of 1-5 events numbered from lastSeq() + 1, retrying
//       a batch that another appender beat; prints how many it appended
//   stale <address> <namespace> <runId> <ledger|memory>
//       holds the run and writes its record, prints "recorded", waits for a
//       line on stdin (the parent takes the run over meanwhile), then tries to
//       write its checkpoint under its old token; prints what happened
import { createInterface } from "node:readline";
import { FencepostMemoryStore, FencepostRunJournal, FencepostRunStore, RunJournalError, type RunStore } from "@fencepost/oma";
import { ContractLedger, ManualClock } from "@fencepost/oma/contract";
import { MemoryRunStore, checkpointKey, decideApproval, saveCheckpoint } from "./oma-patterns.js";

const [mode, address] = [process.argv[2]!, process.argv[3]!];
const say = (v: unknown) => process.stdout.write(JSON.stringify(v) + "\n");
const waitUntil = (at: number) => new Promise((r) => setTimeout(r, Math.max(0, at - Date.now())));

if (mode === "cas") {
  const [ns, me, startAt, n] = [process.argv[4]!, process.argv[5]!, Number(process.argv[6]), Number(process.argv[7])];
  const store = await FencepostMemoryStore.connect(address, { namespace: ns });
  await store.get("warm-up");
  await waitUntil(startAt);
  let retries = 0;
  for (let i = 0; i < n; i++) {
    for (;;) {
      const cur = await store.get("counter");
      const next = String(Number(cur?.value ?? "0") + 1);
      if (await store.compareAndSet("counter", cur?.value ?? null, next, { by: me })) break;
      retries++;
    }
  }
  for (let i = 0; i < n; i++) await store.set("shared", `${me}-${i}`, { by: me });
  const won: string[] = [];
  for (let i = 0; i < n; i++) if (await decideApproval(store, `req-${i}`, me, "approved")) won.push(`req-${i}`);
  say({ me, retries, won });
  await store.close();
} else if (mode === "journal") {
  const [name, me, startAt, batches] = [process.argv[4]!, process.argv[5]!, Number(process.argv[6]), Number(process.argv[7])];
  const journal = await FencepostRunJournal.connect(address, name);
  await journal.lastSeq();
  await waitUntil(startAt);
  let conflicts = 0;
  for (let b = 0; b < batches; b++) {
    const size = 1 + Math.floor(Math.random() * 5);
    for (;;) {
      const from = (await journal.lastSeq()) + 1;
      const events = Array.from({ length: size }, (_, i) => ({ seq: from + i, type: "test/event", writer: me, batch: b, index: i, of: size }));
      try {
        await journal.append(events);
        break;
      } catch (e) {
        if (!(e instanceof RunJournalError && e.code === "JOURNAL_SEQ_CONFLICT")) throw e;
        conflicts++;
      }
    }
  }
  say({ me, conflicts });
  await journal.close();
} else if (mode === "stale") {
  const [ns, runId, variant] = [process.argv[4]!, process.argv[5]!, process.argv[6]!];
  const memory = await FencepostMemoryStore.connect(address, { namespace: ns });
  const runs: RunStore = variant === "ledger" ? await FencepostRunStore.connect(address) : new MemoryRunStore(memory, "cross-process");
  const ledger = new ContractLedger(runs, "worker-a", new ManualClock(), 1000);
  const h = await ledger.acquire(runId);
  await saveCheckpoint(memory, runId, { step: 1, by: "worker-a" }, { fencingToken: h.fencingToken });
  await ledger.checkpoint(h, checkpointKey(runId), 1); // the record write
  say({ recorded: h.fencingToken });
  const lines = createInterface({ input: process.stdin });
  for await (const _ of lines) break; // the parent takes the run over before it answers
  const attempt = async (write: () => Promise<unknown>) => {
    try {
      return { wrote: await write() };
    } catch (e) {
      const err = e as { name: string; code?: string };
      return { refused: err.code ?? err.name, name: err.name };
    }
  };
  const set = await attempt(() => saveCheckpoint(memory, runId, { step: 2, by: "worker-a (stale)" }, { fencingToken: h.fencingToken }));
  const cur = await memory.get(checkpointKey(runId));
  const cas = await attempt(() => memory.compareAndSet(checkpointKey(runId), cur?.value ?? null, JSON.stringify({ step: 3, by: "worker-a (stale)" }),
    { namespace: "checkpoint", runId, fencingToken: h.fencingToken }));
  const view = memory.fencedFor(runId, h.fencingToken);
  const viaView = await attempt(() => saveCheckpoint(view, runId, { step: 4, by: "worker-a (stale)" }));
  say({ set, cas, viaView });
  if ("close" in runs) await (runs as FencepostRunStore).close();
  await memory.close();
} else {
  throw new Error(`unknown mode ${mode}`);
}
