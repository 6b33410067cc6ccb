// FencepostMemoryStore and FencepostRunJournal against a real server: the
// MemoryStore and RunJournal contracts, open-multi-agent's own usage of them
// (run records, checkpoints, approvals), fenced checkpoints, and a second
// process for every atomicity and ordering claim.
import assert from "node:assert/strict";
import { spawn, type ChildProcessWithoutNullStreams } from "node:child_process";
import { randomUUID } from "node:crypto";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { after, before, describe, it } from "node:test";
import { createRouterTransport } from "@connectrpc/connect";
import { LeaseLostError, RunNotFoundError, ValidationError } from "@fencepost/client";
import { Atomicity, RunStore as RunStoreService } from "@fencepost/client/gen/fencepost/v1/run_store_pb";
import { startServer, type TestServer } from "@fencepost/client/testing";
import {
  FencepostMemoryStore, FencepostRunJournal, FencepostRunStore, INLINE_VALUE_BYTES, MAX_JOURNAL_EVENTS, RunJournalError, type RunStore,
} from "@fencepost/oma";
import {
  ContractLedger, ManualClock, runMemoryStoreContractSuite, runRunJournalContractSuite, runRunStoreContractSuite,
} from "@fencepost/oma/contract";
import {
  MemoryRunStore, approvalKey, checkpointKey, decideApproval, ensureApprovalRequest, loadCheckpoint, saveCheckpoint,
} from "./oma-patterns.js";

let server: TestServer;
before(async () => { server = await startServer(); });
after(async () => { await server.stop(); });

const fresh = () => `t-${randomUUID().slice(0, 8)}`;
const connect = (namespace = fresh()) => FencepostMemoryStore.connect(server.address, { namespace });
const worker = fileURLToPath(new URL("./oma-store-worker.js", import.meta.url));

function spawnWorker(args: string[]): ChildProcessWithoutNullStreams {
  return spawn(process.execPath, [worker, ...args], { stdio: ["pipe", "pipe", "pipe"] });
}

/** Every JSON line a worker prints, until it exits 0. */
function lines(child: ChildProcessWithoutNullStreams, onLine: (v: Record<string, unknown>) => void = () => {}): Promise<Record<string, unknown>[]> {
  return new Promise((resolve, reject) => {
    const out: Record<string, unknown>[] = [];
    let err = "";
    child.stderr.on("data", (d) => { err += d; });
    createInterface({ input: child.stdout }).on("line", (l) => {
      const v = JSON.parse(l) as Record<string, unknown>;
      out.push(v);
      onLine(v);
    });
    child.on("exit", (code) => (code === 0 ? resolve(out) : reject(new Error(`worker exited ${code}: ${err}`))));
  });
}

runMemoryStoreContractSuite("FencepostMemoryStore", () => connect("memory-contract"));
runRunJournalContractSuite("FencepostRunJournal", (name) => FencepostRunJournal.connect(server.address, name));

// open-multi-agent's MemoryStoreRunStore, over this store, passes the run-store contract suite.
runRunStoreContractSuite("MemoryStoreRunStore over FencepostMemoryStore", async () => new MemoryRunStore(await connect("runs-contract"), "cross-process"));

