// FencepostRunJournal: open-multi-agent's RunJournal over fencepost's
// engine store, durable and ordered across processes.
//
// Layout, per journal name:
//   head   engine-store run record "oma-journal/<name>", status "seq:<last>",
//          output { events: <count>, appends: <count> }
//   steps  one engine-store step per append under run id "oma-journal/<name>":
//          output { events: [...] } inline, or { blob, bytes } naming an
//          artifact holding the events' JSON when they are over INLINE_APPEND_BYTES;
//          metadata { first, last } (the seqs it holds)
// An append is one Ledger.Transact: UpdateRun of the head guarded by the
// status it read ("seq:<last>") plus AppendStep. The server applies both in
// one step of its single writer, or neither, so an append is atomic, two
// appends never interleave, and one whose head moved meanwhile is retried
// against the new head.
import { randomUUID } from "node:crypto";
import { FencepostClient, InvalidRunStateError, type EngineRun } from "@fencepost/client";
import type { ConnectOptions } from "./store.js";

/** One journal event as open-multi-agent emits it: `seq` is what the journal orders by. */
export interface RunEvent {
  readonly seq: number;
  readonly [field: string]: unknown;
}

/** The pointer a checkpoint records as its `journalRef`. */
export interface RunJournalRef {
  readonly kind: string;
  readonly path?: string;
}

/** open-multi-agent's RunJournal seam. */
export interface RunJournal {
  append(events: readonly RunEvent[]): Promise<void>;
  readFrom(seq: number): Promise<RunEvent[]>;
  close(): Promise<void>;
  describe?(): RunJournalRef;
}

/** The most events one journal holds; an append that would go past it is refused whole. */
export const MAX_JOURNAL_EVENTS = 100_000;
/** The most events one append may carry. */
export const MAX_APPEND_EVENTS = 10_000;
/** An append's events up to this many UTF-8 bytes of JSON travel inline; larger ones as an artifact. */
export const INLINE_APPEND_BYTES = 256 * 1024;
const MAX_ATTEMPTS = 200;
const enc = new TextEncoder();

export type RunJournalErrorCode = "JOURNAL_FULL" | "JOURNAL_SEQ_CONFLICT" | "JOURNAL_VALIDATION_ERROR" | "JOURNAL_CLOSED";

/** An append or read the journal refused; nothing was written. */
export class RunJournalError extends Error {
  readonly code: RunJournalErrorCode;
  /** For JOURNAL_VALIDATION_ERROR: the input at fault (`events[3].seq`). */
  readonly field: string | undefined;
  constructor(code: RunJournalErrorCode, message: string, field?: string) {
    super(message);
    this.name = "RunJournalError";
    this.code = code;
    this.field = field;
  }
}

export interface RunJournalOptions extends ConnectOptions {
  /** The most events this journal holds (default and maximum MAX_JOURNAL_EVENTS). */
  maxEvents?: number;
}

export class FencepostRunJournal implements RunJournal {
  readonly client: FencepostClient;
  /** The journal's name: one journal per name on a server (a run id, say). */
  readonly name: string;
  readonly maxEvents: number;
  private readonly id: string;
  private readonly ownsClient: boolean;
  private closed = false;

  private constructor(client: FencepostClient, name: string, maxEvents: number, ownsClient: boolean) {
    this.client = client;
    this.name = name;
    this.id = `oma-journal/${name}`;
    this.maxEvents = maxEvents;
    this.ownsClient = ownsClient;
  }

  /** Open journal `name` with the same options as FencepostClient (passed on unchanged), plus `maxEvents` and `client`. */
  static async connect(address: string | readonly string[], name: string, options: RunJournalOptions = {}): Promise<FencepostRunJournal> {
    const { client: given, maxEvents = MAX_JOURNAL_EVENTS, ...clientOptions } = options;
    if (typeof name !== "string" || name.length === 0 || enc.encode(name).byteLength > 480 || /[\u0000-\u001f\u007f]/.test(name)) {
      throw new RunJournalError("JOURNAL_VALIDATION_ERROR", "name: must be 1-480 bytes without control characters", "name");
    }
    if (!Number.isInteger(maxEvents) || maxEvents < 1 || maxEvents > MAX_JOURNAL_EVENTS) {
      throw new RunJournalError("JOURNAL_VALIDATION_ERROR", `maxEvents: must be an integer in 1 - ${MAX_JOURNAL_EVENTS}`, "maxEvents");
    }
    const client = given ?? new FencepostClient(address, clientOptions);
    const journal = new FencepostRunJournal(client, name, maxEvents, given === undefined);
    try {
      await journal.head();
    } catch (e) {
      if (given === undefined) await client.close();
      throw e;
    }
    return journal;
  }

