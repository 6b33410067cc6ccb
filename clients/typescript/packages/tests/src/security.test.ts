// The client against a server with TLS, mutual TLS, roles and bearer tokens
// (docs/SECURITY.md): owners bound to the certificate's identity on
// acquire, KeepAlive and the Execute stream; tokens carry their role, with
// or without TLS; a worker opens the oma and chamvi stores; refusals are
// typed and never retried.
import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import type { Interceptor } from "@connectrpc/connect";
import {
  FencepostClient, LeaseLostError, OwnerNotPermittedError, PermissionDeniedError, RunNotFoundError, UnauthenticatedError,
  UnavailableError, probeServer, type ClientOptions, type TlsOptions,
} from "@fencepost/client";
import { diagnostics, freePort, startServer, type TestServer } from "@fencepost/client/testing";
import { FencepostStore } from "@fencepost/chamvi";
import { CHECKPOINT_KEY_PREFIX, FencepostMemoryStore, FencepostRunJournal, FencepostRunStore } from "@fencepost/oma";
import { makeCerts, mtlsArgs, type Certs } from "./pki.js";
import { KeepAliveRequestSchema } from "@fencepost/client/gen/fencepost/v1/ledger_pb";
import { create } from "@bufbuild/protobuf";

let dir: string;
let certs: Certs;
let server: TestServer;
let tokenServer: TestServer;
let tlsTokenServer: TestServer;
const clients: FencepostClient[] = [];

function tlsFor(who?: string): TlsOptions {
  const ca = readFileSync(certs.ca, "utf8");
  if (!who) return { ca };
  const pair = certs.clients[who]!;
  return { ca, cert: readFileSync(pair.cert), key: readFileSync(pair.key, "utf8") };
}

function client(address: string, options: ClientOptions): FencepostClient {
  const c = new FencepostClient(address, options);
  clients.push(c);
  return c;
}

/** Counts the calls made, by method name. */
function counter(): { calls: Record<string, number>; interceptor: Interceptor } {
  const calls: Record<string, number> = {};
  return { calls, interceptor: (next) => (req) => { calls[req.method.name] = (calls[req.method.name] ?? 0) + 1; return next(req); } };
}

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "fencepost-ts-certs-"));
  certs = makeCerts(dir);
  server = await startServer({
    testHooks: false,
    args: mtlsArgs(certs),
    connect: { tls: tlsFor("admin") },
  });
  tokenServer = await startServer({ testHooks: false, args: ["--authz", certs.policy], connect: { token: certs.tokens.admin } });
  // server-only TLS: tokens are the only identities (no --client-ca)
  tlsTokenServer = await startServer({
    testHooks: false,
    args: ["--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--authz", certs.policy],
    connect: { tls: tlsFor(), token: certs.tokens.admin },
  });
});

after(async () => {
  for (const c of clients) await c.close();
  await server?.stop();
  await tokenServer?.stop();
  await tlsTokenServer?.stop();
  rmSync(dir, { recursive: true, force: true });
});

