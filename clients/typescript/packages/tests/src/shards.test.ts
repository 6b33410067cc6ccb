// The shard rule (docs/SPEC.md "Shards"): the vectors the server and the
// Python SDK check too, read from the repository's tests/vectors.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, it } from "node:test";
import { MAX_SHARDS, SHARD_KEY_SEPARATOR, shardOf } from "@fencepost/client";

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
