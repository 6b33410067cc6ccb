// Coordinators on one real PostgreSQL, for the tests: helpers/pg_coordinators.py
// (one leading; with --lead-shards all leading shards apart, 8 shards, a 2 s
// shard lease renewed every 300 ms), driven over its stdin; EOF stops every
// coordinator, then PostgreSQL, by pid.
import assert from "node:assert/strict";
import { spawn, type ChildProcessWithoutNullStreams } from "node:child_process";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { findFencepostBin } from "@fencepost/client/testing";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Poll `ok` every 25 ms until it holds (at most `ms`). */
export async function until(ok: () => boolean | Promise<boolean>, ms: number, what: string): Promise<void> {
  const deadline = performance.now() + ms;
  while (!(await ok())) {
    assert.ok(performance.now() < deadline, `not within ${ms} ms: ${what}`);
    await sleep(25);
  }
}

/**
 * helpers/pg_coordinators.py with `args`, and the first line it writes (what it
 * started, or why it skipped); it is then driven over its stdin.
 */
export async function startCoordinators(args: string[]): Promise<{ child: ChildProcessWithoutNullStreams; first: string }> {
  const python = join(dirname(findFencepostBin()), "python");
  const script = join(dirname(fileURLToPath(import.meta.url)), "..", "helpers", "pg_coordinators.py");
  const child = spawn(python, [script, ...args], { stdio: ["pipe", "pipe", "pipe"] });
  let err = "";
  child.stderr.on("data", (d) => { err = (err + d).slice(-5000); });
  const first = await new Promise<string>((resolve, reject) => {
    const rl = createInterface({ input: child.stdout });
    rl.once("line", (l) => { rl.close(); resolve(l); });
    child.once("exit", (code) => reject(new Error(`pg_coordinators exited ${code}: ${err}`)));
  });
  return { child, first };
}

/** Coordinators on one fresh PostgreSQL database, driven over the helper's stdin. */
export class Group {
  private waiting: ((line: string) => void)[] = [];
  private constructor(private readonly child: ChildProcessWithoutNullStreams, readonly shards: number) {
    createInterface({ input: child.stdout }).on("line", (l) => this.waiting.shift()?.(l));
  }

  static async start(): Promise<Group | string> {
    const { child, first } = await startCoordinators(["--lead-shards"]);
    const msg = JSON.parse(first) as { shards?: number; skip?: string };
    if (msg.skip) return msg.skip;
    return new Group(child, msg.shards!);
  }

  private async ask<T>(command: string): Promise<T> {
    const line = await new Promise<string>((resolve) => {
      this.waiting.push(resolve);
      this.child.stdin.write(command + "\n");
    });
    const got = JSON.parse(line) as T & { error?: string };
    if (got.error) throw new Error(`${command}: ${got.error}`);
    return got;
  }

  /** Shard -> address, by index ("" none). */
  private byIndex(owners: Record<string, string>): string[] {
    return Array.from({ length: this.shards }, (_, s) => owners[String(s)] ?? "");
  }

  /** Once every shard is held by the coordinators running, each its share: the owners and who runs. */
  async balanced(): Promise<{ owners: string[]; alive: string[] }> {
    const got = await this.ask<{ owners: Record<string, string>; alive: string[] }>("balanced");
    return { owners: this.byIndex(got.owners), alive: got.alive };
  }

  async owners(): Promise<string[]> { return this.byIndex((await this.ask<{ owners: Record<string, string> }>("owners")).owners); }
  async kill(address: string): Promise<void> { await this.ask("kill " + address); }
  async term(address: string): Promise<number | null> { return (await this.ask<{ code: number | null }>("term " + address)).code; }
  async add(): Promise<string> { return (await this.ask<{ address: string }>("add")).address; }

  async stop(): Promise<void> {
    const done = new Promise((r) => this.child.once("exit", r));
    this.child.stdin.end();
    await done;
  }
}