  /**
   * Append `events` in order, all or none. Their seqs must be integers that
   * strictly increase and start above lastSeq(); otherwise JOURNAL_SEQ_CONFLICT
   * (an attempt that lost the run, or a second writer). Past maxEvents:
   * JOURNAL_FULL. Either way nothing is written.
   */
  async append(events: readonly RunEvent[]): Promise<void> {
    this.open();
    if (!Array.isArray(events)) throw new RunJournalError("JOURNAL_VALIDATION_ERROR", "events: must be an array", "events");
    if (events.length === 0) return;
    if (events.length > MAX_APPEND_EVENTS) {
      throw new RunJournalError("JOURNAL_VALIDATION_ERROR", `events: one append holds at most ${MAX_APPEND_EVENTS} events, got ${events.length}`, "events");
    }
    let prev = 0;
    events.forEach((e, i) => {
      const seq = (e as { seq?: unknown } | null)?.seq;
      if (typeof seq !== "number" || !Number.isSafeInteger(seq) || seq < 1) {
        throw new RunJournalError("JOURNAL_VALIDATION_ERROR", `events[${i}].seq: must be a positive integer`, `events[${i}].seq`);
      }
      if (seq <= prev) throw new RunJournalError("JOURNAL_SEQ_CONFLICT", `events[${i}].seq: ${seq} does not follow ${prev}`, `events[${i}].seq`);
      prev = seq;
    });
    let text: string;
    try {
      text = JSON.stringify(events);
    } catch (e) {
      throw new RunJournalError("JOURNAL_VALIDATION_ERROR", `events: must be JSON: ${String(e)}`, "events");
    }
    const first = events[0]!.seq;
    const last = prev;
    let output: unknown;
    for (let attempt = 0; attempt < MAX_ATTEMPTS; attempt++) {
      const head = await this.head();
      const { lastSeq, count, appends } = state(head);
      if (first <= lastSeq) {
        throw new RunJournalError("JOURNAL_SEQ_CONFLICT", `events[0].seq: ${first} is not above the journal's last seq ${lastSeq}; nothing was written`, "events[0].seq");
      }
      if (count + events.length > this.maxEvents) {
        throw new RunJournalError("JOURNAL_FULL",
          `journal ${this.name} holds ${count} of at most ${this.maxEvents} events; ${events.length} more do not fit; nothing was written`);
      }
      output ??= await this.outputFor(text);
      try {
        await this.client.store.transaction((tx) => {
          tx.updateRun(this.id, { status: `seq:${last}`, output: { events: count + events.length, appends: appends + 1 } }, { expectStatus: [head.status] });
          tx.appendStep({ runId: this.id, name: "append", output, metadata: { first, last } });
        });
        return;
      } catch (e) {
        if (!(e instanceof InvalidRunStateError)) throw e;
      }
      await backoff(attempt);
    }
    throw new InvalidRunStateError(`journal ${this.name}: ${MAX_ATTEMPTS} append attempts each lost to another appender`);
  }

  /** Every event with `seq >= seq`, in order. */
  async readFrom(seq: number): Promise<RunEvent[]> {
    this.open();
    if (typeof seq !== "number" || Number.isNaN(seq)) throw new RunJournalError("JOURNAL_VALIDATION_ERROR", "seq: must be a number", "seq");
    const out: RunEvent[] = [];
    for (const step of await this.client.store.listSteps(this.id)) {
      const range = step.metadata as { first: number; last: number };
      if (range.last < seq) continue;
      const o = step.output as { events?: RunEvent[]; blob?: string };
      const events = o.blob !== undefined
        ? (JSON.parse(new TextDecoder().decode(await this.client.store.readArtifact(o.blob))) as RunEvent[])
        : o.events!;
      for (const e of events) if (e.seq >= seq) out.push(e);
    }
    return out;
  }

  /** The highest seq appended (0 for an empty journal): one read, without reading the events. */
  async lastSeq(): Promise<number> {
    this.open();
    return state(await this.head()).lastSeq;
  }

  /** How many events the journal holds. */
  async size(): Promise<number> {
    this.open();
    return state(await this.head()).count;
  }

  describe(): RunJournalRef {
    return { kind: "FencepostRunJournal", path: this.id };
  }

  /** Further calls throw JOURNAL_CLOSED; the connection closes when this journal opened it. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    if (this.ownsClient) await this.client.close();
  }

  private open(): void {
    if (this.closed) throw new RunJournalError("JOURNAL_CLOSED", `journal ${this.name} is closed`);
  }

  /** The head record, created (insert-if-absent) on first use. */
  private async head(): Promise<EngineRun> {
    const cur = await this.client.store.getRun(this.id);
    if (cur) return cur;
    const r = await this.client.store.createRun({ id: this.id, agent: "oma-journal", status: "seq:0", output: { events: 0, appends: 0 } });
    return r.run;
  }

  private async outputFor(text: string): Promise<unknown> {
    const bytes = enc.encode(text);
    if (bytes.byteLength <= INLINE_APPEND_BYTES) return { events: JSON.parse(text) as unknown };
    const blob = `oma-journal-blob/${randomUUID()}`;
    await this.client.store.putArtifact({ id: blob, runId: this.id, contentType: "application/json" }, bytes);
    return { blob, bytes: bytes.byteLength };
  }
}

function state(head: EngineRun): { lastSeq: number; count: number; appends: number } {
  const o = head.output as { events: number; appends: number };
  return { lastSeq: Number(head.status.slice(4)), count: o.events, appends: o.appends };
}

/** A short jittered pause after losing a race, so that writers of one key do not retry in lockstep. */
function backoff(attempt: number): Promise<void> {
  return new Promise((r) => setTimeout(r, Math.random() * Math.min(50, 2 ** attempt)));
}
