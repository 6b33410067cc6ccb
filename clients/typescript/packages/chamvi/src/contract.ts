// A reusable node:test suite for any implementation of chamvi's IStore,
// written from the store contract: every operation of the eight parts and
// the nine rules (one expiry rule, time from the store's clock, no
// aliasing, atomic under concurrency, ordering, throwing guards,
// checkpoints, state filters, artifacts).
//
//   import { runStoreContractSuite } from "@fencepost/chamvi/contract";
//   runStoreContractSuite("MyStore", async () => ({ store, clock }));
//
// `clock.advance(ms)` must move the time the store decides expiry with
// (an injected clock for an in-memory store; the server's test clock for
// FencepostStore). Errors are recognised by class name
// (InvalidRunStateError, RunNotFoundError), so each store may use its own.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, describe, it } from "node:test";
import type { IStore, Run, TestClock } from "./types.js";

export interface StoreUnderTest {
  store: IStore;
  clock: TestClock;
  close?(): Promise<void>;
}

export interface StoreSuiteOptions {
  /** Concurrent callers in the race tests (default 16). */
  racers?: number;
  /** Runs in the "no default page size" listing (default 1500, past one 1000-item page). */
  manyRuns?: number;
}

async function throwsNamed(p: Promise<unknown>, name: string): Promise<void> {
  try {
    await p;
  } catch (e) {
    assert.equal((e as Error).name, name, `expected ${name}, got ${String(e)}`);
    return;
  }
  assert.fail(`expected ${name}, but the call succeeded`);
}

const sorted = (runs: Run[]) => [...runs].sort((a, b) =>
  (a.createdAt!.getTime() - b.createdAt!.getTime()) || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));