describe("FencepostMemoryStore beyond the contract", () => {
  let store: FencepostMemoryStore;
  let other: FencepostMemoryStore;
  before(async () => {
    const ns = fresh();
    store = await connect(ns);
    other = await connect(ns); // a second handle on the same keys
  });
  after(async () => { await store.close(); await other.close(); });

  it("declares cross-process atomicity from the server", () => {
    assert.equal(store.atomicity, "cross-process");
  });

  it("passes the client's options through unchanged", async () => {
    // A stand-in server that declares in-process atomicity: only a transport option that reached the client can say so.
    const declaring = createRouterTransport(({ service }) => {
      service(RunStoreService, { describe: () => ({ atomicity: Atomicity.IN_PROCESS, backend: "test", schema: 1 }) } as never);
    });
    const weak = await FencepostMemoryStore.connect("unused", { connectTransport: declaring, namespace: "n" });
    assert.equal(weak.atomicity, "process");
    await weak.close();
    const named = await FencepostMemoryStore.connect(server.address, { owner: "memory-owner", transport: "unary" });
    assert.equal(named.client.owner, "memory-owner");
    await named.close();
    const journal = await FencepostRunJournal.connect(server.address, fresh(), { owner: "journal-owner" });
    assert.equal(journal.client.owner, "journal-owner");
    await journal.close();
  });

  it("keeps namespaces apart: list() and clear() see their own keys only", async () => {
    const s = await connect();
    const neighbour = await connect();
    await neighbour.set("n", "kept");
    for (const k of ["b", "a/2", "__oma_run__/x", "a/10", "Z", "é", "a"]) await s.set(k, `v-${k}`);
    await s.delete("Z");
    const keys = (await s.list()).map((e) => e.key);
    assert.deepEqual(keys, ["__oma_run__/x", "a", "a/10", "a/2", "b", "é"]);
    assert.deepEqual((await s.list()).map((e) => e.value), keys.map((k) => `v-${k}`));
    await s.clear();
    assert.deepEqual(await s.list(), []);
    assert.equal(await s.get("a"), null);
    assert.equal((await neighbour.get("n"))?.value, "kept");
    await s.close();
    await neighbour.close();
  });

  it("keeps values of any size byte for byte: 16 MiB through an artifact, long keys hashed", async () => {
    const unit = "conversation turn ✓ \u{1F600} \ud800 ";
    const big = unit.repeat(Math.ceil((16 * 1024 * 1024) / unit.length)).slice(0, 16 * 1024 * 1024);
    assert.ok(big.length * 1 >= 16 * 1024 * 1024);
    await store.set("big", big, { size: big.length });
    const got = (await other.get("big"))!;
    assert.equal(got.value.length, big.length);
    assert.ok(got.value === big, "the 16 MiB value round-trips exactly (a lone surrogate included)");
    assert.equal(await other.compareAndSet("big", big.slice(1), "small"), false);
    assert.equal(await other.compareAndSet("big", big, "small"), true);
    assert.equal((await store.get("big"))?.value, "small");
    const edge = "x".repeat(INLINE_VALUE_BYTES - 2); // its JSON text is exactly the inline limit
    await store.set("edge", edge);
    assert.equal((await store.get("edge"))?.value, edge);
    await store.set("edge", edge + "y");
    assert.equal((await store.get("edge"))?.value, edge + "y");
    const longKey = `k/${"ü".repeat(600)}\n`;
    await store.set(longKey, "long");
    assert.equal((await other.get(longKey))?.value, "long");
    assert.ok((await store.list()).some((e) => e.key === longKey));
  });

  it("refuses bad input naming the field, and writes nothing", async () => {
    await assert.rejects(store.set("k", 5 as never), (e: unknown) => e instanceof ValidationError && e.field === "value");
    await assert.rejects(store.set(7 as never, "v"), (e: unknown) => e instanceof ValidationError && e.field === "key");
    await assert.rejects(store.set("k", "v", [] as never), (e: unknown) => e instanceof ValidationError && e.field === "metadata");
    await assert.rejects(store.setWithExpiry("k", "v", Number.NaN), (e: unknown) => e instanceof ValidationError && e.field === "expiresAtTurn");
    await assert.rejects(store.compareAndSet("k", 3 as never, "v"), (e: unknown) => e instanceof ValidationError && e.field === "expectedValue");
    await assert.rejects(store.set(checkpointKey("r"), "v", { fencingToken: 1 }), (e: unknown) => e instanceof ValidationError && e.field === "metadata.runId");
    await assert.rejects(store.set(checkpointKey("r"), "v", { runId: "r", fencingToken: 1.5 }),
      (e: unknown) => e instanceof ValidationError && e.field === "metadata.fencingToken");
    await assert.rejects(store.set(checkpointKey("no-such-run"), "v", { runId: "no-such-run", fencingToken: 1 }),
      (e: unknown) => e instanceof RunNotFoundError);
    assert.equal(await store.get("k"), null);
    assert.equal(await store.get(checkpointKey("r")), null);
    await assert.rejects(FencepostMemoryStore.connect(server.address, { namespace: "a/b" }), (e: unknown) => e instanceof ValidationError && e.field === "namespace");
  });
});

