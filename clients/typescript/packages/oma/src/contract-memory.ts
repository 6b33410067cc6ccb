// Reusable node:test suites for open-multi-agent's MemoryStore and
// RunJournal seams, written from their specifications:
//
//   import { runMemoryStoreContractSuite, runRunJournalContractSuite } from "@fencepost/oma/contract";
//   runMemoryStoreContractSuite("MyStore", () => new MyStore(...));
//   runRunJournalContractSuite("MyJournal", (name) => MyJournal.open(name));
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, describe, it } from "node:test";
import type { RunEvent, RunJournal } from "./journal.js";
import type { MemoryEntry, MemoryStore } from "./memory.js";

export interface MemoryStoreSuiteOptions {
  /** How many concurrent callers the race tests use (default 16). */
  racers?: number;
  /** The size of the large value the suite round-trips, in UTF-16 code units (default 16 MiB). */
  largeValue?: number;
}

type Closable = { close?: () => Promise<void> };

/**
 * Register the MemoryStore contract tests. Every handle `factory` returns
 * must see the same keys, and the suite owns them: it starts by clear().
 */
export function runMemoryStoreContractSuite(name: string, factory: () => MemoryStore | Promise<MemoryStore>, options: MemoryStoreSuiteOptions = {}): void {
  const racers = options.racers ?? 16;
  const largeValue = options.largeValue ?? 16 * 1024 * 1024;
  const opened: MemoryStore[] = [];
  const open = async () => { const s = await factory(); opened.push(s); return s; };
  const tick = () => new Promise((r) => setTimeout(r, 5));

  describe(`MemoryStore contract: ${name}`, () => {
    after(async () => {
      for (const s of opened) await (s as Closable).close?.();
    });

    it("starts empty after clear(), and reads an absent key as null", async () => {
      const store = await open();
      await store.clear();
      assert.deepEqual(await store.list(), []);
      assert.equal(await store.get("absent"), null);
    });

    it("returns what was set, seen from another handle", async () => {
      const [a, b] = [await open(), await open()];
      await a.set("k", "v", { agent: "x", n: 1 });
      const e = (await b.get("k"))!;
      assert.equal(e.key, "k");
      assert.equal(e.value, "v");
      assert.deepEqual(e.metadata, { agent: "x", n: 1 });
      assert.ok(e.createdAt instanceof Date && Number.isFinite(e.createdAt.getTime()));
    });

    it("keeps createdAt when a key is overwritten, and replaces its metadata", async () => {
      const store = await open();
      await store.set("over", "1", { m: 1 });
      const first = (await store.get("over"))!;
      await tick();
      await store.set("over", "2");
      const second = (await store.get("over"))!;
      assert.equal(second.value, "2");
      assert.equal(second.metadata, undefined);
      assert.equal(second.createdAt.getTime(), first.createdAt.getTime());
    });

    it("shares nothing with the caller: metadata is copied in and out", async () => {
      const store = await open();
      const metadata = { nested: { n: 1 } };
      await store.set("alias", "v", metadata);
      metadata.nested.n = 2;
      const e = (await store.get("alias"))!;
      assert.deepEqual(e.metadata, { nested: { n: 1 } });
      (e.metadata as { nested: { n: number } }).nested.n = 3;
      assert.deepEqual((await store.get("alias"))!.metadata, { nested: { n: 1 } });
    });

    it("setWithExpiry keeps expiresAtTurn until a plain set", async (t) => {
      const store = await open();
      if (!store.setWithExpiry) return t.skip("no setWithExpiry");
      await store.setWithExpiry("exp", "v", 4, { m: true });
      const a = (await store.get("exp"))!;
      assert.equal(a.expiresAtTurn, 4);
      assert.deepEqual(a.metadata, { m: true });
      await store.set("exp", "w");
      const b = (await store.get("exp"))!;
      assert.equal(b.expiresAtTurn, undefined);
      assert.equal(b.createdAt.getTime(), a.createdAt.getTime());
    });

    it("compareAndSet: null expects the key absent, a string expects that value", async (t) => {
      const store = await open();
      if (!store.compareAndSet) return t.skip("no compareAndSet");
      assert.equal(await store.compareAndSet("cas", null, "1"), true);
      assert.equal(await store.compareAndSet("cas", null, "x"), false);
      assert.equal(await store.compareAndSet("cas", "0", "x"), false);
      assert.equal((await store.get("cas"))!.value, "1");
      assert.equal(await store.compareAndSet("cas", "1", "2", { by: "swap" }), true);
      assert.deepEqual((await store.get("cas"))!.metadata, { by: "swap" });
      assert.equal(await store.compareAndSet("cas-absent", "1", "x"), false);
      assert.equal(await store.get("cas-absent"), null);
      await store.delete("cas");
      assert.equal(await store.compareAndSet("cas", "2", "x"), false);
      assert.equal(await store.compareAndSet("cas", null, "3"), true);
    });

    it(`lets exactly one of ${racers} concurrent swaps from one value win`, async (t) => {
      const handles = await Promise.all(Array.from({ length: racers }, () => open()));
      if (!handles[0]!.compareAndSet) return t.skip("no compareAndSet");
      const created = await Promise.all(handles.map((h, i) => h.compareAndSet!("race-new", null, `c${i}`)));
      assert.equal(created.filter(Boolean).length, 1);
      assert.equal((await handles[0]!.get("race-new"))!.value, `c${created.indexOf(true)}`);
      const swapped = await Promise.all(handles.map((h, i) => h.compareAndSet!("race-new", `c${created.indexOf(true)}`, `s${i}`)));
      assert.equal(swapped.filter(Boolean).length, 1);
      assert.equal((await handles[0]!.get("race-new"))!.value, `s${swapped.indexOf(true)}`);
    });

    it(`loses no increment of ${racers} concurrent compareAndSet loops`, async (t) => {
      const handles = await Promise.all(Array.from({ length: racers }, () => open()));
      if (!handles[0]!.compareAndSet) return t.skip("no compareAndSet");
      await Promise.all(handles.map(async (h) => {
        for (let i = 0; i < 3; i++) {
          for (;;) {
            const cur = await h.get("counter");
            if (await h.compareAndSet!("counter", cur?.value ?? null, String(Number(cur?.value ?? 0) + 1))) break;
          }
        }
      }));
      assert.equal((await handles[0]!.get("counter"))!.value, String(3 * racers));
    });

    it("delete removes a key and its createdAt; deleting an absent key is a no-op", async () => {
      const store = await open();
      await store.set("del", "1");
      const before = (await store.get("del"))!.createdAt;
      await store.delete("del");
      await store.delete("del");
      assert.equal(await store.get("del"), null);
      await tick();
      await store.set("del", "2");
      assert.ok((await store.get("del"))!.createdAt.getTime() > before.getTime());
    });

    it(`round-trips a value of ${largeValue} code units exactly`, async () => {
      const store = await open();
      const unit = "turn ✓ \u{1F600} \ud800 \n";
      const big = unit.repeat(Math.ceil(largeValue / unit.length)).slice(0, largeValue);
      await store.set("large", big);
      assert.ok((await store.get("large"))!.value === big);
      await store.set("large", "small");
      assert.equal((await store.get("large"))!.value, "small");
    });

    it("lists every present entry in key order, and clear() removes them all", async () => {
      const store = await open();
      await store.clear();
      for (const k of ["b", "a/2", "a/10", "Z", "é", "a"]) await store.set(k, `v-${k}`);
      await store.delete("Z");
      const listed: MemoryEntry[] = await store.list();
      assert.deepEqual(listed.map((e) => e.key), ["a", "a/10", "a/2", "b", "é"]);
      assert.deepEqual(listed.map((e) => e.value), ["v-a", "v-a/10", "v-a/2", "v-b", "v-é"]);
      await store.clear();
      assert.deepEqual(await store.list(), []);
      assert.equal(await store.get("a"), null);
    });
  });
}

