// The shard rule (docs/SPEC.md "Shards"): the vectors the server and the
// Python SDK check too, read from the repository's tests/vectors.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, describe, it } from "node:test";
import { fromJson, type JsonValue } from "@bufbuild/protobuf";
import { FencepostClient, MAX_SHARDS, SHARD_KEY_SEPARATOR, shardKeys, shardOf } from "@fencepost/client";
import { CommandSchema } from "@fencepost/client/gen/fencepost/v1/ledger_pb";
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

describe("shardKeys", () => {
  const placed = join(here, "..", "..", "..", "..", "..", "tests", "vectors", "placement.json");
  const commands = (JSON.parse(readFileSync(placed, "utf8")) as {
    vectors: { command: JsonValue; shard_keys: string[] | null; shards_of_64: number[] | null }[];
  }).vectors;

  it("gives every shared command vector's shard keys, as the server computes them", () => {
    assert.ok(commands.length >= 20 && commands.some((v) => "transaction" in (v.command as object)), "the vectors were read");
    for (const v of commands) {
      const cmd = fromJson(CommandSchema, v.command);
      const keys = shardKeys(cmd.kind.case!, cmd.kind.value as never);
      assert.deepEqual(keys ?? null, v.shard_keys, JSON.stringify(v.command));
      const shards = keys === undefined ? null : [...new Set(keys.map((k) => shardOf(k, 64)))].sort((a, b) => a - b);
      assert.deepEqual(shards, v.shards_of_64);
    }
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
