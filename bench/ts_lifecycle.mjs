// The TypeScript half of bench/ts_lifecycle.py: lifecycle operations
// (acquire a new run, then finish it) with a fixed number in flight, for a
// fixed time, with @fencepost/client (built: `npm run build` in
// clients/typescript). Prints one JSON line.
//   node bench/ts_lifecycle.mjs ADDRESS SECONDS CONCURRENCY [stream|unary]
import { join, dirname } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const repo = join(dirname(fileURLToPath(import.meta.url)), "..");
const { FencepostClient } = await import(pathToFileURL(join(repo, "clients/typescript/packages/client/dist/index.js")).href);
const [address, seconds, concurrency, transport] = [process.argv[2], Number(process.argv[3]), Number(process.argv[4]), process.argv[5] ?? "stream"];

const client = new FencepostClient(address, { owner: `bench-ts-${process.pid}`, transport });
let ops = 0;
let seq = 0;
const latencies = [];
const deadline = performance.now() + seconds * 1000;
async function worker(w) {
  while (performance.now() < deadline) {
    const t = performance.now();
    const lease = await client.acquire(`ts-${process.pid}-${w}-${seq++}`, { ttlMs: 60_000 });
    await lease.finish();
    latencies.push(performance.now() - t);
    ops++;
  }
}
// warm up the connection
await (await client.acquire(`ts-${process.pid}-warm`, { ttlMs: 60_000 })).finish();
const started = performance.now();
await Promise.all(Array.from({ length: concurrency }, (_, i) => worker(i)));
const elapsed = (performance.now() - started) / 1000;
latencies.sort((a, b) => a - b);
const p = (q) => latencies[Math.min(latencies.length - 1, Math.floor((q / 100) * latencies.length))];
console.log(JSON.stringify({ client: `typescript (${transport})`, ops, seconds: elapsed, ops_per_s: ops / elapsed, p50_ms: p(50), p99_ms: p(99) }));
await client.close();
