// lease.fenced(), store.fenced() and transactions (lease.transaction(),
// store.transaction()) against a real server, over the Execute stream and
// unary: a write commits only while its fence is current, a transaction
// commits all of its writes or none.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { Code, ConnectError, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import {
  FencepostClient, InvalidRunStateError, LeaseLostError, LockLostError, QueuedWrite, RunNotFoundError, StoreTransaction,
  ValidationError, type EngineStoreClient, type Lease,
} from "@fencepost/client";
import { startServer, type TestServer, diagnostics, jumpClock } from "@fencepost/client/testing";

let server: TestServer;
const clients: FencepostClient[] = [];
before(async () => { server = await startServer(); });
after(async () => { for (const c of clients) await c.close(); await server.stop(); });

const TTL = 10_000;
let seq = 0;
const fresh = (what: string) => `${what}-${++seq}`;

/** Which unary RPCs a client made (by method name), seen by an interceptor on its connection. */
function counted(owner: string, transport: "stream" | "unary", extra: Interceptor[] = []) {
  const calls: string[] = [];
  const count: Interceptor = (next) => async (req) => { calls.push(req.method.name); return next(req); };
  const connectTransport = createGrpcTransport({ baseUrl: `http://${server.address}`, interceptors: [count, ...extra] });
  const c = new FencepostClient(server.address, { owner, transport, connectTransport });
  clients.push(c);
  return { c, calls };
}

/** One fenced write kind: how to make it (value v), and how to read back what it wrote. */
interface WriteKind {
  write(store: EngineStoreClient, id: string, v: number): Promise<unknown>;
  read(c: FencepostClient, id: string): Promise<unknown>;
}
const WRITES: Record<string, WriteKind> = {
  saveCheckpoint: {
    write: (s, id, v) => s.saveCheckpoint({ runId: id, stepIndex: v, state: { v } }),
    read: async (c, id) => (await c.store.latestCheckpoint(id))?.state,
  },
  putEffect: {
    write: (s, id, v) => s.putEffect(`${id}/fx`, { v }),
    read: async (c, id) => (await c.store.getEffect(`${id}/fx`)).value,
  },
  kvSet: {
    write: (s, id, v) => s.kvSet("agent", id, { v }),
    read: async (c, id) => (await c.store.kvGet("agent", id)).value,
  },
  docUpsert: {
    write: (s, id, v) => s.docUpsert("agent", "docs", id, { v }),
    read: async (c, id) => (await c.store.docList("agent", "docs")).find((d) => d.id === id)?.doc,
  },
};

/** A takeover: the server's clock passes the lease's ttl, and `rival` acquires the run. */
async function takeOver(rival: FencepostClient, lease: Lease): Promise<Lease> {
  await jumpClock(rival, TTL + 1);
  const taken = await rival.acquire(lease.runId, { ttlMs: TTL });
  assert.ok(taken.fencingToken > lease.fencingToken);
  return taken;
}