describe("FencepostMemoryStore under open-multi-agent's own usage", () => {
  it("holds checkpoints: the latest snapshot per run, as saved and loaded", async () => {
    const store = await connect();
    assert.equal(await loadCheckpoint(store, "r1"), null);
    const conversation = Array.from({ length: 2000 }, (_, i) => ({ role: i % 2 ? "assistant" : "user", content: `message ${i} `.repeat(20) }));
    await saveCheckpoint(store, "r1", { version: 5, mode: "runTasks", conversation });
    await saveCheckpoint(store, "r1", { version: 5, mode: "runTasks", conversation: conversation.slice(0, 10) });
    const loaded = await loadCheckpoint(store, "r1");
    assert.equal((loaded!["conversation"] as unknown[]).length, 10);
    assert.equal((await store.get(checkpointKey("r1")))?.metadata?.["namespace"], "checkpoint");
    await store.close();
  });

  it("holds durable approvals: the request once, the first decision wins", async () => {
    const store = await connect();
    const request = { id: "apr_1", runId: "r1" };
    await ensureApprovalRequest(store, request);
    await ensureApprovalRequest(store, request); // converges
    await assert.rejects(ensureApprovalRequest(store, { id: "apr_1", runId: "r2" }));
    const results = await Promise.all(["alice", "bob", "carol"].map((who) => decideApproval(store, "apr_1", who, "approved")));
    assert.equal(results.filter(Boolean).length, 1);
    const decided = JSON.parse((await store.get(approvalKey("apr_1")))!.value) as { decision: { reviewer: { id: string } } };
    assert.equal(decided.decision.reviewer.id, ["alice", "bob", "carol"][results.indexOf(true)]);
    await store.close();
  });
});

