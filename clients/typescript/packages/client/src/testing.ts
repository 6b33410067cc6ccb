// For tests, not production (`@fencepost/client/testing`): real fencepost
// servers (`startServer()` spawns `fencepost serve` on a free 127.0.0.1 port
// over a fresh SQLite file in a temporary directory, with the test clock hooks
// unless asked not to, waits until it answers, and `stop()` ends it by PID),
// the server's test clock, and a client's diagnostic counters.
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync, existsSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import type { Client } from "@connectrpc/connect";
import { FencepostClient, internals, type ClientOptions } from "./client.js";
import { ValidationError } from "./errors.js";
import type { TestHooks } from "./gen/fencepost/v1/testing_pb.js";
import { toNumber } from "./records.js";

/** The TestHooks service (a server started with --test-hooks) on the client's connection. */
export function testHooks(client: FencepostClient): Client<typeof TestHooks> {
  return client[internals].testHooks;
}

/** Move the server's clock forward by `ms` (a server started with --test-hooks); its new now, ms. */
export async function jumpClock(client: FencepostClient, ms: number): Promise<number> {
  if (!Number.isSafeInteger(ms) || ms < 0) throw new ValidationError("ms: must be a non-negative integer", { field: "ms" });
  const resp = await testHooks(client).jumpClock({ ms: BigInt(ms) });
  return toNumber(resp.nowMs);
}

export interface Diagnostics {
  /**
   * How many times the Execute command stream has been opened (1 while it
   * stays up); a stream shared by several clients counts for all of them.
   */
  executeConnects: number;
  /** How many commands the Execute stream has carried (for all the clients sharing it). */
  executeCommands: number;
  /** How many times the shared KeepAlive stream has been opened (1 while it stays up). */
  keepAliveConnects: number;
  /** How many messages the KeepAlive stream has written (hello, renewals, track, untrack). */
  keepAliveMessages: number;
  /** The coordinators the client has a connection to: its own endpoint, then those it routed calls to. */
  coordinators: string[];
}

/** A client's stream counters, read now. */
export function diagnostics(client: FencepostClient): Diagnostics {
  const i = client[internals];
  return { executeConnects: i.executeConnects(), executeCommands: i.executeCommands(), keepAliveConnects: i.keepAliveConnects(), keepAliveMessages: i.keepAliveMessages(), coordinators: i.coordinators() };
}

export interface TestServer {
  address: string;
  db: string;
  pid: number;
  /** Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its directory. */
  stop(): Promise<void>;
  /** Stop and start again on the same address and database. */
  restart(): Promise<void>;
}

export interface StartOptions {
  /** The fencepost executable (default $FENCEPOST_BIN, else .venv/bin/fencepost found upwards from cwd). */
  bin?: string;
  /** Register the TestHooks service (the server's test clock); default true. */
  testHooks?: boolean;
  /** Extra command-line flags. */
  args?: string[];
  /** How the readiness check connects (a server with --tls-cert needs tls). */
  connect?: ClientOptions;
  /** The port to listen on (default a free one): servers that must name each other pick theirs first. */
  port?: number;
  /** Extra environment variables for the server process. */
  env?: Record<string, string>;
  /** Serve this database file (kept on stop) instead of a fresh one. */
  db?: string;
}

export function findFencepostBin(): string {
  if (process.env["FENCEPOST_BIN"]) return process.env["FENCEPOST_BIN"];
  let dir = process.cwd();
  for (;;) {
    const candidate = join(dir, ".venv", "bin", "fencepost");
    if (existsSync(candidate)) return candidate;
    const up = resolve(dir, "..");
    if (up === dir) throw new Error("no .venv/bin/fencepost above the current directory: set FENCEPOST_BIN");
    dir = up;
  }
}

export function freePort(): Promise<number> {
  return new Promise((res, rej) => {
    const s = createServer();
    s.once("error", rej);
    s.listen(0, "127.0.0.1", () => {
      const addr = s.address();
      const port = typeof addr === "object" && addr ? addr.port : 0;
      s.close(() => res(port));
    });
  });
}

/** Wait until a server answers (`options`: its TLS or token, when it needs them). */
export async function waitReady(address: string, child: ChildProcess, log: () => string, options: ClientOptions = {}): Promise<void> {
  const client = new FencepostClient(address, { ...options, retry: { maxAttempts: 1, attemptTimeoutMs: 1000 } });
  const deadline = Date.now() + 30_000;
  try {
    for (;;) {
      if (child.exitCode !== null) throw new Error(`fencepost exited with ${child.exitCode}:\n${log()}`);
      try {
        await client.stubs.runStore.describe({}, { timeoutMs: 1000 });
        return;
      } catch (e) {
        // refused (no role for the raw seam): it answers all the same
        const code = (e as { code?: unknown }).code;
        if (code === 7 || code === 16) return;
        if (Date.now() > deadline) throw new Error(`fencepost did not answer on ${address} within 30 s:\n${log()}`);
        await new Promise((r) => setTimeout(r, 50));
      }
    }
  } finally {
    await client.close();
  }
}

export async function startServer(options: StartOptions = {}): Promise<TestServer> {
  const bin = options.bin ?? findFencepostBin();
  const dir = options.db === undefined ? mkdtempSync(join(tmpdir(), "fencepost-ts-")) : undefined;
  const db = options.db ?? join(dir!, "fencepost.db");
  const port = options.port ?? await freePort();
  const address = `127.0.0.1:${port}`;
  let child: ChildProcess;
  let output = "";
  const launch = async () => {
    const args = ["serve", "--listen", address, "--db", db, ...(options.testHooks === false ? [] : ["--test-hooks"]), ...(options.args ?? [])];
    child = spawn(bin, args, { stdio: ["ignore", "pipe", "pipe"], ...(options.env ? { env: { ...process.env, ...options.env } } : {}) });
    child.stdout?.on("data", (d) => { output = (output + d).slice(-20_000); });
    child.stderr?.on("data", (d) => { output = (output + d).slice(-20_000); });
    await waitReady(address, child, () => output, options.connect);
  };
  const kill = async () => {
    if (child.exitCode !== null || child.signalCode !== null) return;
    const done = new Promise<void>((r) => child.once("exit", () => r()));
    child.kill("SIGTERM");
    const t = setTimeout(() => child.kill("SIGKILL"), 5000);
    await done;
    clearTimeout(t);
  };
  await launch();
  return {
    address,
    db,
    get pid() { return child.pid ?? -1; },
    async stop() { await kill(); if (dir !== undefined) rmSync(dir, { recursive: true, force: true }); },
    async restart() { await kill(); await launch(); },
  };
}