describe("TLS, identities and roles", () => {
  for (const transport of ["stream", "unary"] as const) {
    it(`a worker over mutual TLS holds its own owners and is refused another's (${transport})`, async () => {
      const alice = client(server.address, { owner: "alice/worker-1", tls: tlsFor("alice"), transport });
      const lease = await alice.acquire(`alice-${transport}`, { ttlMs: 5000 });
      await lease.recordCheckpoint("k", 1);
      await lease.finish("completed");
      if (transport === "stream") assert.ok(diagnostics(alice).executeConnects >= 1, "commands went on the Execute stream");
      const del = await alice.delete(`alice-${transport}`).catch((e: unknown) => e);
      assert.ok(del instanceof PermissionDeniedError, String(del));
      assert.equal(del.metadata["role"], "admin");

      const posing = client(server.address, { owner: "bob/worker-1", tls: tlsFor("alice"), transport });
      const err = await posing.acquire(`bob-${transport}`).catch((e: unknown) => e);
      assert.ok(err instanceof OwnerNotPermittedError, String(err));
      assert.ok(err instanceof PermissionDeniedError);
      assert.equal(err.code, "OWNER_NOT_PERMITTED");
      assert.deepEqual([err.metadata["owner"], err.metadata["principal"]], ["bob/worker-1", "alice"]);
      if (transport === "stream") assert.ok(diagnostics(posing).executeConnects >= 1, "refused on the Execute stream");
    });
  }

  it("refuses a KeepAlive stream for another's owner", async () => {
    const posing = client(server.address, { owner: "bob/w", tls: tlsFor("alice") });
    // raw: the hello is refused, the stream ends with the typed status
    const hello = create(KeepAliveRequestSchema, { kind: { case: "hello", value: { owner: "bob/w" } } });
    const raw = await (async () => {
      async function* requests() { yield hello; await new Promise((r) => setTimeout(r, 5000)); }
      for await (const _ of posing.stubs.ledger.keepAlive(requests(), { timeoutMs: 5000 })) { /* nothing comes */ }
    })().catch((e: unknown) => e);
    const { fromCallError } = await import("@fencepost/client");
    const mapped = fromCallError(raw);
    assert.ok(mapped instanceof OwnerNotPermittedError, String(raw));
    // the client's shared stream reports it to the watcher instead of reconnecting forever
    const heard = await new Promise<string>((resolve) => {
      posing.watchFence("some-run", 1, { lost: () => resolve("lost"), error: (code) => resolve(code) });
    });
    assert.equal(heard, "OWNER_NOT_PERMITTED");
  });

  it("never retries a refusal", async () => {
    const c = counter();
    const w = client(server.address, {
      owner: "bob/x", tls: tlsFor("alice"), transport: "unary", interceptors: [c.interceptor],
      retry: { maxAttempts: 10, totalTimeoutMs: 30_000 },
    });
    await assert.rejects(w.acquire("never"), OwnerNotPermittedError);
    await assert.rejects(w.cancel("never"), PermissionDeniedError);
    assert.deepEqual(c.calls, { Acquire: 1, Cancel: 1 });
    const t = counter();
    const bad = client(tokenServer.address, { token: "wrong", transport: "unary", interceptors: [t.interceptor], retry: { maxAttempts: 10 } });
    await assert.rejects(bad.get("x"), UnauthenticatedError);
    assert.deepEqual(t.calls, { GetRun: 1 });
  });

  it("a token client gets its role", async () => {
    const admin = client(tokenServer.address, { token: certs.tokens.admin });
    await assert.rejects(admin.get("nope"), RunNotFoundError);
    const script = client(tokenServer.address, { token: certs.tokens.script, owner: "script" });
    const page = await script.list();
    assert.equal(page.runs.length, 0);
    const err = await script.delete("nope").catch((e: unknown) => e);
    assert.ok(err instanceof PermissionDeniedError, String(err));
    assert.equal(err.metadata["principal"], "script");
    await assert.rejects(script.acquire("script-run"), PermissionDeniedError); // an operator is no worker
    const none = client(tokenServer.address, {});
    await assert.rejects(none.get("nope"), UnauthenticatedError);
  });

  it("a plaintext client against the TLS port gets a clear error", async () => {
    const plain = client(server.address, { retry: { totalTimeoutMs: 1000, attemptTimeoutMs: 500 } });
    const err = await plain.get("x").catch((e: unknown) => e);
    assert.ok(err instanceof UnavailableError, String(err));
    assert.match(err.message, /TLS/);
  });

  it("FencepostRunStore and chamvi's FencepostStore take the same options and endpoints", async () => {
    const down = `127.0.0.1:${await freePort()}`;
    // the raw RunStore seam is an admin's
    const runs = await FencepostRunStore.connect([down, server.address], { tls: tlsFor("admin"), owner: "admin" });
    try {
      assert.equal(await runs.get("sec-none"), null);
    } finally {
      await runs.close();
    }
    // an engine process is a worker: its claims are bound to its identity
    const store = await FencepostStore.connect(`${down},${server.address}`, { tls: tlsFor("alice"), owner: "alice/engine" });
    try {
      await store.createRun({ id: "sec-engine", agent: "a", status: "queued" });
      assert.equal(await store.claimRun("sec-engine", "alice/engine", 5000), true);
      assert.equal((await store.getRun("sec-engine"))?.claim?.owner, "alice/engine");
      await assert.rejects(store.claimRun("sec-engine", "bob/engine", 5000), OwnerNotPermittedError);
    } finally {
      await store.close();
    }
    const refused = await FencepostStore.connect(server.address, { tls: tlsFor(), retry: { totalTimeoutMs: 1000 } }).catch((e: unknown) => e);
    assert.ok(refused instanceof UnavailableError, String(refused)); // no client certificate: the handshake fails
  });

  it("a worker over mutual TLS opens the memory store and the journal, and its stale checkpoint is refused", async () => {
    // the raw seam's Describe is an admin's: the worker is refused it, the probe counts that as an answer
    const worker = client(server.address, { owner: "alice/oma", tls: tlsFor("alice") });
    assert.deepEqual(await probeServer(worker), { atomicity: "cross-process", described: false });
    const admin = client(server.address, { tls: tlsFor("admin") });
    assert.equal((await probeServer(admin)).described, true);

    const memory = await FencepostMemoryStore.connect(server.address, { owner: "alice/oma", tls: tlsFor("alice"), namespace: "sec-worker" });
    const journal = await FencepostRunJournal.connect(server.address, "sec-worker-run", { owner: "alice/oma", tls: tlsFor("alice") });
    try {
      assert.equal(memory.atomicity, "cross-process");
      await memory.set("greeting", "hello", { from: "alice" });
      assert.equal((await memory.get("greeting"))?.value, "hello");
      assert.equal(await memory.compareAndSet("greeting", "hello", "hi"), true);
      assert.equal(await memory.compareAndSet("greeting", "hello", "hey"), false);
      assert.equal((await memory.get("greeting"))?.value, "hi");

      await journal.append([{ seq: 1, type: "run/start" }, { seq: 2, type: "turn/start", turn: 1 }]);
      assert.deepEqual((await journal.readFrom(2)).map((e) => e["type"]), ["turn/start"]);
      assert.equal(await journal.lastSeq(), 2);

      // a fenced checkpoint: written while the worker's lease holds, refused once an admin cancels the run
      const lease = await worker.acquire("sec-worker-run", { ttlMs: 10_000 });
      const checkpoints = memory.fencedFor("sec-worker-run", lease.fencingToken);
      const key = `${CHECKPOINT_KEY_PREFIX}sec-worker-run/latest`;
      await checkpoints.set(key, "turn 1");
      await admin.cancel("sec-worker-run");
      await assert.rejects(checkpoints.set(key, "turn 2 (stale)"), LeaseLostError);
      assert.equal((await memory.get(key))?.value, "turn 1");
    } finally {
      await journal.close();
      await memory.close();
    }
    // the raw seam itself stays an admin's: FencepostRunStore refuses a worker at connect
    const runs = await FencepostRunStore.connect(server.address, { owner: "alice/oma", tls: tlsFor("alice") }).catch((e: unknown) => e);
    assert.ok(runs instanceof PermissionDeniedError, String(runs));
    assert.equal(runs.metadata["role"], "admin");
  });

  it("bearer tokens over server-only TLS carry their roles; a made-up token is refused", async () => {
    const tls = tlsFor(); // the CA only: no client certificate
    const worker = client(tlsTokenServer.address, { tls, token: certs.tokens.worker, owner: "carol/w" });
    const lease = await worker.acquire("tls-token-run", { ttlMs: 5000 });
    await lease.recordCheckpoint("k", 1);
    const posing = await client(tlsTokenServer.address, { tls, token: certs.tokens.worker, owner: "alice/w" })
      .acquire("tls-token-other").catch((e: unknown) => e);
    assert.ok(posing instanceof OwnerNotPermittedError, String(posing));
    assert.equal(posing.metadata["principal"], "carol");
    const cancel = await worker.cancel("tls-token-run").catch((e: unknown) => e);
    assert.ok(cancel instanceof PermissionDeniedError, String(cancel)); // a worker is no operator
    assert.equal(cancel.metadata["principal"], "carol");

    const script = client(tlsTokenServer.address, { tls, token: certs.tokens.script, owner: "script" });
    assert.deepEqual((await script.list()).runs.map((r) => r.runId), ["tls-token-run"]);
    await assert.rejects(script.acquire("script-run"), PermissionDeniedError); // an operator is no worker
    const del = await script.delete("tls-token-run").catch((e: unknown) => e);
    assert.ok(del instanceof PermissionDeniedError, String(del));
    assert.equal(del.metadata["role"], "admin");

    const admin = client(tlsTokenServer.address, { tls, token: certs.tokens.admin });
    assert.equal((await admin.get("tls-token-run")).fencingToken, lease.fencingToken);

    const c = counter();
    const madeUp = client(tlsTokenServer.address, { tls, token: "made-up-token", transport: "unary", interceptors: [c.interceptor] });
    await assert.rejects(madeUp.get("tls-token-run"), UnauthenticatedError);
    assert.deepEqual(c.calls, { GetRun: 1 }); // refused, never retried
    const none = client(tlsTokenServer.address, { tls });
    await assert.rejects(none.get("tls-token-run"), UnauthenticatedError);
  });

  it("refuses options that cannot work, naming them", () => {
    assert.throws(() => new FencepostClient("10.0.0.1:50051", { token: "t" }), /token: .*only over TLS/);
    assert.throws(() => new FencepostClient("127.0.0.1:50051", { token: " " }), /token: must not be empty/);
    assert.throws(() => new FencepostClient("127.0.0.1:50051", { tls: { cert: "x" } }), /tls: cert and key go together/);
    assert.throws(() => new FencepostClient("127.0.0.1:50051", { keepalive: { intervalMs: 0 } }), /keepalive.intervalMs: must be a positive integer/);
  });
});
