// The client's TypeScript idioms: `await using` on a lease, `{ signal,
// timeoutMs }` on every call, commands typed from the generated schemas,
// and test hooks and counters off the production class.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { FencepostClient, RunNotFoundError, UnavailableError, type CommandRequest } from "@fencepost/client";
import { diagnostics, freePort, jumpClock, startServer, testHooks, type TestServer } from "@fencepost/client/testing";

let server: TestServer;
const clients: FencepostClient[] = [];
const client = (owner: string, address?: string, extra: ConstructorParameters<typeof FencepostClient>[1] = {}) => {
  const c = new FencepostClient(address ?? server.address, { owner, ...extra });
  clients.push(c);
  return c;
};
before(async () => { server = await startServer(); });
after(async () => { for (const c of clients) await c.close(); await server.stop(); });

describe("TypeScript idioms", () => {
  it("releases a lease left by `await using` unless it was finished", async () => {
    const a = client("using-a");
    {
      await using lease = await a.acquire("using-1", { ttlMs: 60_000 });
      assert.equal(lease.record.status, "running");
    }
    const released = await a.get("using-1");
    assert.equal(released.status, "queued");
    assert.equal(released.lease, undefined);
    {
      await using lease = await a.acquire("using-2", { ttlMs: 60_000 });
      await lease.finish("completed");
    }
    assert.equal((await a.get("using-2")).status, "completed");
    // a lease lost meanwhile: leaving the block does not throw
    {
      await using lease = await a.acquire("using-3", { ttlMs: 60_000 });
      await a.cancel("using-3");
      await lease.lost;
    }
    assert.equal((await a.get("using-3")).status, "cancelled");
  });

  it("takes a signal on every call: an aborted one ends the call and its retries", async () => {
    const dead = client("sig", `127.0.0.1:${await freePort()}`, { retry: { totalTimeoutMs: 30_000 } });
    const reason = new Error("stop now");
    const ctl = new AbortController();
    const started = performance.now();
    const pending = dead.acquire("sig-1", { signal: ctl.signal });
    setTimeout(() => ctl.abort(reason), 200);
    await assert.rejects(pending, (e) => e === reason);
    assert.ok(performance.now() - started < 5000, "not the 30 s retry budget");
    const already = AbortSignal.abort(reason);
    const live = client("sig2");
    await assert.rejects(live.get("x", { signal: already }), (e) => e === reason);
    // the engine store's reads and writes too
    await assert.rejects(live.store.getRun("x", { signal: already }), (e) => e === reason);
    await assert.rejects(live.store.kvSet("agent", "k", 1, { signal: already }), (e) => e === reason);
    assert.equal(await live.store.kvGet("agent", "k").then((l) => l.found), false, "an aborted write sent nothing");
    await live.store.kvSet("agent", "k", 2, { timeoutMs: 5000 });
    assert.equal((await live.store.kvGet("agent", "k", { timeoutMs: 5000 })).value, 2);
  });

  it("takes a timeout on every call, bounding its retries", async () => {
    const dead = client("to", `127.0.0.1:${await freePort()}`, { retry: { totalTimeoutMs: 30_000 } });
    const started = performance.now();
    await assert.rejects(dead.get("x", { timeoutMs: 300 }), UnavailableError);
    assert.ok(performance.now() - started < 5000, "not the 30 s retry budget");
    await assert.rejects(client("to2").get("nope", { timeoutMs: 5000 }), RunNotFoundError);
    await assert.rejects(client("to3").get("nope", { timeoutMs: 0 }), /timeoutMs/);
    const lease = await client("to4").acquire("to-run", { timeoutMs: 5000 });
    await lease.recordCheckpoint("k", 1, { timeoutMs: 5000 });
    await lease.finish("completed", undefined, { timeoutMs: 5000 });
  });

  it("types commands from the generated schemas", async () => {
    const a = client("typed");
    const req: CommandRequest<"acquire"> = { runId: "typed-1", owner: "typed", leaseTtlMs: 5000n };
    const resp = await a.command("acquire", req);
    assert.equal(resp.run?.runId, "typed-1"); // the AcquireResponse, typed
    // @ts-expect-error: not a field of AcquireRequest
    const bad: CommandRequest<"acquire"> = { runId: "x", ttl: 5 };
    assert.ok(bad);
    // @ts-expect-error: a bigint field
    const wrong: CommandRequest<"renew"> = { runId: "x", leaseTtlMs: "5000" };
    assert.ok(wrong);
    await a.command("release", { runId: "typed-1", owner: "typed", fencingToken: resp.run!.fencingToken });
  });

  it("keeps test hooks and counters on the testing entry point only", async () => {
    const a = client("hooks");
    for (const name of ["jumpClock", "executeConnects", "keepAliveConnects", "keepAliveMessages"]) {
      assert.equal(name in a, false, name);
    }
    assert.equal("testHooks" in a.stubs, false);
    const before = await testHooks(a).jumpClock({ ms: 0n });
    assert.ok(await jumpClock(a, 1000) >= Number(before.nowMs) + 1000);
    await (await a.acquire("hooks-1")).finish();
    assert.equal(diagnostics(a).executeConnects, 1);
  });
});
