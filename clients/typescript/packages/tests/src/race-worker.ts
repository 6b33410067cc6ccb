// One of the racing processes of crossprocess.test.ts: waits for the common
// start time, races for every id in every kind, prints what it won as JSON.
import { FencepostClient, LeaseHeldError } from "@fencepost/client";
import { FencepostRunStore } from "@fencepost/oma";
import { FencepostStore } from "@fencepost/chamvi";

const [address, me, startAt, count] = [process.argv[2]!, process.argv[3]!, Number(process.argv[4]), Number(process.argv[5])];
const ids = Array.from({ length: count }, (_, i) => `race-${i}`);
const t0 = "2030-01-01T00:00:00.000Z";

const client = new FencepostClient(address, { owner: `proc-${me}` });
const oma = await FencepostRunStore.connect(address);
const chamvi = await FencepostStore.connect(address);
// warm the connections so the race is decided by the server, not by start-up
await client.stubs.runStore.describe({});
await chamvi.getRun("warm-up");
await new Promise((r) => setTimeout(r, Math.max(0, startAt - Date.now())));

const won: Record<string, string[]> = {};
const note = (kind: string, id: string, ok: boolean) => { if (ok) (won[kind] ??= []).push(id); };
// Each process goes through the ids in its own random order, a few at a time,
// so that the processes' commands interleave at the server.
const order = [...ids].sort(() => Math.random() - 0.5);
const chains = Array.from({ length: 4 }, (_, c) => order.filter((_, i) => i % 4 === c));
async function raceFor(id: string): Promise<void> {
  const lease = await client.acquire(`lease-${id}`, { ttlMs: 60_000, renew: false }).catch((e: unknown) => {
    if (e instanceof LeaseHeldError) return undefined;
    throw e;
  });
  note("acquire", id, lease !== undefined);
  note("oma.create", id, await oma.create({ schema: 1, runId: `oma-${id}`, version: 1, status: "queued", attempt: 1, fencingToken: 1, createdAt: t0, updatedAt: t0, lease: { owner: me, acquiredAt: t0, expiresAt: t0 } }));
  const cur = await oma.get(`oma-${id}`);
  note("oma.compareAndSet", id, await oma.compareAndSet(`oma-${id}`, 1, { ...cur!, version: 2, fencingToken: 2, lease: { owner: me, acquiredAt: t0, expiresAt: t0 } }));
  note("chamvi.createRun", id, await chamvi.createRun({ id: `ch-${id}`, agent: "race", status: "queued", input: { me } }));
  note("chamvi.claimRun", id, await chamvi.claimRun(`ch-${id}`, me, 60_000));
  note("chamvi.claimKey", id, (await chamvi.claimKey("race", id, `run-of-${me}`, 60_000)).created);
  note("chamvi.acquire", id, await chamvi.acquire(`lock-${id}`, me, 60_000));
  note("chamvi.putArtifact", id, await chamvi.putArtifact({ id: `art-${id}`, runId: "race" }, new TextEncoder().encode(me)));
}
await Promise.all(chains.map(async (chain) => { for (const id of chain) await raceFor(id); }));
process.stdout.write(JSON.stringify({ me, won }) + "\n");
await client.close();
await oma.close();
await chamvi.close();
