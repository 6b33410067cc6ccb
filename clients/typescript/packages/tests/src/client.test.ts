import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { Code, ConnectError, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import {
  LockLostError,
  AlreadyTerminalError, FencepostClient, FencepostError, LeaseAtRiskError, LeaseHeldError, LeaseLostError,
  RunNotFoundError, RunSuspendedError, ValidationError, type RunChange,
} from "@fencepost/client";
import { startServer, type TestServer, diagnostics, jumpClock } from "@fencepost/client/testing";

let server: TestServer;
const clients: FencepostClient[] = [];
const client = (owner: string, extra: ConstructorParameters<typeof FencepostClient>[1] = {}) => {
  const c = new FencepostClient(server.address, { owner, ...extra });
  clients.push(c);
  return c;
};
before(async () => { server = await startServer(); });
after(async () => { for (const c of clients) await c.close(); await server.stop(); });

const within = <T>(p: Promise<T>, ms: number, what: string) =>
  Promise.race([p, new Promise<never>((_, rej) => setTimeout(() => rej(new Error(`${what}: not within ${ms} ms`)), ms))]);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe("FencepostClient", () => {
  it("acquires, and refuses a second owner with LeaseHeldError carrying the record", async () => {
    const a = client("owner-a");
    const b = client("owner-b");
    const lease = await a.acquire("c-held", { ttlMs: 5000 });
    assert.equal(lease.fencingToken, 1);
    assert.equal(lease.record.status, "running");
    assert.equal(lease.record.lease?.owner, "owner-a");
    const err = await b.acquire("c-held").catch((e: unknown) => e);
    assert.ok(err instanceof LeaseHeldError);
    assert.ok(err instanceof FencepostError);
    assert.equal(err.code, "RUN_LEASE_HELD");
    assert.equal(err.grpcCode, Code.FailedPrecondition);
    assert.equal(err.record?.lease?.owner, "owner-a");
    assert.equal(err.record?.fencingToken, 1);
  });

  it("renews every lease over one shared KeepAlive stream", async () => {
    const a = client("owner-renew");
    const leases = await Promise.all(["c-r1", "c-r2", "c-r3"].map((id) => a.acquire(id, { ttlMs: 1500 })));
    const firstExpiry = leases.map((l) => l.record.lease!.expiresAt.getTime());
    await sleep(4000); // over two ttls: without renewals every lease would have expired
    for (const [i, l] of leases.entries()) {
      assert.equal(l.atRisk, false, `${l.runId} at risk`);
      assert.ok((await a.get(l.runId)).lease!.expiresAt.getTime() > firstExpiry[i]! + 2000, "renewed on the server");
      assert.ok(l.safeUntil > performance.now());
      const rec = await a.get(l.runId);
      assert.equal(rec.lease?.owner, "owner-renew");
      assert.ok(rec.lease!.expiresAt.getTime() > Date.now() - 50);
    }
    assert.equal(diagnostics(a).keepAliveConnects, 1);
    const other = await client("owner-x").acquire("c-r1").catch((e: unknown) => e);
    assert.ok(other instanceof LeaseHeldError, "a renewed lease stays held");
  });

  it("tracks a lease from its acquire's commit and drops it with its finish, sending nothing on the stream", async () => {
    const a = client("owner-quiet");
    const op = client("operator-quiet");
    await a.acquire("c-quiet-0", { ttlMs: 60_000 }); // opens and names the stream
    await sleep(300);
    // the stream opened for a fresh lease tracks it; its first renewal is due in 20 s
    assert.equal((await a.get("c-quiet-0")).version, 1);
    const sent = diagnostics(a).keepAliveMessages;
    const lease = await a.acquire("c-quiet-1", { ttlMs: 60_000 }); // first renewal due in 20 s
    await lease.finish();
    const watched = await a.acquire("c-quiet-2", { ttlMs: 60_000 });
    await op.cancel("c-quiet-2", "stop"); // pushed although no renewal has tracked it yet
    const lost = await within(watched.lost, 2000, "lost push");
    assert.equal(lost.reason, "cancelled");
    assert.equal(diagnostics(a).keepAliveMessages, sent, "no track, untrack or renewal was sent");
  });

  it("pushes a cancel to the lease: lost, aborted signal, and fenced calls refused", async () => {
    const a = client("owner-lost");
    const op = client("operator");
    const lease = await a.acquire("c-lost", { ttlMs: 10_000 });
    const guard = lease.guard();
    await sleep(100);
    const started = performance.now();
    await op.cancel("c-lost", "stop");
    const lost = await within(lease.lost, 2000, "lost push");
    assert.ok(performance.now() - started < 1000);
    assert.equal(lost.reason, "cancelled");
    assert.equal(lease.isLost, true);
    assert.equal(lease.lostReason, "cancelled");
    assert.equal(lease.signal.aborted, true);
    assert.ok(lease.signal.reason instanceof LeaseLostError);
    assert.equal(guard.aborted, true);
    assert.equal(lease.record.status, "cancelled");
    await assert.rejects(lease.recordCheckpoint("k", 1), LeaseLostError);
    assert.throws(() => lease.check(), LeaseLostError);
  });

  it("marks a lease at risk past safe-until on the local clock", async () => {
    const a = client("owner-risk");
    const lease = await a.acquire("c-risk", { ttlMs: 300, renew: false });
    assert.equal(lease.atRisk, false);
    const guard = lease.guard();
    assert.equal(guard.aborted, false);
    const reason = await within(new Promise((r) => lease.signal.addEventListener("abort", () => r(lease.signal.reason))), 2000, "at-risk");
    assert.ok(reason instanceof LeaseAtRiskError);
    assert.equal((reason as LeaseAtRiskError).code, "LEASE_AT_RISK");
    assert.equal(lease.atRisk, true);
    assert.equal(guard.aborted, true);
    assert.equal(lease.isLost, false, "at risk is not lost");
    assert.throws(() => lease.check(), LeaseAtRiskError);
    // the server still has it (nobody took over): an explicit renew brings it back
    await lease.renew(5000);
    assert.equal(lease.atRisk, false);
    assert.equal(lease.guard().aborted, false);
  });

  it("hears expiring and taken_over when the server's test clock passes the lease", async () => {
    const a = client("owner-clock");
    const b = client("owner-next");
    const lease = await a.acquire("c-clock", { ttlMs: 60_000, renew: false });
    const watched = await a.acquire("c-clock-2", { ttlMs: 60_000 });
    void watched;
    await sleep(100);
    await jumpClock(a, 61_000);
    await within(new Promise((r) => lease.signal.addEventListener("abort", r)), 3000, "expiring push");
    assert.ok(lease.signal.reason instanceof LeaseAtRiskError);
    assert.equal(lease.atRisk, true);
    const taken = await b.acquire("c-clock");
    assert.equal(taken.fencingToken, 2);
    assert.equal(taken.record.attempt, 2);
    const lost = await within(lease.lost, 2000, "lost push");
    assert.equal(lost.reason, "taken_over");
    await assert.rejects(lease.finish(), LeaseLostError);
  });

  it("runs the fenced lifecycle: checkpoint, suspend, resume, finish", async () => {
    const a = client("owner-life");
    const lease = await a.acquire("c-life", { ttlMs: 5000 });
    const ck = await lease.recordCheckpoint("ckpt/1", 3);
    assert.equal(ck.checkpointRef?.key, "ckpt/1");
    assert.equal(ck.checkpointRef?.snapshotVersion, 3);
    const s = await lease.suspend(["appr-1"]);
    assert.equal(s.status, "suspended");
    assert.deepEqual(s.suspension?.pendingApprovalIds, ["appr-1"]);
    assert.equal(lease.isActive, false);
    await assert.rejects(a.acquire("c-life"), RunSuspendedError);
    const q = await a.requestResume("c-life");
    assert.equal(q.status, "queued");
    const again = await a.acquire("c-life");
    assert.equal(again.fencingToken, 2);
    const done = await again.finish("failed", { code: "boom", message: "it broke" });
    assert.equal(done.status, "failed");
    assert.deepEqual(done.outcome, { code: "boom", message: "it broke" });
    await assert.rejects(a.acquire("c-life"), AlreadyTerminalError);
    const page = await a.list({ statuses: ["failed"] });
    assert.ok(page.runs.some((r) => r.runId === "c-life"));
  });

  it("throws one typed error per reason, naming the field of bad input", async () => {
    const a = client("owner-err");
    const bad = await a.acquire("c-bad", { ttlMs: 5 }).catch((e: unknown) => e);
    assert.ok(bad instanceof ValidationError);
    assert.equal(bad.code, "RUN_VALIDATION_ERROR");
    assert.equal(bad.field, "lease_ttl_ms");
    await assert.rejects(a.get("c-never"), (e: unknown) => e instanceof RunNotFoundError && e.code === "RUN_NOT_FOUND");
    await assert.rejects(a.cancel(""), (e: unknown) => e instanceof ValidationError && e.field === "run_id");
  });

  it("sends a request id with every mutation and reuses it on retry", async () => {
    const seen: string[] = [];
    let failed = false;
    // The first Acquire reaches the server, but its answer is "lost" (UNAVAILABLE).
    const loseFirstAnswer: Interceptor = (next) => async (req) => {
      if (req.method.name === "Acquire") {
        seen.push((req.message as unknown as { requestId: string }).requestId);
        const res = await next(req);
        if (!failed) { failed = true; throw new ConnectError("answer lost", Code.Unavailable); }
        return res;
      }
      return next(req);
    };
    const transport = createGrpcTransport({ baseUrl: `http://${server.address}`, interceptors: [loseFirstAnswer] });
    const a = client("owner-retry", { connectTransport: transport, transport: "unary" });
    const lease = await a.acquire("c-retry", { ttlMs: 5000 });
    assert.equal(seen.length, 2);
    assert.equal(seen[0], seen[1]);
    assert.match(seen[0]!, /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/, "a UUIDv7");
    // applied once: the retry got the original answer, not RUN_LEASE_HELD
    assert.equal(lease.fencingToken, 1);
    assert.equal((await a.get("c-retry")).version, 1);
    const second = await a.acquire("c-retry-2", { ttlMs: 5000 });
    assert.notEqual(seen[2], seen[0], "a new mutation gets a new id");
    void second;
  });

  it("watches changes in order and resumes after the stream drops, without gap or duplicate", async () => {
    const a = client("owner-watch");
    const ac = new AbortController();
    const got: RunChange[] = [];
    // from the first revision: the replay holds whatever lands before the stream is open
    const it = a.watchRuns({ runIds: ["c-w1", "c-w2"], fromRevision: 1, signal: ac.signal });
    const reader = (async () => {
      for await (const ch of it) {
        got.push(ch);
        if (got.length === 6) break;
      }
    })();
    const l1 = await a.acquire("c-w1", { ttlMs: 5000, renew: false });
    await l1.recordCheckpoint("k", 1);
    await a.acquire("c-w2", { ttlMs: 5000, renew: false });
    while (got.length < 3) await sleep(20);
    await server.restart(); // the watch stream drops; the iterator reconnects from its last revision
    await l1.finish();
    await a.delete("c-w2");
    const l3 = await a.acquire("c-w2", { ttlMs: 5000, renew: false });
    await within(reader, 15_000, "watch after restart");
    ac.abort();
    const revs = got.map((c) => c.revision);
    assert.deepEqual(revs, [...revs].sort((x, y) => x - y));
    assert.equal(new Set(revs).size, revs.length, "no duplicates");
    assert.deepEqual(got.map((c) => `${c.runId}:${c.kind}:${c.record?.status ?? "-"}`), [
      "c-w1:put:running", "c-w1:put:running", "c-w2:put:running", "c-w1:put:completed", "c-w2:delete:-", "c-w2:put:running",
    ]);
    assert.equal(l3.fencingToken, 2, "a re-acquired deleted id continues above its last token");
  });

  it("multiplexes mutations on one Execute stream, and retries a dropped stream's commands with their request ids", async () => {
    const a = client("owner-exec");
    assert.equal(a.transport, "stream");
    const opened = diagnostics(a).executeConnects; // the process's shared stream may be open already
    const first = await Promise.all(Array.from({ length: 20 }, (_, i) => a.acquire(`c-exec-${i}`, { ttlMs: 60_000, renew: false })));
    const afterFirst = diagnostics(a).executeConnects;
    assert.ok(afterFirst - opened <= 1, "one stream for the twenty");
    assert.ok(first.every((l) => l.fencingToken === 1));
    // errors over the stream are the same typed errors, with the record
    const held = await client("owner-exec-2").acquire("c-exec-0").catch((e: unknown) => e);
    assert.ok(held instanceof LeaseHeldError);
    assert.equal(held.record?.lease?.owner, "owner-exec");
    // a burst in flight while the server restarts: every command lands exactly once
    const burst = Array.from({ length: 40 }, (_, i) => a.acquire(`c-exec-burst-${i}`, { ttlMs: 60_000, renew: false }));
    await server.restart();
    const leases = await Promise.all(burst);
    assert.ok(leases.every((l) => l.fencingToken === 1), "no command was applied twice");
    for (const l of leases.slice(0, 10)) assert.equal((await a.get(l.runId)).version, 1);
    await sleep(1200); // unary while the stream is down, then the stream again
    await a.acquire("c-exec-after", { renew: false });
    assert.ok(diagnostics(a).executeConnects > afterFirst, "the stream was opened again after the restart");
  });

  it("shares one Execute stream among the clients of a process with the same endpoints and credentials", async () => {
    const [a, b] = [client("share-a"), client("share-b")];
    await (await a.acquire("c-share-warm")).finish(); // the stream is open
    const sent = diagnostics(b).executeCommands;
    const [la, lb] = await Promise.all([a.acquire("c-share-a"), b.acquire("c-share-b")]);
    assert.equal(diagnostics(b).executeCommands, sent + 2, "both clients' commands on one stream");
    const opened = diagnostics(a).executeConnects;
    assert.equal(diagnostics(b).executeConnects, opened);
    // each command keeps its own owner on the shared stream
    assert.equal(la.record.lease?.owner, "share-a");
    assert.equal(lb.record.lease?.owner, "share-b");
    await assert.rejects(b.acquire("c-share-a"), LeaseHeldError);
    // a client that closes leaves the stream to the others
    await a.close();
    await lb.recordCheckpoint("k", 1);
    await lb.finish();
    assert.equal(diagnostics(b).executeConnects, opened);
    // interceptors (or other credentials) get a stream of their own
    const own = client("share-own", { interceptors: [(next) => (req) => next(req)] });
    const before = diagnostics(b).executeCommands;
    await (await own.acquire("c-share-own")).finish();
    assert.equal(diagnostics(own).executeCommands, 2);
    assert.equal(diagnostics(b).executeCommands, before);
  });

  it("sends everything unary with transport: 'unary', with the same answers and errors", async () => {
    const a = client("owner-unary", { transport: "unary" });
    const lease = await a.acquire("c-unary", { ttlMs: 5000 });
    await lease.recordCheckpoint("k", 1);
    const held = await client("owner-unary-2", { transport: "unary" }).acquire("c-unary").catch((e: unknown) => e);
    assert.ok(held instanceof LeaseHeldError);
    assert.equal(held.record?.checkpointRef?.key, "k");
    await assert.rejects(a.acquire("c-unary-bad", { ttlMs: 1 }), (e: unknown) => e instanceof ValidationError && e.field === "lease_ttl_ms");
    assert.equal((await a.store.claimKey("s", "c-unary", "r1", 1000)).created, true);
    await lease.finish();
    assert.equal(diagnostics(a).executeConnects, 0);
  });

  it("reconnects the KeepAlive stream after a server restart and keeps renewing", async () => {
    const a = client("owner-reconnect");
    const ttl = 3000;
    const lease = await a.acquire("c-reconnect", { ttlMs: ttl });
    await server.restart();
    // the restarted server extends the lease to its start + ttl at most; past that, only a renewal on the new stream
    const restarted = Date.now();
    const deadline = restarted + 20_000;
    while ((await a.get("c-reconnect")).lease!.expiresAt.getTime() <= restarted + ttl) {
      assert.ok(Date.now() < deadline, "no renewal reached the restarted server within 20 s");
      await sleep(50);
    }
    assert.ok(diagnostics(a).keepAliveConnects >= 2, `connects ${diagnostics(a).keepAliveConnects}`);
    assert.equal(lease.isLost, false);
    assert.equal(lease.atRisk, false);
    const rec = await a.get("c-reconnect");
    assert.equal(rec.lease?.owner, "owner-reconnect");
    assert.ok(rec.lease!.expiresAt.getTime() > Date.now());
    // and a push still arrives on the new stream
    await client("operator-2").cancel("c-reconnect");
    assert.equal((await within(lease.lost, 3000, "lost after reconnect")).reason, "cancelled");
  });

  it("renew(ttl) changes the ttl background renewals ask for", async () => {
    const a = client("owner-ttl");
    const lease = await a.acquire("c-ttl", { ttlMs: 60_000 });
    await lease.renew(1500);
    assert.equal(lease.ttlMs, 1500);
    await sleep(3500); // over two of the new ttls
    assert.equal(lease.atRisk, false);
    const left = (await a.get("c-ttl")).lease!.expiresAt.getTime() - Date.now();
    assert.ok(left > 0 && left <= 1600, `the server's lease has ${left} ms left`);
  });

  it("pushes a delete to the lease, and watchFence hears a fence it does not hold", async () => {
    const a = client("owner-del");
    const watcher = client("watcher");
    const lease = await a.acquire("c-del", { ttlMs: 10_000 });
    const heard = new Promise<string>((resolve) => { watcher.watchFence("c-del", lease.fencingToken, { lost: (reason) => resolve(reason) }); });
    await sleep(100);
    const gone = await a.delete("c-del");
    assert.equal(gone.fencingToken, 1);
    assert.equal((await within(lease.lost, 2000, "lost push")).reason, "deleted");
    assert.equal(await within(heard, 2000, "watchFence"), "deleted");
    const again = await a.acquire("c-del", { ttlMs: 10_000 });
    assert.equal(again.fencingToken, 2, "the token continues above the deleted run's");
  });

  it("fences engine-store writes on a lease or a lock: refused once the token moved, nothing written", async () => {
    const a = client("owner-fence");
    const op = client("operator-fence");
    const lease = await a.acquire("c-fence", { ttlMs: 10_000 });
    await a.store.kvSet("agent-f", "k", { v: 1 }, { fence: lease.fence });
    await op.cancel("c-fence");
    await assert.rejects(a.store.kvSet("agent-f", "k", { v: 2 }, { fence: lease.fence }),
      (e: unknown) => e instanceof LeaseLostError && e.record?.status === "cancelled");
    assert.deepEqual((await a.store.kvGet("agent-f", "k")).value, { v: 1 });
    const lock = await a.store.acquireLock("lock-f", "me", 1000);
    await a.store.putEffect("eff-f", "ok", { fence: { lockKey: "lock-f", fencingToken: lock.fencingToken } });
    await jumpClock(a, 2000);
    const taken = await op.store.acquireLock("lock-f", "other", 60_000);
    assert.equal(taken.fencingToken, lock.fencingToken + 1);
    await assert.rejects(a.store.putEffect("eff-f", "stale", { fence: { lockKey: "lock-f", fencingToken: lock.fencingToken } }), LockLostError);
    assert.equal((await a.store.getEffect("eff-f")).value, "ok");
    await assert.rejects(a.store.kvSet("agent-f", "k", 1, { fence: { runId: "c-fence", fencingToken: 0 } }),
      (e: unknown) => e instanceof ValidationError && e.field === "fence.fencing_token");
  });
});
