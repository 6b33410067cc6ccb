// watchRuns by shards (docs/SPEC.md §6.2, §13; docs/TYPESCRIPT.md): where
// coordinators lead shards apart, revisions order changes only within a
// shard, so a watch resumes from a WatchCursor, one revision per shard. The
// client opens one WatchRuns stream per owner for the shards it leads and
// merges them; a stream ended by a move (NOT_OWNER), a dead coordinator or
// STREAM_TOO_SLOW is reopened, for its shards, at their owners by a fresh
// map, each shard after the last revision delivered in it.
import { Code } from "@connectrpc/connect";
import { ChangeKind, type WatchRunsResponse } from "./gen/fencepost/v1/ledger_pb.js";
import { fromCallError, StreamTooSlowError, ValidationError } from "./errors.js";
import { recordFromPb, toNumber, type RunRecord } from "./records.js";
import type { Coordinator, OwnerMap } from "./routing.js";
import { MAX_SHARDS } from "./shards.js";

/** The text form's version prefix. */
export const CURSOR_PREFIX = "fpw1:";
/** A stream of a watch by shards is reopened after this long at first, backing off to REOPEN_MAX_MS (ms). */
export const REOPEN_MIN_MS = 25;
export const REOPEN_MAX_MS = 250;

export interface RunChange {
  revision: number;
  kind: "put" | "delete";
  runId: string;
  /** The record as written; absent for a delete. */
  record?: RunRecord;
  /** The run's shard (set on a watch by shards). */
  shard?: number;
}

/**
 * Where a watch by shards stands: per shard, the last revision delivered
 * (every change of the shard up to it was). `watchRuns({ cursor })` updates
 * it in place as it yields each change; `encode()` is its text form,
 * `"fpw1:SHARD=REVISION,..."` by shard ascending, which `decode` reads back
 * (the Python SDK's form: a cursor saved by either resumes in the other).
 */
export class WatchCursor {
  readonly revisions: Map<number, number>;

  constructor(revisions: Iterable<readonly [number, number]> = []) {
    this.revisions = new Map(revisions);
  }

  encode(): string {
    return CURSOR_PREFIX + [...this.revisions].sort((a, b) => a[0] - b[0]).map(([s, r]) => `${s}=${r}`).join(",");
  }

  toString(): string { return this.encode(); }

  /** The cursor `text` (an `encode()`) stands for; a `ValidationError` naming `cursor` for anything else. */
  static decode(text: string): WatchCursor {
    const bad = (why: string) => new ValidationError(`cursor: ${why}`, { field: "cursor" });
    if (typeof text !== "string" || !text.startsWith(CURSOR_PREFIX)) {
      throw bad(`not a watch cursor (one starts with "${CURSOR_PREFIX}")`);
    }
    const body = text.slice(CURSOR_PREFIX.length);
    const revisions = new Map<number, number>();
    if (body === "") return new WatchCursor();
    for (const part of body.split(",")) {
      const m = /^([0-9]+)=([0-9]+)$/.exec(part);
      const shown = part.length > 40 ? `${part.slice(0, 40)}...` : part;
      if (!m) throw bad(`"${shown}" is not SHARD=REVISION (non-negative integers)`);
      const [shard, revision] = [Number(m[1]), Number(m[2])];
      if (shard >= MAX_SHARDS) throw bad(`shard ${m[1]} is not below ${MAX_SHARDS}`);
      if (!Number.isSafeInteger(revision)) throw bad(`revision ${shown} is beyond 2^53 - 1`);
      if (revisions.has(shard)) throw bad(`shard ${shard} is listed twice`);
      revisions.set(shard, revision);
    }
    return new WatchCursor(revisions);
  }
}

/** What a watch by shards needs of its client. */
export interface WatchHost {
  /** A fresh shard map (throws as a failed call does). */
  map(signal?: AbortSignal): Promise<OwnerMap>;
  /** The coordinator the client was given. */
  home: Coordinator;
  /** The coordinator at `address`, connected on first use (undefined: this client cannot go there). */
  at(address: string): Coordinator | undefined;
  closed(): boolean;
}

