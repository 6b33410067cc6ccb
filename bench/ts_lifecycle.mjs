// The TypeScript half of bench/ts_lifecycle.py: the fleet or engine shape of
// bench/peers (each run: acquire, 3 renewals, a checkpoint, finish) with
// @fencepost/client (built: `npm run build` in clients/typescript), for a
// fixed time after a warm-up. Prints one JSON line.
//   node bench/ts_lifecycle.mjs '{"address", "seconds", "concurrency", "shape", "transport", "owner", "tls"?}'
import { readFileSync } from "node:fs";
import { join, dirname } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const repo = join(dirname(fileURLToPath(import.meta.url)), "..");
const { FencepostClient } = await import(pathToFileURL(join(repo, "clients/typescript/packages/client/dist/index.js")).href);
const cfg = JSON.parse(process.argv[2]);
const tls = cfg.tls ? { ca: readFileSync(cfg.tls.ca), cert: readFileSync(cfg.tls.cert), key: readFileSync(cfg.tls.key) } : undefined;
const open = (owner) => new FencepostClient(cfg.address, { owner, transport: cfg.transport, ...(tls ? { tls } : {}) });

// fleet: one client (one owner) per worker, as every process of a fleet has its own;
// engine: one client for the whole process, all runs under its owner
const clients = cfg.shape === "fleet"
  ? Array.from({ length: cfg.concurrency }, (_, i) => open(`${cfg.owner}/c${i}`))
  : [open(`${cfg.owner}/engine-${process.pid}`)];
const latencies = [];
let seq = 0;

async function lifecycle(client, runId) {
  const lease = await client.acquire(runId, { ttlMs: 60_000 });
  for (let i = 0; i < 3; i++) await lease.renew();
  await lease.recordCheckpoint(`ckpt/${runId}`, 1);
  await lease.finish("completed");
}

// warm-up: every client's connection and streams are open before the window
await Promise.all(clients.map((c, i) => lifecycle(c, `ts-warm-${process.pid}-${i}`)));
const deadline = performance.now() + cfg.seconds * 1000;
async function worker(w) {
  const client = clients[w % clients.length];
  while (performance.now() < deadline) {
    const t = performance.now();
    await lifecycle(client, `ts-${process.pid}-${w}-${seq++}`);
    latencies.push(performance.now() - t);
  }
}
const started = performance.now();
await Promise.all(Array.from({ length: cfg.concurrency }, (_, i) => worker(i)));
const elapsed = (performance.now() - started) / 1000;
latencies.sort((a, b) => a - b);
const p = (q) => latencies[Math.min(latencies.length - 1, Math.max(0, Math.ceil((q / 100) * latencies.length) - 1))] ?? 0;
console.log(JSON.stringify({ lifecycles: latencies.length, seconds: elapsed, p50_ms: p(50), p99_ms: p(99) }));
await Promise.all(clients.map((c) => c.close()));
