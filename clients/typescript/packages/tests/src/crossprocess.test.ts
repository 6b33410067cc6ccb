// 8 node processes race for the same runs, keys, locks and artifacts on one
// server: each one must have exactly one winner, and the stored state must
// name that winner.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { after, before, it } from "node:test";
import { startServer, type TestServer } from "@fencepost/client/testing";
import { FencepostStore } from "@fencepost/chamvi";
import { FencepostRunStore } from "@fencepost/oma";

const PROCESSES = 8;
const IDS = 25;
const KINDS = ["acquire", "oma.create", "oma.compareAndSet", "chamvi.createRun", "chamvi.claimRun", "chamvi.claimKey", "chamvi.acquire", "chamvi.putArtifact"];

let server: TestServer;
before(async () => { server = await startServer(); });
after(async () => { await server.stop(); });

function runWorker(me: string, startAt: number): Promise<{ me: string; won: Record<string, string[]> }> {
  return new Promise((resolve, reject) => {
    const worker = fileURLToPath(new URL("./race-worker.js", import.meta.url));
    const child = spawn(process.execPath, [worker, server.address, me, String(startAt), String(IDS)], { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    child.stdout.on("data", (d) => { out += d; });
    child.stderr.on("data", (d) => { err += d; });
    child.on("exit", (code) => {
      if (code !== 0) return reject(new Error(`worker ${me} exited ${code}: ${err}`));
      try { resolve(JSON.parse(out.trim().split("\n").pop()!)); } catch (e) { reject(new Error(`worker ${me}: ${out} ${err} ${String(e)}`)); }
    });
  });
}

it(`${PROCESSES} processes racing for the same ids: exactly one winner each`, async () => {
  const startAt = Date.now() + 3000;
  const results = await Promise.all(Array.from({ length: PROCESSES }, (_, i) => runWorker(`p${i}`, startAt)));
  const chamvi = await FencepostStore.connect(server.address);
  const oma = await FencepostRunStore.connect(server.address);
  try {
    const winners = new Map<string, string[]>();
    for (const r of results) {
      for (const [kind, ids] of Object.entries(r.won)) for (const id of ids) {
        const k = `${kind}/${id}`;
        winners.set(k, [...(winners.get(k) ?? []), r.me]);
      }
    }
    const spread = new Set<string>();
    for (const kind of KINDS) for (let i = 0; i < IDS; i++) {
      const id = `race-${i}`;
      const w = winners.get(`${kind}/${id}`) ?? [];
      assert.equal(w.length, 1, `${kind} ${id}: winners ${JSON.stringify(w)}`);
      spread.add(w[0]!);
    }
    // the stored state names the winner
    for (let i = 0; i < IDS; i++) {
      const id = `race-${i}`;
      const who = (kind: string) => winners.get(`${kind}/${id}`)![0]!;
      assert.deepEqual((await chamvi.getRun(`ch-${id}`))?.input, { me: who("chamvi.createRun") });
      assert.equal((await chamvi.getRun(`ch-${id}`))?.claim?.owner, who("chamvi.claimRun"));
      assert.equal((await chamvi.claimKey("race", id, "checker", 60_000)).runId, `run-of-${who("chamvi.claimKey")}`);
      assert.equal(new TextDecoder().decode(await chamvi.readArtifact(`art-${id}`)), who("chamvi.putArtifact"));
      assert.equal((await oma.get(`oma-${id}`))?.lease?.owner, who("oma.compareAndSet"));
    }
    assert.ok(spread.size > 1, "more than one process won something (the race was real)");
  } finally {
    await chamvi.close();
    await oma.close();
  }
});