/** One WatchRuns stream: the shards it watches, at one coordinator. */
interface Opened {
  shards: number[];
  coordinator: Coordinator;
  /** Reopens in a row that ended before the stream's first message. */
  failures: number;
  started: boolean;
  ac: AbortController;
}

/** What a stream's pump hands the merge: a message, or the stream's end (`err`: how it failed). */
interface Item { from: Opened; m?: WatchRunsResponse; ended?: true; err?: unknown }

/**
 * The messages of every stream, one waiting per stream at most: a pump
 * reads its next message only once the merge took the last, so a slow
 * consumer holds the server back (and is told STREAM_TOO_SLOW) as one stream would.
 */
class Inbox {
  private items: { item: Item; taken: () => void }[] = [];
  private wake: (() => void) | undefined;
  private closed = false;

  put(item: Item): Promise<void> {
    if (this.closed) return Promise.resolve();
    return new Promise((taken) => {
      this.items.push({ item, taken });
      this.wake?.();
    });
  }

  /** The next item; undefined after `waitMs` (or an abort) with none. */
  async take(waitMs: number | undefined, signal: AbortSignal | undefined): Promise<Item | undefined> {
    if (!this.items.length && !signal?.aborted) {
      let timer: NodeJS.Timeout | undefined;
      let onAbort: (() => void) | undefined;
      await new Promise<void>((resolve) => {
        this.wake = resolve;
        if (waitMs !== undefined) timer = setTimeout(resolve, waitMs);
        onAbort = resolve;
        signal?.addEventListener("abort", onAbort, { once: true });
      });
      this.wake = undefined;
      clearTimeout(timer);
      if (onAbort) signal?.removeEventListener("abort", onAbort);
    }
    const next = this.items.shift();
    next?.taken();
    return next?.item;
  }

  close(): void {
    this.closed = true;
    for (const x of this.items) x.taken();
    this.items = [];
  }
}

function reopenDelay(failures: number): number {
  return Math.min(REOPEN_MAX_MS, REOPEN_MIN_MS * 2 ** failures) * (0.75 + Math.random() * 0.25);
}

/** Whether a watch stream that ended with `err` is reopened (elsewhere, by a fresh map). */
function reopens(err: unknown): boolean {
  const e = fromCallError(err);
  return e.grpcCode === Code.Unavailable || e instanceof StreamTooSlowError;
}

/**
 * Every change of every shard after `cursor` (a shard it lacks: from when
 * its stream starts), merged from one stream per owner of `map`; each
 * change's revision is written into `cursor` as it is yielded.
 */
