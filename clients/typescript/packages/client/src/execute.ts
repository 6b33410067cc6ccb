// Mutations multiplexed on one Ledger.Execute stream (docs/STREAMS.md): the
// commands issued in one event-loop turn travel in one message, each with a
// client-chosen id echoed on its result. A command's failure is its
// result's google.rpc.Status, mapped to the same typed error a unary call
// would end with. While the stream is down, commands go as unary calls;
// a command whose stream dropped before it was answered fails as
// UNAVAILABLE, so the caller's retry repeats it with the same request id.
import { create } from "@bufbuild/protobuf";
import { Code, type Client } from "@connectrpc/connect";
import { CommandSchema, ExecuteRequestSchema, type Command, type ExecuteRequest, type ExecuteResponse, type Ledger } from "./gen/fencepost/v1/ledger_pb.js";
import type { EngineStore } from "./gen/fencepost/v1/engine_store_pb.js";
import { UnavailableError, fromStatus } from "./errors.js";
import { AsyncQueue } from "./queue.js";

/** The Command kinds (each the unary RPC of the same name, on Ledger or EngineStore). */
export const LEDGER_COMMANDS = ["acquire", "renew", "recordCheckpoint", "suspend", "finish", "release", "cancel", "requestResume", "deleteRun"] as const;
export const ENGINE_COMMANDS = ["createRun", "updateRun", "claimRun", "renewClaim", "appendStep", "saveCheckpoint", "claimKey", "acquireLock", "releaseLock", "putEffect", "kvSet", "docUpsert", "docDelete"] as const;
/** The kinds a transaction may hold: every kind but `transaction` itself. */
export type WriteKind = (typeof LEDGER_COMMANDS)[number] | (typeof ENGINE_COMMANDS)[number];
/** `transaction` is Ledger.Transact: several commands, all or nothing (docs/FENCING.md). */
export type CommandKind = WriteKind | "transaction";

export type Transport = "stream" | "unary";

type CallOpts = { timeoutMs: number | undefined; signal?: AbortSignal };
type AnyUnary = (req: unknown, opts: CallOpts) => Promise<unknown>;

interface Pending {
  resolve(v: unknown): void;
  reject(e: unknown): void;
  timer: NodeJS.Timeout | undefined;
}

export class CommandChannel {
  private nextId = 1n;
  private pending = new Map<bigint, Pending>();
  private batch: Command[] = [];
  private queue: AsyncQueue<ExecuteRequest> | undefined;
  /** The ids of the commands given to the open stream. */
  private queued: Set<bigint> | undefined;
  private abort = new AbortController();
  private downUntil = 0;
  private closed = false;
  /** How many times the Execute stream was opened. */
  connects = 0;
  /** How many commands were sent on it. */
  commandsSent = 0;

  constructor(
    private readonly ledger: Client<typeof Ledger>,
    private readonly engine: Client<typeof EngineStore>,
    readonly transport: Transport,
  ) {}

  /** Run one command (a unary request message as an init object) and return the unary RPC's response. */
  run<T>(kind: CommandKind, request: Record<string, unknown>, opts: CallOpts): Promise<T> {
    if (this.transport === "unary" || this.closed || performance.now() < this.downUntil) return this.unary<T>(kind, request, opts);
    return new Promise<T>((resolve, reject) => {
      const id = this.nextId++;
      const p: Pending = { resolve: resolve as (v: unknown) => void, reject, timer: undefined };
      const signal = opts.signal;
      if (signal) {
        // the caller gave up: its command may still be applied (its retry would say)
        const onAbort = () => { if (this.pending.delete(id)) { if (p.timer) clearTimeout(p.timer); reject(signal.reason); } };
        signal.addEventListener("abort", onAbort, { once: true });
        const settle = p.resolve, fail = p.reject;
        p.resolve = (v) => { signal.removeEventListener("abort", onAbort); settle(v); };
        p.reject = (e) => { signal.removeEventListener("abort", onAbort); fail(e); };
      }
      if (opts.timeoutMs) {
        p.timer = setTimeout(() => {
          if (this.pending.delete(id)) reject(new UnavailableError(`no answer within ${opts.timeoutMs} ms`, { grpcCode: Code.DeadlineExceeded }, "DEADLINE_EXCEEDED"));
        }, opts.timeoutMs);
        p.timer.unref();
      }
      this.pending.set(id, p);
      this.batch.push(create(CommandSchema, { id, kind: { case: kind, value: request } as never }));
      if (this.batch.length === 1) queueMicrotask(() => this.flush());
    });
  }

  async close(): Promise<void> {
    this.closed = true;
    this.queue?.close(); // half-close: the server answers what it accepted, then ends
    const deadline = Date.now() + 2000;
    while (this.pending.size && Date.now() < deadline) await new Promise((r) => setTimeout(r, 10));
    this.abort.abort();
  }

  private unary<T>(kind: CommandKind, request: Record<string, unknown>, opts: CallOpts): Promise<T> {
    if (kind === "transaction") return this.ledger.transact(request, opts) as Promise<T>;
    const stub = ((LEDGER_COMMANDS as readonly string[]).includes(kind) ? this.ledger : this.engine) as unknown as Record<string, AnyUnary>;
    return stub[kind]!(request, opts) as Promise<T>;
  }

  private flush(): void {
    const commands = this.batch;
    this.batch = [];
    if (!commands.length) return;
    if (!this.queue) this.open();
    // counted as the stream's from now: one that fails before sending them must fail them too
    for (const c of commands) this.queued!.add(c.id);
    this.commandsSent += commands.length;
    this.queue!.push(create(ExecuteRequestSchema, { commands }));
  }

  private open(): void {
    const queue = new AsyncQueue<ExecuteRequest>();
    this.queue = queue;
    this.connects++;
    const mine = new Set<bigint>();
    this.queued = mine;
    void (async () => {
      let failure: unknown;
      try {
        for await (const resp of this.ledger.execute(this.track(queue, mine), { signal: this.abort.signal })) this.answer(resp, mine);
      } catch (e) {
        failure = e;
      }
      if (this.queue === queue) {
        this.queue = undefined;
        this.queued = undefined;
      }
      queue.close();
      // Unanswered commands of this stream have an unknown outcome: fail them as
      // UNAVAILABLE so their retries repeat them (same request ids).
      for (const id of mine) {
        const p = this.pending.get(id);
        if (!p) continue;
        this.pending.delete(id);
        if (p.timer) clearTimeout(p.timer);
        p.reject(new UnavailableError(`the command stream ended before the answer${failure ? `: ${String(failure)}` : ""}`, { grpcCode: Code.Unavailable, cause: failure }));
      }
      if (failure !== undefined && !this.closed) this.downUntil = performance.now() + 1000; // unary meanwhile
    })();
  }

  /** The request side, remembering which command ids went out on this stream. */
  private async *track(queue: AsyncQueue<ExecuteRequest>, mine: Set<bigint>): AsyncGenerator<ExecuteRequest> {
    for await (const req of queue) {
      for (const c of req.commands) mine.add(c.id);
      yield req;
    }
  }

  private answer(resp: ExecuteResponse, mine: Set<bigint>): void {
    for (const r of resp.results) {
      mine.delete(r.id);
      const p = this.pending.get(r.id);
      if (!p) continue;
      this.pending.delete(r.id);
      if (p.timer) clearTimeout(p.timer);
      if (r.kind.case === "error") p.reject(fromStatus(r.kind.value));
      else if (r.kind.case === undefined) p.reject(new UnavailableError("a command result with no answer", { grpcCode: Code.Internal }, "INTERNAL"));
      else p.resolve(r.kind.value);
    }
  }
}