describe("fenced checkpoints", () => {
  for (const variant of ["ledger", "memory"] as const) {
    it(`refuse a stale token with RUN_LEASE_LOST and write nothing (runs in ${variant === "ledger" ? "FencepostRunStore" : "the memory store"})`, async () => {
      const memory = await connect();
      const runs: RunStore = variant === "ledger" ? await FencepostRunStore.connect(server.address) : new MemoryRunStore(memory, "cross-process");
      const runId = fresh();
      const clock = new ManualClock();
      const a = await new ContractLedger(runs, "a", clock, 1000).acquire(runId);
      await saveCheckpoint(memory, runId, { by: "a" }, { fencingToken: a.fencingToken });
      clock.advance(2000);
      const b = await new ContractLedger(runs, "b", clock, 1000).acquire(runId);
      assert.equal(b.fencingToken, a.fencingToken + 1);
      const before = (await memory.get(checkpointKey(runId)))!;
      await assert.rejects(saveCheckpoint(memory, runId, { by: "a, stale" }, { fencingToken: a.fencingToken }),
        (e: unknown) => e instanceof LeaseLostError && e.code === "RUN_LEASE_LOST");
      await assert.rejects(memory.compareAndSet(checkpointKey(runId), before.value, "{}", { runId, fencingToken: a.fencingToken }),
        (e: unknown) => e instanceof LeaseLostError);
      await assert.rejects(memory.setWithExpiry(checkpointKey(runId), "{}", 3, { runId, fencingToken: a.fencingToken }),
        (e: unknown) => e instanceof LeaseLostError);
      const large = "x".repeat(INLINE_VALUE_BYTES);
      await assert.rejects(saveCheckpoint(memory, runId, { by: "a, stale", large }, { fencingToken: a.fencingToken }),
        (e: unknown) => e instanceof LeaseLostError, "a large value is refused too");
      assert.deepEqual(await memory.get(checkpointKey(runId)), before);
      await saveCheckpoint(memory.fencedFor(runId, b.fencingToken), runId, { by: "b", large });
      assert.deepEqual(await loadCheckpoint(memory, runId), { by: "b", large });
      await saveCheckpoint(memory.fencedFor(runId, b.fencingToken), runId, { by: "b" });
      assert.deepEqual(await loadCheckpoint(memory, runId), { by: "b" });
      // the run record itself is not fenced by its own metadata (MemoryStoreRunStore writes fencingToken there)
      await new ContractLedger(runs, "b", clock, 1000).heartbeat(b);
      if (variant === "ledger") await (runs as FencepostRunStore).close();
      await memory.close();
    });
  }

  for (const variant of ["ledger", "memory"] as const) {
    it(`refuse a write whose run is taken over after the store looked it up (${variant})`, async () => {
      const memory = await connect();
      const runs: RunStore = variant === "ledger" ? await FencepostRunStore.connect(server.address) : new MemoryRunStore(memory, "cross-process");
      const runId = fresh();
      const clock = new ManualClock();
      const a = await new ContractLedger(runs, "a", clock, 1000).acquire(runId);
      await saveCheckpoint(memory, runId, { by: "a" }, { fencingToken: a.fencingToken });
      // Land the takeover between the store's look-up of the run and its write.
      const internals = memory as unknown as { fenceFor: (runId: string, token: number) => Promise<unknown> };
      const lookUp = internals.fenceFor.bind(memory);
      let calls = 0;
      internals.fenceFor = async (id, token) => {
        calls++;
        const fence = await lookUp(id, token);
        if (calls === 1) {
          clock.advance(2000);
          await new ContractLedger(runs, "b", clock, 1000).acquire(runId);
        }
        return fence;
      };
      await assert.rejects(saveCheckpoint(memory, runId, { by: "a, stale" }, { fencingToken: a.fencingToken }),
        (e: unknown) => e instanceof LeaseLostError && e.code === "RUN_LEASE_LOST");
      // the server refused the write (ledger); the record's guard failed and the retry saw the new token (memory)
      assert.equal(calls, variant === "ledger" ? 1 : 2);
      assert.deepEqual(await loadCheckpoint(memory, runId), { by: "a" });
      if (variant === "ledger") await (runs as FencepostRunStore).close();
      await memory.close();
    });
  }

  for (const variant of ["ledger", "memory"] as const) {
    it(`two processes, a takeover between the record write and the snapshot write: no stale snapshot is readable (${variant})`, async () => {
      const ns = fresh();
      const runId = fresh();
      const memory = await connect(ns);
      const runs: RunStore = variant === "ledger" ? await FencepostRunStore.connect(server.address) : new MemoryRunStore(memory, "cross-process");
      const child = spawnWorker(["stale", server.address, ns, runId, variant]);
      const seen: string[] = [];
      const done = lines(child, (v) => {
        if (v["recorded"] === undefined) return;
        // A has written its record and stalls: B takes the run over, then A goes on.
        void (async () => {
          const clock = new ManualClock();
          clock.advance(2000);
          const b = await new ContractLedger(runs, "worker-b", clock, 1000).acquire(runId);
          seen.push(String((await loadCheckpoint(memory, runId))?.["by"]));
          child.stdin.end(`taken over at ${b.fencingToken}\n`);
        })().catch((e: unknown) => child.kill() && seen.push(String(e)));
      });
      // Meanwhile keep reading the snapshot: it must never be one of A's stale ones.
      let reading = true;
      const reader = (async () => {
        while (reading) {
          const cp = await loadCheckpoint(memory, runId);
          if (cp) seen.push(String(cp["by"]));
        }
      })();
      const out = await done;
      reading = false;
      await reader;
      const result = out.at(-1) as Record<string, { refused?: string; name?: string }>;
      for (const write of ["set", "cas", "viaView"]) {
        assert.equal(result[write]?.refused, "RUN_LEASE_LOST", `${write}: ${JSON.stringify(result[write])}`);
        assert.equal(result[write]?.name, "LeaseLostError");
      }
      assert.deepEqual(await loadCheckpoint(memory, runId), { step: 1, by: "worker-a" });
      assert.ok(seen.length > 0);
      assert.deepEqual([...new Set(seen)], ["worker-a"], `snapshots read: ${[...new Set(seen)].join(", ")}`);
      if (variant === "ledger") await (runs as FencepostRunStore).close();
      await memory.close();
    });
  }
});