/** Register the contract tests for the store `factory` makes. */
export function runStoreContractSuite(name: string, factory: () => Promise<StoreUnderTest>, options: StoreSuiteOptions = {}): void {
  const racers = options.racers ?? 16;
  const manyRuns = options.manyRuns ?? 1500;
  const prefix = `c${randomBytes(4).toString("hex")}`;
  let n = 0;
  const id = (what: string) => `${prefix}-${what}-${++n}`;
  let sut: StoreUnderTest | undefined;
  const get = async () => (sut ??= await factory());

  describe(`IStore contract: ${name}`, () => {
    after(async () => { await sut?.close?.(); });

    describe("runs", () => {
      it("createRun inserts only when absent and keeps the stored run", async () => {
        const { store } = await get();
        const rid = id("run");
        assert.equal(await store.createRun({ id: rid, agent: "a", status: "queued", input: { n: 1 } }), true);
        assert.equal(await store.createRun({ id: rid, agent: "b", status: "running", input: { n: 2 } }), false);
        const run = await store.getRun(rid);
        assert.equal(run?.agent, "a");
        assert.equal(run?.status, "queued");
        assert.deepEqual(run?.input, { n: 1 });
        assert.ok(run?.createdAt instanceof Date);
        assert.equal(await store.getRun(id("missing")), undefined);
      });

      it("createRun is atomic under concurrency: exactly one winner", async () => {
        const { store } = await get();
        const rid = id("run-race");
        const results = await Promise.all(Array.from({ length: racers }, (_, i) =>
          store.createRun({ id: rid, agent: "a", status: "queued", input: { racer: i } })));
        assert.equal(results.filter(Boolean).length, 1);
        assert.deepEqual((await store.getRun(rid))?.input, { racer: results.indexOf(true) });
      });

      it("updateRun patches, and removes a field given as undefined", async () => {
        const { store } = await get();
        const rid = id("upd");
        await store.createRun({ id: rid, agent: "a", status: "queued", concurrencyKey: "k", metadata: { m: 1 } });
        const u = await store.updateRun(rid, { status: "running", output: { ok: true }, metadata: undefined });
        assert.equal(u.status, "running");
        assert.deepEqual(u.output, { ok: true });
        assert.equal(u.metadata, undefined);
        assert.equal(u.concurrencyKey, "k");
        assert.deepEqual(await store.getRun(rid), u);
      });

      it("updateRun guards throw InvalidRunStateError and RunNotFoundError, changing nothing", async () => {
        const { store, clock } = await get();
        const rid = id("guard");
        await store.createRun({ id: rid, agent: "a", status: "queued" });
        await throwsNamed(store.updateRun(rid, { status: "done" }, { expectStatus: ["running"] }), "InvalidRunStateError");
        await throwsNamed(store.updateRun(rid, { status: "done" }, { expectOwner: "w1" }), "InvalidRunStateError");
        assert.equal(await store.claimRun(rid, "w1", 1000), true);
        await throwsNamed(store.updateRun(rid, { status: "done" }, { expectOwner: "w2" }), "InvalidRunStateError");
        assert.equal((await store.getRun(rid))?.status, "queued");
        await clock.advance(5000); // the claim expired, nobody took it: the owner may still finish
        const done = await store.updateRun(rid, { status: "done" }, { expectStatus: ["queued", "running"], expectOwner: "w1" });
        assert.equal(done.status, "done");
        await throwsNamed(store.updateRun(id("nope"), { status: "x" }), "RunNotFoundError");
      });

      it("listRuns orders by createdAt then id, filters, and counts total ignoring limit and offset", async () => {
        const { store } = await get();
        const agent = id("agent");
        const ids = ["m", "c", "x", "a", "q", "b"].map((s) => `${agent}-${s}`);
        await Promise.all(ids.map((rid, i) => store.createRun({
          id: rid, agent, status: i % 2 ? "running" : "queued", ...(i < 3 ? { concurrencyKey: "ck" } : {}),
        })));
        const all = await store.listRuns({ agent });
        assert.equal(all.total, 6);
        assert.deepEqual(all.data.map((r) => r.id), sorted(all.data).map((r) => r.id));
        const page = await store.listRuns({ agent, limit: 2, offset: 1 });
        assert.equal(page.total, 6);
        assert.deepEqual(page.data.map((r) => r.id), all.data.slice(1, 3).map((r) => r.id));
        const running = await store.listRuns({ agent, status: ["running"] });
        assert.equal(running.total, 3);
        assert.ok(running.data.every((r) => r.status === "running"));
        const keyed = await store.listRuns({ agent, concurrencyKey: "ck" });
        assert.deepEqual(new Set(keyed.data.map((r) => r.id)), new Set(ids.slice(0, 3)));
        assert.equal((await store.listRuns({ agent, limit: 0 })).data.length, 0);
      });

      it(`listRuns has no default page size (${manyRuns} runs)`, async () => {
        const { store } = await get();
        const agent = id("many");
        for (let i = 0; i < manyRuns; i += 50) {
          await Promise.all(Array.from({ length: Math.min(50, manyRuns - i) }, (_, j) =>
            store.createRun({ id: `${agent}-${String(i + j).padStart(5, "0")}`, agent, status: "queued" })));
        }
        const all = await store.listRuns({ agent });
        assert.equal(all.total, manyRuns);
        assert.equal(all.data.length, manyRuns);
        assert.equal(new Set(all.data.map((r) => r.id)).size, manyRuns);
        assert.equal((await store.listRuns({ agent, offset: manyRuns - 10 })).data.length, 10);
      });

      it("claimRun succeeds only when unclaimed or expired; renewClaim only for the live owner (one expiry rule)", async () => {
        const { store, clock } = await get();
        const rid = id("claim");
        await store.createRun({ id: rid, agent: "a", status: "queued" });
        assert.equal(await store.claimRun(rid, "w1", 60_000), true);
        assert.equal((await store.getRun(rid))?.claim?.owner, "w1");
        assert.equal(await store.claimRun(rid, "w2", 60_000), false);
        assert.equal(await store.claimRun(rid, "w1", 60_000), false, "a live claim, even one's own, is not re-claimed");
        assert.equal(await store.renewClaim(rid, "w2", 60_000), false);
        assert.equal(await store.renewClaim(rid, "w1", 60_000), true);
        await clock.advance(50_000);
        assert.equal(await store.claimRun(rid, "w2", 60_000), false, "still live before T + ttl");
        await clock.advance(10_000);
        assert.equal(await store.renewClaim(rid, "w1", 60_000), false, "expired at T + ttl: no renewal");
        assert.equal(await store.claimRun(rid, "w2", 60_000), true, "expired at T + ttl: taken over");
        assert.equal((await store.getRun(rid))?.claim?.owner, "w2");
        assert.equal(await store.claimRun(id("no-run"), "w1", 1000), false);
        assert.equal(await store.renewClaim(id("no-run"), "w1", 1000), false);
      });

      it("claimRun is atomic under concurrency: exactly one owner", async () => {
        const { store } = await get();
        const rid = id("claim-race");
        await store.createRun({ id: rid, agent: "a", status: "queued" });
        const results = await Promise.all(Array.from({ length: racers }, (_, i) => store.claimRun(rid, `w${i}`, 60_000)));
        assert.equal(results.filter(Boolean).length, 1);
        assert.equal((await store.getRun(rid))?.claim?.owner, `w${results.indexOf(true)}`);
      });
    });

    describe("steps and checkpoints", () => {
      it("appendStep is append-only and listSteps keeps append order", async () => {
        const { store } = await get();
        const rid = id("steps");
        for (const name of ["fetch", "parse", "store", "notify"]) await store.appendStep({ runId: rid, name, output: { name } });
        await store.appendStep({ runId: id("other"), name: "elsewhere" });
        const steps = await store.listSteps(rid);
        assert.deepEqual(steps.map((s) => s.name), ["fetch", "parse", "store", "notify"]);
        assert.deepEqual(steps.map((s) => s.output), ["fetch", "parse", "store", "notify"].map((name) => ({ name })));
        assert.deepEqual(await store.listSteps(id("none")), []);
      });

      it("saveCheckpoint keeps the highest stepIndex; an equal index replaces; a lower one is ignored", async () => {
        const { store } = await get();
        const rid = id("ckpt");
        assert.equal(await store.latestCheckpoint(rid), undefined);
        await store.saveCheckpoint({ runId: rid, stepIndex: 2, state: { v: "two" } });
        await store.saveCheckpoint({ runId: rid, stepIndex: 1, state: { v: "one" } });
        assert.deepEqual((await store.latestCheckpoint(rid))?.state, { v: "two" });
        await store.saveCheckpoint({ runId: rid, stepIndex: 2, state: { v: "two, with an approval" } });
        assert.deepEqual((await store.latestCheckpoint(rid))?.state, { v: "two, with an approval" });
        await store.saveCheckpoint({ runId: rid, stepIndex: 5, state: null });
        const latest = await store.latestCheckpoint(rid);
        assert.equal(latest?.stepIndex, 5);
        assert.equal(latest?.state, null);
      });
    });

    describe("idempotency keys and locks", () => {
      it("claimKey: the first caller wins, the others get its runId until the key expires", async () => {
        const { store, clock } = await get();
        const scope = id("scope");
        const results = await Promise.all(Array.from({ length: racers }, (_, i) => store.claimKey(scope, "order-1", `run-${i}`, 60_000)));
        const winners = results.filter((r) => r.created);
        assert.equal(winners.length, 1);
        assert.ok(results.every((r) => r.runId === winners[0]!.runId));
        assert.deepEqual(await store.claimKey(scope, "order-1", "late", 60_000), { created: false, runId: winners[0]!.runId });
        assert.equal((await store.claimKey(id("scope"), "order-1", "other-scope", 60_000)).created, true);
        await clock.advance(60_000);
        assert.deepEqual(await store.claimKey(scope, "order-1", "after-expiry", 60_000), { created: true, runId: "after-expiry" });
      });

      it("locks: granted when free, extended for the holder, released only by it, free again at expiry", async () => {
        const { store, clock } = await get();
        const key = id("lock");
        assert.equal(await store.acquire(key, "a", 60_000), true);
        assert.equal(await store.acquire(key, "b", 60_000), false);
        assert.equal(await store.acquire(key, "a", 60_000), true, "the holder extends");
        await store.release(key, "b");
        assert.equal(await store.acquire(key, "b", 60_000), false, "a release by another owner changes nothing");
        await store.release(key, "a");
        assert.equal(await store.acquire(key, "b", 60_000), true);
        await clock.advance(60_000);
        assert.equal(await store.acquire(key, "c", 60_000), true, "expired at T + ttl");
        const race = id("lock-race");
        const results = await Promise.all(Array.from({ length: racers }, (_, i) => store.acquire(race, `o${i}`, 60_000)));
        assert.equal(results.filter(Boolean).length, 1);
      });
    });

    describe("effects and state", () => {
      it("getEffect finds a recorded result, also null; putEffect overwrites", async () => {
        const { store } = await get();
        const key = id("effect");
        assert.equal(await store.getEffect(key), undefined);
        await store.putEffect(key, null);
        assert.deepEqual(await store.getEffect(key), { result: null });
        await store.putEffect(key, { charged: 1234, currency: "EUR" });
        assert.deepEqual(await store.getEffect(key), { result: { charged: 1234, currency: "EUR" } });
      });

      it("kvGet/kvSet per agent; an absent key is undefined, a stored null is null", async () => {
        const { store } = await get();
        const agent = id("kv");
        assert.equal(await store.kvGet(agent, "k"), undefined);
        await store.kvSet(agent, "k", { deep: { list: [1, "two", { three: 3 }] } });
        assert.deepEqual(await store.kvGet(agent, "k"), { deep: { list: [1, "two", { three: 3 }] } });
        assert.equal(await store.kvGet(id("kv"), "k"), undefined, "per agent");
        await store.kvSet(agent, "n", null);
        assert.equal(await store.kvGet(agent, "n"), null);
        await store.kvSet(agent, "s", "ünïcødé ✓ 𝄞");
        assert.equal(await store.kvGet(agent, "s"), "ünïcødé ✓ 𝄞");
      });

      it("docList matches top-level fields by equality, ordered by id, with a limit; docUpsert replaces; docDelete removes", async () => {
        const { store } = await get();
        const agent = id("docs");
        await store.docUpsert(agent, "tickets", "t3", { state: "open", prio: 1, tags: ["a"] });
        await store.docUpsert(agent, "tickets", "t1", { state: "open", prio: 2 });
        await store.docUpsert(agent, "tickets", "t2", { state: "closed", prio: 1 });
        await store.docUpsert(agent, "other", "t9", { state: "open" });
        const open = await store.docList(agent, "tickets", { where: { state: "open" } });
        assert.deepEqual(open.map((d) => d.id), ["t1", "t3"]);
        assert.deepEqual((await store.docList(agent, "tickets", { where: { state: "open", prio: 1 } })).map((d) => d.id), ["t3"]);
        assert.deepEqual((await store.docList(agent, "tickets", { where: { tags: ["a"] } })).map((d) => d.id), ["t3"]);
        assert.deepEqual((await store.docList(agent, "tickets")).map((d) => d.id), ["t1", "t2", "t3"]);
        assert.deepEqual((await store.docList(agent, "tickets", { limit: 2 })).map((d) => d.id), ["t1", "t2"]);
        await store.docUpsert(agent, "tickets", "t1", { state: "closed" });
        assert.deepEqual((await store.docList(agent, "tickets", { where: { state: "closed" } })).map((d) => d.doc), [{ state: "closed" }, { state: "closed", prio: 1 }]);
        await store.docDelete(agent, "tickets", "t1");
        await store.docDelete(agent, "tickets", "never");
        assert.deepEqual((await store.docList(agent, "tickets")).map((d) => d.id), ["t2", "t3"]);
      });
    });

    describe("no aliasing", () => {
      it("values are copied in and out", async () => {
        const { store } = await get();
        const rid = id("alias");
        const input = { nested: { n: 1 } };
        await store.createRun({ id: rid, agent: "a", status: "queued", input });
        input.nested.n = 2;
        const got = await store.getRun(rid);
        assert.deepEqual(got?.input, { nested: { n: 1 } });
        (got!.input as { nested: { n: number } }).nested.n = 3;
        assert.deepEqual((await store.getRun(rid))?.input, { nested: { n: 1 } });
        const agent = id("alias-kv");
        const value = { list: [1] };
        await store.kvSet(agent, "k", value);
        value.list.push(2);
        const kv = (await store.kvGet(agent, "k")) as { list: number[] };
        kv.list.push(3);
        assert.deepEqual(await store.kvGet(agent, "k"), { list: [1] });
        const doc = { a: { b: 1 } };
        await store.docUpsert(agent, "c", "d", doc);
        doc.a.b = 2;
        assert.deepEqual((await store.docList(agent, "c"))[0]?.doc, { a: { b: 1 } });
        const state = { s: [1] };
        await store.saveCheckpoint({ runId: rid, stepIndex: 1, state });
        state.s.push(2);
        assert.deepEqual((await store.latestCheckpoint(rid))?.state, { s: [1] });
        const result = { r: 1 };
        await store.putEffect(rid, result);
        result.r = 2;
        assert.deepEqual(await store.getEffect(rid), { result: { r: 1 } });
      });
    });

    describe("artifacts", () => {
      it("putArtifact is insert-if-absent and keeps the stored metadata and bytes", async () => {
        const { store } = await get();
        const rid = id("art-run");
        const aid = id("art");
        const bytes = new TextEncoder().encode("first version");
        assert.equal(await store.putArtifact({ id: aid, runId: rid, name: "a.txt", contentType: "text/plain", metadata: { v: 1 } }, bytes), true);
        bytes[0] = 0; // copied in
        assert.equal(await store.putArtifact({ id: aid, runId: rid, name: "b.txt" }, new TextEncoder().encode("second")), false);
        const meta = await store.getArtifact(aid);
        assert.equal(meta?.name, "a.txt");
        assert.equal(meta?.contentType, "text/plain");
        assert.deepEqual(meta?.metadata, { v: 1 });
        assert.equal(meta?.size, 13);
        assert.equal((meta as unknown as Record<string, unknown>)["data"], undefined, "metadata only");
        const read = await store.readArtifact(aid);
        assert.equal(Object.getPrototypeOf(read), Uint8Array.prototype, "a plain Uint8Array, no Buffer");
        assert.equal(new TextDecoder().decode(read), "first version");
        read![0] = 0; // copied out
        assert.equal(new TextDecoder().decode(await store.readArtifact(aid)), "first version");
        assert.equal(await store.readArtifact(id("no-art")), undefined);
        assert.equal(await store.getArtifact(id("no-art")), undefined);
      });

      it("putArtifact is atomic under concurrency: exactly one upload wins", async () => {
        const { store } = await get();
        const aid = id("art-race");
        const results = await Promise.all(Array.from({ length: 8 }, (_, i) =>
          store.putArtifact({ id: aid, runId: "r" }, new Uint8Array([i, i, i]))));
        assert.equal(results.filter(Boolean).length, 1);
        const w = results.indexOf(true);
        assert.deepEqual([...(await store.readArtifact(aid))!], [w, w, w]);
      });

      it("moves large artifacts byte-exact, and lists a run's artifacts by createdAt then id", async () => {
        const { store } = await get();
        const rid = id("art-list");
        const big = new Uint8Array(3 * 1024 * 1024 + 17);
        for (let i = 0; i < big.length; i++) big[i] = (i * 31 + (i >> 8)) & 0xff;
        await store.putArtifact({ id: `${rid}-big`, runId: rid }, big);
        for (const s of ["z", "a"]) await store.putArtifact({ id: `${rid}-${s}`, runId: rid }, new Uint8Array([1]));
        const back = await store.readArtifact(`${rid}-big`);
        assert.equal(back?.length, big.length);
        assert.ok(back!.every((b, i) => b === big[i]), "byte-exact");
        const list = await store.listArtifacts(rid);
        assert.deepEqual(list.map((a) => a.id), [`${rid}-big`, `${rid}-z`, `${rid}-a`].sort((x, y) => {
          const ax = list.find((a) => a.id === x)!.createdAt!.getTime();
          const ay = list.find((a) => a.id === y)!.createdAt!.getTime();
          return ax - ay || (x < y ? -1 : 1);
        }));
        assert.deepEqual(await store.listArtifacts(id("empty")), []);
      });
    });
  });
}