for (const transport of ["stream", "unary"] as const) {
  describe(`fenced writes (${transport})`, () => {
    let a: FencepostClient;
    let b: FencepostClient;
    let calls: string[];
    // Transact calls made (unary; over the stream a transaction is a command of the one Execute call)
    const transacts = () => calls.filter((m) => m === "Transact").length;
    before(() => {
      ({ c: a, calls } = counted(`worker-a-${transport}`, transport));
      ({ c: b } = counted(`worker-b-${transport}`, transport));
    });

    for (const [name, kind] of Object.entries(WRITES)) {
      it(`${name} through lease.fenced(): current commits; after a takeover stale is refused, lease lost, nothing written`, async () => {
        const lease = await a.acquire(fresh(`run-${name}-${transport}`), { ttlMs: TTL });
        const fenced = lease.fenced();
        assert.equal(lease.fenced(), fenced, "one view per lease");
        await kind.write(fenced, lease.runId, 1);
        assert.deepEqual(await kind.read(a, lease.runId), { v: 1 });

        const taken = await takeOver(b, lease);
        const err = await kind.write(fenced, lease.runId, 2).catch((e: unknown) => e);
        assert.ok(err instanceof LeaseLostError, `stale ${name}: ${String(err)}`);
        assert.equal(err.code, "RUN_LEASE_LOST");
        assert.equal(err.record?.fencingToken, taken.fencingToken);
        assert.equal(err.reason, "taken_over");
        assert.equal(lease.isLost, true);
        assert.equal(lease.lostReason, "taken_over");
        assert.equal(lease.signal.aborted, true);
        assert.deepEqual(await kind.read(a, lease.runId), { v: 1 }, "the stale write is not visible");

        // the new holder's view writes; the old one stays refused
        await kind.write(taken.fenced(), lease.runId, 3);
        assert.deepEqual(await kind.read(a, lease.runId), { v: 3 });
        await assert.rejects(kind.write(fenced, lease.runId, 4), LeaseLostError);
        assert.deepEqual(await kind.read(a, lease.runId), { v: 3 });
        // a write's own fence replaces the view's
        await a.store.kvSet("agent", `${lease.runId}/own`, 1, { fence: taken.fence });
        await lease.fenced().kvSet("agent", `${lease.runId}/own`, 2, { fence: taken.fence });
        assert.equal((await a.store.kvGet("agent", `${lease.runId}/own`)).value, 2);

        // a missing token, a run that does not exist: refused naming the field, nothing written
        await assert.rejects(kind.write(a.store.fenced({ runId: lease.runId, fencingToken: 0 }), lease.runId, 5),
          (e: unknown) => e instanceof ValidationError && e.field === "fence.fencing_token");
        await assert.rejects(kind.write(a.store.fenced({ runId: `${lease.runId}-absent`, fencingToken: 1 }), lease.runId, 6),
          (e: unknown) => e instanceof RunNotFoundError && e.field === "fence.run_id");
        assert.deepEqual(await kind.read(a, lease.runId), { v: 3 });
        // unfenced writes are unchanged
        await kind.write(a.store, lease.runId, 7);
        assert.deepEqual(await kind.read(a, lease.runId), { v: 7 });
        await taken.release();
      });
    }

    for (const name of ["docUpsert", "kvSet"] as const) {
      it(`${name} through store.fenced({ lockKey }): refused with LockLostError once the lock moved on`, async () => {
        const kind = WRITES[name]!;
        const id = fresh(`lockdoc-${transport}`);
        const key = `account/${id}`;
        const mine = await a.store.acquireLock(key, "worker-1", 1000);
        const locked = a.store.fenced({ lockKey: key, fencingToken: mine.fencingToken });
        await kind.write(locked, id, 1);
        await jumpClock(a, 2000);
        const theirs = await b.store.acquireLock(key, "worker-2", 60_000);
        assert.equal(theirs.fencingToken, mine.fencingToken + 1);
        const err = await kind.write(locked, id, 2).catch((e: unknown) => e);
        assert.ok(err instanceof LockLostError, String(err));
        assert.equal(err.code, "LOCK_LOST");
        assert.equal(err.lockKey, key);
        assert.equal(err.owner, "worker-2");
        assert.equal(err.fencingToken, theirs.fencingToken);
        assert.deepEqual(await kind.read(a, id), { v: 1 });
        await kind.write(b.store.fenced({ lockKey: key, fencingToken: theirs.fencingToken }), id, 3);
        assert.deepEqual(await kind.read(a, id), { v: 3 });
        // missing token, unknown lock
        await assert.rejects(kind.write(a.store.fenced({ lockKey: key, fencingToken: 0 }), id, 4),
          (e: unknown) => e instanceof ValidationError && e.field === "fence.fencing_token");
        await assert.rejects(kind.write(a.store.fenced({ lockKey: `${key}-never`, fencingToken: 1 }), id, 5),
          (e: unknown) => e instanceof RunNotFoundError && e.field === "fence.lock_key");
        // released: the fence is gone too
        assert.equal(await b.store.releaseLock(key, "worker-2"), true);
        await assert.rejects(kind.write(b.store.fenced({ lockKey: key, fencingToken: theirs.fencingToken }), id, 6),
          (e: unknown) => e instanceof LockLostError && e.owner === undefined);
        assert.deepEqual(await kind.read(a, id), { v: 3 });
      });
    }

    it("a fenced artifact upload after a takeover is refused and marks the lease lost", async () => {
      const lease = await a.acquire(fresh(`run-art-${transport}`), { ttlMs: TTL });
      const art = `${lease.runId}/a`;
      await takeOver(b, lease);
      await assert.rejects(lease.fenced().putArtifact({ id: art, runId: lease.runId }, new Uint8Array([1, 2, 3])), LeaseLostError);
      assert.equal(lease.isLost, true);
      assert.equal(await a.store.getArtifact(art), undefined);
    });

    it("deleteArtifact frees an artifact once, unary; a stale fence deletes nothing and marks the lease lost", async () => {
      const lease = await a.acquire(fresh(`run-del-${transport}`), { ttlMs: TTL });
      const [mine, kept] = [`${lease.runId}/mine`, `${lease.runId}/kept`];
      await a.store.putArtifact({ id: mine, runId: lease.runId }, new Uint8Array(300_000).fill(9));
      await a.store.putArtifact({ id: kept, runId: lease.runId }, new Uint8Array([1, 2, 3]));
      const before = calls.filter((m) => m === "DeleteArtifact").length;
      assert.equal(await lease.fenced().deleteArtifact(mine), true);
      assert.equal(await a.store.deleteArtifact(mine), false, "already gone");
      assert.equal(calls.filter((m) => m === "DeleteArtifact").length, before + 2, "always unary");
      await assert.rejects(a.store.readArtifact(mine), RunNotFoundError);
      assert.deepEqual((await a.store.listArtifacts(lease.runId)).map((x) => x.id), [kept]);
      await takeOver(b, lease);
      await assert.rejects(lease.fenced().deleteArtifact(kept), LeaseLostError);
      assert.equal(lease.isLost, true);
      assert.deepEqual(await a.store.readArtifact(kept), new Uint8Array([1, 2, 3]));
      await assert.rejects(a.store.deleteArtifact(""), (e: unknown) => e instanceof ValidationError && e.field === "id");
    });

    it("store.fenced() refuses a fence without exactly one target or an integer token, before anything is sent", () => {
      assert.throws(() => a.store.fenced({ runId: "r", lockKey: "k", fencingToken: 1 } as never),
        (e: unknown) => e instanceof ValidationError && e.field === "fence.run_id");
      assert.throws(() => a.store.fenced({ fencingToken: 1 } as never),
        (e: unknown) => e instanceof ValidationError && e.field === "fence.run_id");
      assert.throws(() => a.store.fenced({ runId: "r", fencingToken: 1.5 }),
        (e: unknown) => e instanceof ValidationError && e.field === "fence.fencing_token");
    });

    it("lease.transaction(): every write commits together, answers typed and in order", async () => {
      const lease = await a.acquire(fresh(`run-tx-${transport}`), { ttlMs: TTL });
      const runId = lease.runId;
      await a.store.createRun({ id: runId, agent: "billing", status: "running" });
      const before = transacts();
      let txRef: StoreTransaction | undefined;
      const done = await lease.transaction((tx) => {
        txRef = tx;
        assert.ok(tx instanceof StoreTransaction);
        const saved = tx.saveCheckpoint({ runId, stepIndex: 1, state: { step: 1 } });
        assert.ok(saved instanceof QueuedWrite);
        assert.equal(saved.index, 0);
        assert.throws(() => saved.result, /has not committed/);
        tx.putEffect(`${runId}/charge`, { id: "ch_1" });
        const step = tx.appendStep({ runId, name: "charge", status: "ok" });
        const updated = tx.updateRun(runId, { status: "charged" }, { expectStatus: ["running"] });
        const record = tx.recordCheckpoint(`${runId}/cp`, 1);
        assert.equal(tx.size, 5);
        return { saved, step, list: [updated, record] as const, note: "kept" };
      });
      assert.equal(done.saved.saved, true);
      assert.equal(done.saved.checkpoint.stepIndex, 1);
      assert.equal(done.step.seq, 1);
      assert.equal(done.list[0].status, "charged");
      assert.equal(done.list[1].checkpointRef?.snapshotVersion, 1);
      assert.equal(done.note, "kept");
      assert.equal(txRef!.results.length, 5);
      assert.deepEqual(txRef!.results[2], done.step);
      assert.equal(lease.record.checkpointRef?.key, `${runId}/cp`, "the lease saw the ledger answer");
      // all of it is visible
      assert.deepEqual((await a.store.latestCheckpoint(runId))?.state, { step: 1 });
      assert.deepEqual((await a.store.getEffect(`${runId}/charge`)).value, { id: "ch_1" });
      assert.equal((await a.store.listSteps(runId)).length, 1);
      assert.equal((await a.store.getRun(runId))?.status, "charged");
      // one Transact: over the Execute stream, or one unary call
      assert.equal(transacts() - before, transport === "unary" ? 1 : 0);
      if (transport === "stream") assert.ok(diagnostics(a).executeConnects >= 1);
      await lease.release();
    });

    it("a refused command leaves nothing of the transaction written, and names its index", async () => {
      const lease = await a.acquire(fresh(`run-txref-${transport}`), { ttlMs: TTL });
      const runId = lease.runId;
      await a.store.createRun({ id: runId, agent: "billing", status: "queued" });
      await a.store.saveCheckpoint({ runId, stepIndex: 1, state: "first" });
      const err = await lease.transaction((tx) => {
        tx.saveCheckpoint({ runId, stepIndex: 2, state: "second" });
        tx.putEffect(`${runId}/fx`, "effect");
        tx.appendStep({ runId, name: "s" });
        tx.updateRun(runId, { status: "done" }, { expectStatus: ["running"] }); // the run is queued: refused
        tx.kvSet("agent", runId, "after");
      }).catch((e: unknown) => e);
      assert.ok(err instanceof InvalidRunStateError, String(err));
      assert.equal(err.commandIndex, 3);
      assert.match(err.message, /commands\[3\]/);
      assert.equal(lease.isLost, false, "a refused guard does not lose the lease");
      assert.deepEqual((await a.store.latestCheckpoint(runId))?.state, "first");
      assert.equal((await a.store.getEffect(`${runId}/fx`)).found, false);
      assert.equal((await a.store.listSteps(runId)).length, 0);
      assert.equal((await a.store.kvGet("agent", runId)).found, false);
      assert.equal((await a.store.getRun(runId))?.status, "queued");

      // a validation error names the command's field
      const bad = await a.store.transaction((tx) => {
        tx.kvSet("agent", runId, 1);
        tx.claimKey("scope", "k", runId, 0);
      }).catch((e: unknown) => e);
      assert.ok(bad instanceof ValidationError, String(bad));
      assert.equal(bad.field, "commands[1].ttl_ms");
      assert.equal(bad.commandIndex, 1);
      assert.equal((await a.store.kvGet("agent", runId)).found, false);
      await lease.release();
    });

    it("after a takeover the stale holder's transaction is refused whole, and the lease is lost", async () => {
      const lease = await a.acquire(fresh(`run-txstale-${transport}`), { ttlMs: TTL });
      const runId = lease.runId;
      await lease.transaction((tx) => { tx.saveCheckpoint({ runId, stepIndex: 1, state: "mine" }); });
      const taken = await takeOver(b, lease);
      const err = await lease.transaction((tx) => {
        tx.saveCheckpoint({ runId, stepIndex: 2, state: "stale" });
        tx.putEffect(`${runId}/fx`, "stale");
        tx.recordCheckpoint(`${runId}/cp`, 2);
      }).catch((e: unknown) => e);
      assert.ok(err instanceof LeaseLostError, String(err));
      assert.equal(err.record?.fencingToken, taken.fencingToken);
      assert.equal(lease.isLost, true);
      assert.equal(lease.lostReason, "taken_over");
      assert.deepEqual((await a.store.latestCheckpoint(runId))?.state, "mine");
      assert.equal((await a.store.getEffect(`${runId}/fx`)).found, false);
      assert.equal((await a.get(runId)).checkpointRef, undefined);

      // known lost: refused without a round trip
      const before = calls.length;
      const connects = diagnostics(a).executeConnects;
      await assert.rejects(lease.transaction((tx) => { tx.kvSet("agent", runId, 1); }), LeaseLostError);
      assert.equal(calls.length, before, "no call at all");
      assert.equal(diagnostics(a).executeConnects, connects);
      // the new holder's transaction commits
      const { cp } = await taken.transaction((tx) => ({ cp: tx.saveCheckpoint({ runId, stepIndex: 2, state: "theirs" }) }));
      assert.equal(cp.saved, true);
      await taken.release();
    });

    it("an exception inside the callback sends nothing; the transaction is closed after it", async () => {
      const lease = await a.acquire(fresh(`run-txthrow-${transport}`), { ttlMs: TTL });
      const runId = lease.runId;
      const boom = new Error("boom");
      const before = transacts();
      let kept: StoreTransaction | undefined;
      await assert.rejects(lease.transaction(async (tx) => {
        kept = tx;
        tx.saveCheckpoint({ runId, stepIndex: 1, state: "never" });
        tx.putEffect(`${runId}/fx`, "never");
        await new Promise((r) => setTimeout(r, 10));
        throw boom;
      }), (e: unknown) => e === boom);
      assert.equal(transacts(), before, "nothing was sent");
      assert.equal(await a.store.latestCheckpoint(runId), undefined);
      assert.equal((await a.store.getEffect(`${runId}/fx`)).found, false);
      assert.throws(() => kept!.kvSet("agent", runId, 1), /abandoned/);
      assert.throws(() => kept!.results, /no results/);
      assert.equal(lease.isActive, true);

      // bad input throws at the write, and nothing is sent
      await assert.rejects(lease.transaction((tx) => { tx.putEffect(`${runId}/fx`, 1n); }),
        (e: unknown) => e instanceof ValidationError && e.field === "result");
      await assert.rejects(lease.transaction((tx) => { for (let i = 0; i <= 100; i++) tx.kvSet("agent", `${runId}/${i}`, i); }),
        (e: unknown) => e instanceof ValidationError && e.field === "commands");
      assert.equal(transacts(), before);
      assert.equal((await a.store.kvGet("agent", `${runId}/0`)).found, false);
      // an empty transaction commits without a round trip
      assert.equal(await lease.transaction(() => 42), 42);
      assert.equal(transacts(), before);
      await lease.release();
    });

    it("store.transaction() under a lock's fence, a fenced view's fence, or none", async () => {
      const id = fresh(`txlock-${transport}`);
      const key = `lock/${id}`;
      const mine = await a.store.acquireLock(key, "worker-1", 1000);
      const fence = { lockKey: key, fencingToken: mine.fencingToken };
      const [one, two] = await a.store.transaction((tx) => [tx.kvSet("agent", `${id}/1`, 1), tx.kvSet("agent", `${id}/2`, 2)] as const, { fence });
      assert.ok(one instanceof Date && two instanceof Date);
      await jumpClock(a, 2000);
      await b.store.acquireLock(key, "worker-2", 60_000);
      await assert.rejects(a.store.transaction((tx) => { tx.kvSet("agent", `${id}/1`, "stale"); tx.kvSet("agent", `${id}/3`, 3); }, { fence }),
        (e: unknown) => e instanceof LockLostError && e.owner === "worker-2");
      // a fenced view's transaction carries the view's fence
      await assert.rejects(a.store.fenced(fence).transaction((tx) => { tx.kvSet("agent", `${id}/3`, 3); }), LockLostError);
      assert.equal((await a.store.kvGet("agent", `${id}/1`)).value, 1);
      assert.equal((await a.store.kvGet("agent", `${id}/3`)).found, false);
      // a write may carry its own fence too, checked as well
      await assert.rejects(a.store.transaction((tx) => {
        tx.kvSet("agent", `${id}/3`, 3);
        tx.kvSet("agent", `${id}/4`, 4, { fence });
      }), (e: unknown) => e instanceof LockLostError && e.commandIndex === 1);
      assert.equal((await a.store.kvGet("agent", `${id}/3`)).found, false);
      // without a fence: still all or nothing
      await a.store.transaction((tx) => { tx.kvSet("agent", `${id}/3`, 3); });
      assert.equal((await a.store.kvGet("agent", `${id}/3`)).value, 3);
      await assert.rejects(a.store.transaction((tx) => { tx.renew(); }), /only a lease's transaction/);
      await assert.rejects(a.store.transaction(() => 1, { fence: { runId: "", fencingToken: 1 } }),
        (e: unknown) => e instanceof ValidationError && e.field === "fence.run_id");
    });
  });
}

describe("transaction retries (unary)", () => {
  it("a transaction whose answer was lost is retried with the same request id and applied once", async () => {
    const seen: string[] = [];
    let failed = false;
    const loseFirstAnswer: Interceptor = (next) => async (req) => {
      if (req.method.name !== "Transact") return next(req);
      seen.push((req.message as unknown as { requestId: string }).requestId);
      const res = await next(req);
      if (!failed) { failed = true; throw new ConnectError("answer lost", Code.Unavailable); }
      return res;
    };
    const { c } = counted("worker-retry", "unary", [loseFirstAnswer]);
    const lease = await c.acquire(fresh("run-txretry"), { ttlMs: TTL });
    const runId = lease.runId;
    const { step } = await lease.transaction((tx) => ({ step: tx.appendStep({ runId, name: "once" }), cp: tx.recordCheckpoint("cp", 1) }));
    assert.equal(seen.length, 2);
    assert.equal(seen[0], seen[1], "one request id for both attempts");
    assert.equal(step.seq, 1);
    assert.equal((await c.store.listSteps(runId)).length, 1, "applied once");
    await lease.release();
  });
});

describe("transaction retries (stream)", () => {
  it("transactions in flight while the server restarts each land exactly once (retried with their request ids)", async () => {
    const { c } = counted("worker-restart", "stream");
    const lease = await c.acquire(fresh("run-txrestart"), { ttlMs: 60_000, renew: false });
    await lease.transaction((tx) => { tx.kvSet("agent", `${lease.runId}/warm`, 0); });
    assert.equal(diagnostics(c).executeConnects, 1);
    const ids = Array.from({ length: 20 }, (_, i) => `${lease.runId}/${i}`);
    const burst = ids.map((id) => lease.transaction((tx) => ({ step: tx.appendStep({ runId: id, name: "once" }), at: tx.kvSet("agent", id, 1) })));
    await server.restart();
    const done = await Promise.all(burst);
    assert.ok(done.every((d) => d.step.seq === 1));
    for (const id of ids) assert.equal((await c.store.listSteps(id)).length, 1, `${id}: applied once`);
    assert.equal(lease.isLost, false);
  });
});
