// Where a command's items are: the shard keys of everything it writes or
// checks, computed as the server does (docs/SPEC.md "Shards", the table of
// shard keys). A fence adds the run or lock it is keyed by; a transaction is
// the union of its commands and its fence. `undefined`: no shard of its own
// (the coordinator the client talks to takes it).
import { SHARD_KEY_SEPARATOR } from "./shards.js";

type Req = Record<string, unknown> | undefined;

const str = (v: unknown): string => (typeof v === "string" ? v : "");
const field = (r: Req, name: string): Req => r?.[name] as Req;
const compound = (...parts: unknown[]) => parts.map(str).join(SHARD_KEY_SEPARATOR);

const RUN_ID = (r: Req) => [str(r?.["runId"])];
const ID = (r: Req) => [str(r?.["id"])];
const KEY = (r: Req) => [str(r?.["key"])];

const KEYS: Record<string, (r: Req) => string[]> = {
  acquire: RUN_ID, renew: RUN_ID, recordCheckpoint: RUN_ID, suspend: RUN_ID, finish: RUN_ID, release: RUN_ID,
  cancel: RUN_ID, requestResume: RUN_ID, deleteRun: RUN_ID,
  createRun: (r) => [str(field(r, "run")?.["id"])],
  updateRun: ID, claimRun: ID, renewClaim: ID,
  appendStep: (r) => [str(field(r, "step")?.["runId"])],
  saveCheckpoint: (r) => [str(field(r, "checkpoint")?.["runId"])],
  claimKey: (r) => [compound(r?.["scope"], r?.["key"])],
  acquireLock: KEY, releaseLock: KEY, putEffect: KEY,
  kvSet: (r) => [compound(r?.["agent"], r?.["key"])],
  docUpsert: (r) => [compound(r?.["agent"], r?.["collection"])],
  docDelete: (r) => [compound(r?.["agent"], r?.["collection"])],
};

/** The shard key of what a fence is keyed by: its run, or its lock. */
function fenceKey(fence: Req): string | undefined {
  if (!fence) return undefined;
  return str(fence["runId"]) || str(fence["lockKey"]) || undefined;
}

/**
 * The shard keys of the items a command (its kind and request, as sent)
 * writes or checks, first the command's own; undefined when it has no shard
 * of its own.
 */
export function shardKeys(kind: string, request: Req): string[] | undefined {
  if (kind === "transaction") {
    const keys: string[] = [];
    for (const c of (request?.["commands"] ?? []) as { kind?: { case?: string; value?: unknown } }[]) {
      const inner = c.kind?.case === undefined ? undefined : shardKeys(c.kind.case, c.kind.value as Req);
      if (inner === undefined) return undefined;
      keys.push(...inner);
    }
    const f = fenceKey(field(request, "fence"));
    if (f !== undefined) keys.push(f);
    return keys;
  }
  const keysOf = KEYS[kind];
  if (!keysOf) return undefined;
  const keys = keysOf(request);
  const f = fenceKey(field(request, "fence"));
  return f === undefined ? keys : [...keys, f];
}
