// The shard rule (docs/SPEC.md "Shards"): the vectors the server and the
// Python SDK check too, read from the repository's tests/vectors.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, describe, it } from "node:test";
import { FencepostClient, MAX_SHARDS, SHARD_KEY_SEPARATOR, shardOf } from "@fencepost/client";
import { startServer, type TestServer } from "@fencepost/client/testing";

const here = fileURLToPath(new URL(".", import.meta.url));
const file = join(here, "..", "..", "..", "..", "..", "tests", "vectors", "shards.json");
const vectors = (JSON.parse(readFileSync(file, "utf8")) as { vectors: { key: string; shards: number; shard: number }[] }).vectors;

describe("shardOf", () => {
  it("computes every shared vector", () => {
    assert.ok(vectors.length >= 50, "the vectors were read");
    assert.ok(vectors.some((v) => v.key.includes(SHARD_KEY_SEPARATOR)), "a compound key is among them");
    for (const v of vectors) assert.equal(shardOf(v.key, v.shards), v.shard, `${JSON.stringify(v.key)} among ${v.shards}`);
  });

  it("refuses a count out of bounds", () => {
    for (const n of [0, -1, MAX_SHARDS + 1, 1.5, Number.NaN]) assert.throws(() => shardOf("a", n), RangeError);
  });
});

describe("client.shards()", () => {
  let server: TestServer;
  let client: FencepostClient;
  before(async () => {
    server = await startServer({ args: ["--shards", "16"] });
    client = new FencepostClient(server.address, { owner: "ts-shards" });
  });
  after(async () => { await client.close(); await server.stop(); });

  it("answers the stored count and counts each run and live lease in its shard", async () => {
    const runIds = Array.from({ length: 40 }, (_, i) => `ts-shard-${i}`);
    const leases = await Promise.all(runIds.map((id) => client.acquire(id, { ttlMs: 60_000 })));
    await leases[0]!.finish("completed");
    const map = await client.shards();
    assert.equal(map.shardCount, 16);
    assert.deepEqual(map.shards.map((s) => s.index), [...Array(16).keys()]);
    const expected = (ids: string[]) => {
      const counts = new Array<number>(16).fill(0);
      for (const id of ids) counts[shardOf(id, 16)]! += 1;
      return counts;
    };
    assert.deepEqual(map.shards.map((s) => s.runs), expected(runIds));
    assert.deepEqual(map.shards.map((s) => s.leases), expected(runIds.slice(1)));
    assert.ok(map.shards.every((s) => s.address === server.address && s.epoch === 0 && s.owner !== ""));
    assert.ok(map.revision >= 41);
  });
});
