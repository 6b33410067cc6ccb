// Routing by shard (docs/SPEC.md "Shards"): two real servers, each told by
// the test-only shard map (FENCEPOST_TEST_SHARD_MAP with --test-hooks) that
// it leads half of 4 shards, each over its own database. A call keyed in the
// other half is refused with NOT_OWNER naming its owner; the client routes.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { FencepostClient, NotOwnerError, fromCallError, shardOf } from "@fencepost/client";
import { freePort, startServer, type TestServer } from "@fencepost/client/testing";

const SHARDS = 4;

interface Pair { a: TestServer; b: TestServer; stop(): Promise<void> }

/** Two servers on ports picked first; `maps` gives each its own map (default both "A=0-1;B=2,3"). */
async function startPair(maps?: (a: string, b: string) => [string, string]): Promise<Pair> {
  const [pa, pb] = [await freePort(), await freePort()];
  const [addrA, addrB] = [`127.0.0.1:${pa}`, `127.0.0.1:${pb}`];
  const [mapA, mapB] = maps?.(addrA, addrB) ?? [`${addrA}=0-1;${addrB}=2,3`, `${addrA}=0-1;${addrB}=2,3`];
  const start = (port: number, map: string) =>
    startServer({ port, args: ["--shards", String(SHARDS)], env: { FENCEPOST_TEST_SHARD_MAP: map } });
  const [a, b] = await Promise.all([start(pa, mapA), start(pb, mapB)]);
  return { a, b, async stop() { await Promise.all([a.stop(), b.stop()]); } };
}

/** `count` distinct keys `${prefix}-N` whose shard is `shard`. */
function keysIn(shard: number, prefix: string, count = 1): string[] {
  const out: string[] = [];
  for (let i = 0; out.length < count; i++) if (shardOf(`${prefix}-${i}`, SHARDS) === shard) out.push(`${prefix}-${i}`);
  return out;
}

describe("NOT_OWNER", () => {
  let pair: Pair;
  before(async () => { pair = await startPair(); });
  after(async () => { await pair.stop(); });

  it("is a NotOwnerError naming the shard, its owner and epoch", async () => {
    const raw = new FencepostClient(pair.b.address, { owner: "ts-raw" });
    try {
      const [runId] = keysIn(1, "ts-err");
      const thrown = await raw.stubs.ledger.getRun({ runId: runId! }).then(() => undefined, (e: unknown) => e);
      const err = fromCallError(thrown);
      assert.ok(err instanceof NotOwnerError, `got ${String(err)}`);
      assert.equal(err.code, "NOT_OWNER");
      assert.equal(err.shard, 1);
      assert.equal(err.owner, pair.a.address);
      assert.equal(err.epoch, 1);
    } finally {
      await raw.close();
    }
  });
});