describe("two processes on one FencepostMemoryStore", () => {
  it("compareAndSet increments from two processes lose none, racing sets keep createdAt, each approval has one winner", async () => {
    const ns = fresh();
    const store = await connect(ns);
    const n = 40;
    for (let i = 0; i < n; i++) await ensureApprovalRequest(store, { id: `req-${i}`, runId: "r" });
    await store.set("shared", "first");
    const createdAt = (await store.get("shared"))!.createdAt;
    const startAt = Date.now() + 1500;
    const results = await Promise.all(["p1", "p2"].map(async (me) =>
      (await lines(spawnWorker(["cas", server.address, ns, me, String(startAt), String(n)]))).at(-1) as { me: string; retries: number; won: string[] }));
    assert.equal((await store.get("counter"))?.value, String(2 * n));
    const shared = (await store.get("shared"))!;
    assert.match(shared.value, new RegExp(`^p[12]-${n - 1}$`), "the last set of one of the processes");
    assert.deepEqual(shared.metadata, { by: shared.value.slice(0, 2) });
    assert.equal(shared.createdAt.getTime(), createdAt.getTime(), "racing sets keep the first createdAt");
    const won = results.flatMap((r) => r.won);
    assert.deepEqual([...won].sort(), Array.from({ length: n }, (_, i) => `req-${i}`).sort(), "every request decided exactly once");
    for (const r of results) {
      for (const id of r.won) {
        const rec = JSON.parse((await store.get(approvalKey(id)))!.value) as { decision: { reviewer: { id: string } } };
        assert.equal(rec.decision.reviewer.id, r.me);
      }
    }
    assert.ok(results.some((r) => r.retries > 0) || results.every((r) => r.won.length > 0), "the processes met");
    await store.close();
  });
});

