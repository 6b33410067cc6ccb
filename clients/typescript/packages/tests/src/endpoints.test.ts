// A client given several endpoints follows the leader. The standbys are real
// gRPC servers that refuse every fencepost call exactly as a standby
// coordinator does (helpers/standby.py: UNAVAILABLE + NOT_LEADER naming the
// leader, or nobody); the leader is a real `fencepost serve`. A takeover is
// played by starting another coordinator on the same SQLite file.
import assert from "node:assert/strict";
import { spawn, type ChildProcessWithoutNullStreams } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { after, before, describe, it } from "node:test";
import { create } from "@bufbuild/protobuf";
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import {
  FencepostClient, NotLeaderError, OutcomeUnknownError, RunNotFoundError, UnavailableError, parseEndpoints,
} from "@fencepost/client";
import { Ledger, AcquireRequestSchema } from "@fencepost/client/gen/fencepost/v1/ledger_pb";
import { diagnostics, findFencepostBin, freePort, startServer, waitReady, type TestServer } from "@fencepost/client/testing";

const FAST = { totalTimeoutMs: 1500, attemptTimeoutMs: 1000, maxBackoffMs: 200 };
const GIVES_UP_MS = FAST.totalTimeoutMs + FAST.attemptTimeoutMs + 1000;

/** A standby stand-in (helpers/standby.py), driven over its stdin. */
class Standby {
  private waiting: ((line: string) => void)[] = [];
  private constructor(private readonly child: ChildProcessWithoutNullStreams, readonly address: string) {
    createInterface({ input: child.stdout }).on("line", (l) => this.waiting.shift()?.(l));
  }

  static async start(leader = ""): Promise<Standby> {
    const python = join(dirname(findFencepostBin()), "python");
    const script = join(dirname(fileURLToPath(import.meta.url)), "..", "helpers", "standby.py");
    const child = spawn(python, [script, leader], { stdio: ["pipe", "pipe", "pipe"] });
    const first = await new Promise<string>((resolve, reject) => {
      const rl = createInterface({ input: child.stdout });
      rl.once("line", (l) => { rl.close(); resolve(l); });
      child.once("exit", (code) => reject(new Error(`standby exited ${code}`)));
    });
    return new Standby(child, (JSON.parse(first) as { address: string }).address);
  }

  private ask<T>(command: string): Promise<T> {
    return new Promise<T>((resolve) => {
      this.waiting.push((l) => resolve(JSON.parse(l) as T));
      this.child.stdin.write(command + "\n");
    });
  }

  setLeader(address: string): Promise<unknown> { return this.ask(`leader ${address}`); }
  /** [method, request id] of every call it refused. */
  refused(): Promise<[string, string][]> { return this.ask("refused"); }

  async stop(): Promise<void> {
    const done = new Promise((r) => this.child.once("exit", r));
    this.child.stdin.end();
    await done;
  }
}

let server: TestServer;
const standbys: Standby[] = [];
const clients: FencepostClient[] = [];
const standby = async (leader = "") => { const s = await Standby.start(leader); standbys.push(s); return s; };
const client = (address: string | string[], options: ConstructorParameters<typeof FencepostClient>[1] = {}) => {
  const c = new FencepostClient(address, { owner: "w", ...options });
  clients.push(c);
  return c;
};
const deadAddress = async () => `127.0.0.1:${await freePort()}`;

before(async () => { server = await startServer(); });
after(async () => {
  for (const c of clients) await c.close();
  for (const s of standbys) await s.stop();
  await server.stop();
});

