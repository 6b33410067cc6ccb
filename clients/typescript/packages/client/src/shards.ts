// Which shard a key belongs to, as the server computes it (docs/SPEC.md
// "Shards"): the first 4 bytes of SHA-256 over the key's UTF-8 bytes, read as
// a big-endian unsigned integer, modulo the shard count.
import { createHash } from "node:crypto";

export const MAX_SHARDS = 4096;
/** Joins the parts of a compound key (an idempotency key's scope and key). */
export const SHARD_KEY_SEPARATOR = "\x1f";

/** The shard (0 .. shards - 1) that `key` belongs to among `shards`. */
export function shardOf(key: string, shards: number): number {
  if (!Number.isInteger(shards) || shards < 1 || shards > MAX_SHARDS) {
    throw new RangeError(`shards must be an integer between 1 and ${MAX_SHARDS} (got ${shards})`);
  }
  return createHash("sha256").update(key, "utf8").digest().readUInt32BE(0) % shards;
}