export async function* watchByShards(
  host: WatchHost, cursor: WatchCursor, runIds: string[], map: OwnerMap, signal: AbortSignal | undefined,
): AsyncGenerator<RunChange, void, undefined> {
  for (const shard of cursor.revisions.keys()) {
    if (!(Number.isInteger(shard) && shard >= 0 && shard < map.shardCount)) {
      throw new ValidationError(`cursor: shard ${shard} is not one of this database's ${map.shardCount} shards`, { field: "cursor" });
    }
  }
  const inbox = new Inbox();
  const live = new Set<Opened>();
  /** Shards to (re)open once `at` (a performance.now() reading) has passed. */
  let due: { shards: number[]; failures: number; at: number }[] = [
    { shards: Array.from({ length: map.shardCount }, (_, s) => s), failures: 0, at: 0 },
  ];
  let fresh = true; // `map` was just fetched

  const pump = async (o: Opened): Promise<void> => {
    try {
      // a shard the cursor lacks is left unset: from now (a cursor's 0 is a real place)
      const shards = o.shards.map((shard) => {
        const after = cursor.revisions.get(shard);
        return after === undefined ? { shard } : { shard, afterRevision: BigInt(after) };
      });
      for await (const m of o.coordinator.stubs.ledger.watchRuns({ runIds, shards }, { signal: o.ac.signal })) {
        if (o.ac.signal.aborted) return;
        await inbox.put({ from: o, m });
      }
      if (!o.ac.signal.aborted) await inbox.put({ from: o, ended: true });
    } catch (err) {
      if (!o.ac.signal.aborted) await inbox.put({ from: o, ended: true, err });
    }
  };

  const open = (shards: number[], failures: number): void => {
    const byOwner = new Map<Coordinator, number[]>();
    const unknown: number[] = [];
    for (const s of shards) {
      const address = map.owners[s] ?? "";
      // the shards of the coordinator that answered the map are watched where it was reached
      // (its advertised address may be one only the coordinators reach; the given one follows a leader)
      const c = map.from && map.led?.[s] ? map.from : address ? host.at(address) ?? host.home : undefined;
      if (!c) unknown.push(s);
      else byOwner.set(c, [...(byOwner.get(c) ?? []), s]);
    }
    for (const [coordinator, theirs] of byOwner) {
      const o: Opened = { shards: theirs, coordinator, failures, started: false, ac: new AbortController() };
      live.add(o);
      void pump(o);
    }
    // being taken or handed over: asked of a newer map shortly
    if (unknown.length) due.push({ shards: unknown, failures: failures + 1, at: performance.now() + reopenDelay(failures) });
  };

  const stopAll = () => { for (const o of live) o.ac.abort(); };
  signal?.addEventListener("abort", stopAll, { once: true });
  try {
    for (;;) {
      if (signal?.aborted || host.closed()) return;
      const now = performance.now();
      const ready = due.filter((d) => d.at <= now);
      if (ready.length) {
        due = due.filter((d) => d.at > now);
        let mapped = fresh;
        fresh = false;
        if (!mapped) {
          try {
            map = await host.map(signal);
            mapped = true;
          } catch (e) {
            if (signal?.aborted || host.closed()) return;
            const err = fromCallError(e);
            if (err.grpcCode !== Code.Unavailable) throw err;
            for (const d of ready) due.push({ ...d, failures: d.failures + 1, at: performance.now() + reopenDelay(d.failures + 1) });
          }
        }
        if (mapped) for (const d of ready) open(d.shards, d.failures);
      }
      const soonest = due.length ? Math.max(0, Math.min(...due.map((d) => d.at)) - performance.now()) : undefined;
      const item = await inbox.take(soonest, signal);
      if (!item || !live.has(item.from)) continue;
      const o = item.from;
      const m = item.m;
      if (m) {
        if (!o.started) {
          // the stream's first message: where each of its shards starts (one the cursor lacked:
          // the revision it starts after, so a reopen elsewhere leaves no gap)
          o.started = true;
          o.failures = 0;
          for (const c of m.cursors) {
            if (!cursor.revisions.has(c.shard)) cursor.revisions.set(c.shard, toNumber(c.afterRevision ?? 0n));
          }
          if (!m.runId) continue;
        }
        const revision = toNumber(m.revision);
        if (revision <= (cursor.revisions.get(m.shard) ?? 0)) continue; // delivered before a reopen
        cursor.revisions.set(m.shard, revision);
        const change: RunChange = {
          revision, kind: m.kind === ChangeKind.DELETE ? "delete" : "put", runId: m.runId, shard: m.shard,
        };
        if (m.record) change.record = recordFromPb(m.record);
        yield change;
        continue;
      }
      live.delete(o);
      o.ac.abort();
      if (signal?.aborted || host.closed()) return;
      if (item.err !== undefined && !reopens(item.err)) throw fromCallError(item.err);
      const failures = o.started ? 0 : o.failures + 1;
      due.push({ shards: o.shards, failures, at: performance.now() + reopenDelay(o.started ? 0 : o.failures) });
    }
  } finally {
    signal?.removeEventListener("abort", stopAll);
    stopAll();
    inbox.close();
  }
}