/**
 * Register the RunJournal contract tests. `factory(name)` opens the journal
 * `name`; two calls with one name must reach the same journal.
 */
export function runRunJournalContractSuite(name: string, factory: (name: string) => RunJournal | Promise<RunJournal>): void {
  const prefix = `journal-contract-${randomBytes(4).toString("hex")}`;
  let n = 0;
  const opened: RunJournal[] = [];
  const open = async (journal = `${prefix}-${++n}`) => { const j = await factory(journal); opened.push(j); return { j, journal }; };
  const seqs = (events: RunEvent[]) => events.map((e) => e.seq);

  describe(`RunJournal contract: ${name}`, () => {
    after(async () => {
      for (const j of opened) await j.close();
    });

    it("reads an empty journal as no events", async () => {
      const { j } = await open();
      assert.deepEqual(await j.readFrom(0), []);
    });

    it("returns the events appended one after another, in order, as they were", async () => {
      const { j } = await open();
      await j.append([{ seq: 1, type: "run/start", runId: "r", nested: { a: [1, "é"] } }, { seq: 2, type: "turn/start" }]);
      await j.append([]);
      await j.append([{ seq: 3, type: "turn/end" }]);
      assert.deepEqual(await j.readFrom(0), [
        { seq: 1, type: "run/start", runId: "r", nested: { a: [1, "é"] } }, { seq: 2, type: "turn/start" }, { seq: 3, type: "turn/end" },
      ]);
    });

    it("readFrom(seq) returns the events with seq >= seq", async () => {
      const { j } = await open();
      await j.append([1, 2, 3, 4, 5].map((seq) => ({ seq })));
      assert.deepEqual(seqs(await j.readFrom(3)), [3, 4, 5]);
      assert.deepEqual(seqs(await j.readFrom(5)), [5]);
      assert.deepEqual(seqs(await j.readFrom(6)), []);
      assert.deepEqual(seqs(await j.readFrom(-1)), [1, 2, 3, 4, 5]);
    });

    it("is durable across handles of one journal, and journals are apart", async () => {
      const { j, journal } = await open();
      await j.append([{ seq: 1 }, { seq: 2 }]);
      const { j: again } = await open(journal);
      assert.deepEqual(seqs(await again.readFrom(0)), [1, 2]);
      const { j: other } = await open();
      assert.deepEqual(await other.readFrom(0), []);
    });

    it("describes itself with a kind, when it describes itself", async () => {
      const { j } = await open();
      if (j.describe) assert.equal(typeof j.describe().kind, "string");
    });
  });
}