describe("FencepostRunJournal", () => {
  it("appends in order, reads from a seq, and knows its last seq without reading", async () => {
    const name = fresh();
    const journal = await FencepostRunJournal.connect(server.address, name);
    assert.equal(await journal.lastSeq(), 0);
    assert.deepEqual(await journal.readFrom(0), []);
    await journal.append([{ seq: 1, type: "run/start" }, { seq: 2, type: "model/call", text: "é\u{1F600}" }]);
    await journal.append([]);
    await journal.append([{ seq: 5, type: "tool/call" }]); // a restored attempt may start above a gap
    assert.equal(await journal.lastSeq(), 5);
    const again = await FencepostRunJournal.connect(server.address, name); // durable: another handle sees it
    assert.deepEqual((await again.readFrom(0)).map((e) => e.seq), [1, 2, 5]);
    assert.deepEqual(await again.readFrom(2), [{ seq: 2, type: "model/call", text: "é\u{1F600}" }, { seq: 5, type: "tool/call" }]);
    assert.deepEqual(await again.readFrom(6), []);
    assert.deepEqual(journal.describe(), { kind: "FencepostRunJournal", path: `oma-journal/${name}` });
    const big = Array.from({ length: 50 }, (_, i) => ({ seq: 10 + i, type: "model/call", content: "x".repeat(20_000) }));
    await journal.append(big); // 1 MiB in one append: through an artifact, still atomic
    assert.equal((await again.readFrom(10)).length, 50);
    assert.equal((await again.readFrom(59))[0]!["content"], "x".repeat(20_000));
    await again.close();
    await journal.close();
    await assert.rejects(journal.lastSeq(), (e: unknown) => e instanceof RunJournalError && e.code === "JOURNAL_CLOSED");
  });

  it("refuses seqs that do not continue it, bad events and appends past its bound, writing nothing", async () => {
    const journal = await FencepostRunJournal.connect(server.address, fresh(), { maxEvents: 5 });
    await journal.append([{ seq: 1 }, { seq: 2 }, { seq: 3 }]);
    const refused = (code: string, field?: string) => (e: unknown) => e instanceof RunJournalError && e.code === code && (field === undefined || e.field === field);
    await assert.rejects(journal.append([{ seq: 3 }]), refused("JOURNAL_SEQ_CONFLICT", "events[0].seq"));
    await assert.rejects(journal.append([{ seq: 4 }, { seq: 4 }]), refused("JOURNAL_SEQ_CONFLICT", "events[1].seq"));
    await assert.rejects(journal.append([{ seq: 4 }, { seq: 0 } as never]), refused("JOURNAL_VALIDATION_ERROR", "events[1].seq"));
    await assert.rejects(journal.append([{ seq: 4, n: 1n } as never]), refused("JOURNAL_VALIDATION_ERROR", "events"));
    await assert.rejects(journal.append([{ seq: 4 }, { seq: 5 }, { seq: 6 }]), refused("JOURNAL_FULL"));
    assert.deepEqual((await journal.readFrom(0)).map((e) => e.seq), [1, 2, 3]);
    await journal.append([{ seq: 4 }, { seq: 5 }]);
    await assert.rejects(journal.append([{ seq: 6 }]), refused("JOURNAL_FULL"));
    assert.equal(await journal.size(), 5);
    await journal.close();
    await assert.rejects(FencepostRunJournal.connect(server.address, "j", { maxEvents: MAX_JOURNAL_EVENTS + 1 }), refused("JOURNAL_VALIDATION_ERROR", "maxEvents"));
  });

  it("two processes appending at once: no append interleaves, seqs dense and increasing", async () => {
    const name = fresh();
    const startAt = Date.now() + 1500;
    const batches = 30;
    const results = await Promise.all(["p1", "p2"].map(async (me) =>
      (await lines(spawnWorker(["journal", server.address, name, me, String(startAt), String(batches)]))).at(-1) as { me: string; conflicts: number }));
    const journal = await FencepostRunJournal.connect(server.address, name);
    const events = (await journal.readFrom(0)) as unknown as { seq: number; writer: string; batch: number; index: number; of: number }[];
    assert.deepEqual(events.map((e) => e.seq), Array.from({ length: events.length }, (_, i) => i + 1), "dense and increasing");
    for (let i = 0; i < events.length;) {
      const e = events[i]!;
      assert.equal(e.index, 0, `an append starts at its first event (seq ${e.seq})`);
      for (let j = 0; j < e.of; j++) {
        const f = events[i + j]!;
        assert.deepEqual([f.writer, f.batch, f.index], [e.writer, e.batch, j], `seq ${f.seq}: another append interleaved`);
      }
      i += e.of;
    }
    for (const me of ["p1", "p2"]) {
      assert.deepEqual([...new Set(events.filter((e) => e.writer === me).map((e) => e.batch))], Array.from({ length: batches }, (_, b) => b));
    }
    assert.equal(await journal.lastSeq(), events.length);
    assert.ok(results.every((r) => r.conflicts >= 0));
    await journal.close();
  });
});