describe("several endpoints", () => {
  it("takes a list, one string or a comma-separated one", () => {
    assert.deepEqual(parseEndpoints("a:1"), ["a:1"]);
    assert.deepEqual(parseEndpoints("a:1, b:2,a:1"), ["a:1", "b:2"]);
    assert.deepEqual(parseEndpoints(["a:1", "b:2"]), ["a:1", "b:2"]);
    const c = client("10.0.0.1:50051,10.0.0.2:50051");
    assert.deepEqual(c.endpointList, ["10.0.0.1:50051", "10.0.0.2:50051"]);
    assert.equal(c.address, "10.0.0.1:50051"); // the first, until told otherwise
    for (const bad of ["", "a:1,,b:2", [], ["a:1", " "], "a :1"]) {
      assert.throws(() => new FencepostClient(bad), /address/, JSON.stringify(bad));
    }
    assert.throws(() => new FencepostClient(["127.0.0.1:1", "10.0.0.2:50051"], { token: "t" }), /plaintext/);
  });

  for (const transport of ["stream", "unary"] as const) {
    it(`a mutation refused by a standby goes to the leader it names with its request id (${transport})`, async () => {
      const s = await standby(server.address);
      const c = client([s.address, server.address], { transport });
      const runId = `follow-${transport}`;
      const lease = await c.acquire(runId, { ttlMs: 60_000 });
      assert.equal(c.address, server.address);
      const sent = (await s.refused()).filter(([m]) => m === "Acquire" || m === "Execute");
      assert.ok(sent.length >= 1, JSON.stringify(sent));
      if (transport === "unary") {
        assert.equal(sent.length, 1);
        const requestId = sent[0]![1];
        assert.ok(requestId);
        // the leader holds the answer under that very request id: applied once
        const raw = createClient(Ledger, createGrpcTransport({ baseUrl: `http://${server.address}` }));
        const again = await raw.acquire(create(AcquireRequestSchema, { runId, owner: "w", leaseTtlMs: 60_000n, requestId }));
        assert.equal(Number(again.run!.fencingToken), lease.fencingToken);
        assert.equal(Number(again.run!.version), lease.record.version);
      }
      await lease.finish();
      const before = (await s.refused()).length;
      assert.equal((await c.get(runId)).status, "completed"); // later calls go straight to the leader
      assert.equal((await s.refused()).length, before);
      if (transport === "stream") assert.ok(diagnostics(c).executeConnects >= 1);
    });
  }

  it("follows a leader named by a standby even when not listed", async () => {
    const s = await standby(server.address);
    const c = client(s.address);
    await c.acquire("follow-unlisted");
    assert.deepEqual(c.endpointList, [s.address]);
    assert.equal(c.address, server.address);
  });

  it("moves to the next endpoint when no leader is known", async () => {
    const s = await standby();
    const c = client([s.address, server.address]);
    await assert.rejects(c.get("nothing"), RunNotFoundError);
    assert.equal(c.address, server.address);
    assert.deepEqual((await s.refused()).map(([m]) => m), ["GetRun"]);
  });

  it("moves on from an unreachable endpoint", async () => {
    const c = client([await deadAddress(), server.address]);
    const lease = await c.acquire("follow-unreachable");
    assert.equal(c.address, server.address);
    assert.equal(lease.fencingToken, 1);
  });

  it("raises UNAVAILABLE naming every endpoint within the deadline when all are down", async () => {
    const dead = [await deadAddress(), await deadAddress()];
    const c = client(dead, { retry: FAST });
    for (const call of [() => c.get("r"), () => c.acquire("r")]) {
      const started = performance.now();
      const err = await call().catch((e: unknown) => e);
      assert.ok(performance.now() - started < GIVES_UP_MS);
      assert.ok(err instanceof UnavailableError, String(err));
      assert.ok(!(err instanceof OutcomeUnknownError), "never sent: not unknown");
      for (const a of dead) assert.ok(err.message.includes(a), err.message);
    }
  });

  it("raises NotLeaderError naming the standbys when they keep refusing", async () => {
    const one = await standby();
    const two = await standby();
    const c = client([one.address, two.address], { retry: FAST, transport: "unary" });
    const started = performance.now();
    const err = await c.acquire("r").catch((e: unknown) => e);
    assert.ok(performance.now() - started < GIVES_UP_MS);
    assert.ok(err instanceof NotLeaderError, String(err));
    assert.ok(!(err instanceof OutcomeUnknownError), "refused: not applied");
    assert.ok(err.message.includes(one.address) && err.message.includes(two.address), err.message);
    assert.match(err.message, /last leader hint: none/);
    const asked = (await one.refused()).length + (await two.refused()).length;
    assert.ok((await one.refused()).length && (await two.refused()).length && asked < 50, `asked ${asked}`);
  });

  it("does not spin between standbys naming each other", async () => {
    const one = await standby();
    const two = await standby(one.address);
    await one.setLeader(two.address);
    const c = client(one.address, { retry: FAST });
    const err = await c.get("r").catch((e: unknown) => e);
    assert.ok(err instanceof NotLeaderError, String(err));
    assert.ok([one.address, two.address].includes(err.leader));
    const asked = (await one.refused()).length + (await two.refused()).length;
    assert.ok(asked < 60, `asked ${asked}`);
  });

  it("re-opens KeepAlive on the next endpoint and re-tracks every lease", async () => {
    // a takeover: the coordinator dies, another starts on the same SQLite file at the next endpoint
    const dir = mkdtempSync(join(tmpdir(), "fencepost-ts-move-"));
    const db = join(dir, "fencepost.db");
    const [a, b] = [await deadAddress(), await deadAddress()];
    const launch = async (address: string) => {
      const child = spawn(findFencepostBin(), ["serve", "--listen", address, "--db", db], { stdio: "ignore" });
      await waitReady(address, child, () => "");
      return child;
    };
    const first = await launch(a);
    let second: ReturnType<typeof spawn> | undefined;
    try {
      const c = client([a, b], { transport: "unary" });
      const leases = await Promise.all([1, 2, 3].map((i) => c.acquire(`ka-${i}`, { ttlMs: 3000 })));
      const connects = diagnostics(c).keepAliveConnects;
      const gone = new Promise((r) => first.once("exit", r));
      first.kill("SIGKILL");
      await gone;
      const since = performance.now();
      second = await launch(b);
      // renewed on the new coordinator past their first ttl: re-tracked and renewed there
      for (const l of leases) {
        for (const deadline = performance.now() + 15_000; !(l.safeUntil > since + 3000);) {
          assert.ok(performance.now() < deadline, `${l.runId} not renewed on the new coordinator`);
          await new Promise((r) => setTimeout(r, 50));
        }
        assert.ok(l.isActive);
      }
      assert.equal(c.address, b);
      assert.ok(diagnostics(c).keepAliveConnects > connects);
      for (const l of leases) await l.finish();
    } finally {
      first.kill("SIGKILL");
      second?.kill("SIGKILL");
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
