// Several coordinators, one leader: which endpoint a call goes to, and how
// the client follows the leader (docs/TYPESCRIPT.md, as the Python SDK does).
//
// Standbys refuse every call at its start with UNAVAILABLE and reason
// NOT_LEADER, naming the leader's advertised address ("" during a takeover).
// Every call and stream goes to the endpoint believed to lead: the first one
// given until a failure says otherwise.
// - NOT_LEADER naming a leader: a unary call is sent there at once (the
//   standby did nothing with it); a stream's owner reopens it there.
// - NOT_LEADER naming none, no connection within CONNECT_WAIT_MS, a dropped
//   connection (a dead peer, or unanswered keepalive pings: a frozen one), a
//   deadline passed: the next endpoint, the caller's retry policy backing off.
// A mutation keeps one request id for all its attempts, so following the
// leader neither loses nor doubles a command.
import { isIP } from "node:net";
import type { DescMessage, DescMethodStreaming, DescMethodUnary, MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type ContextValues, type Interceptor, type StreamResponse, type Transport, type UnaryResponse } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import { fromCallError, NotLeaderError, NotOwnerError, OutcomeUnknownError, UnavailableError, type FencepostError } from "./errors.js";
import type { RetryContext } from "./retry.js";

type HeaderInit = Parameters<Transport["unary"]>[3];

/** With several endpoints, how long a call waits for a connection before it tries the next. */
export const CONNECT_WAIT_MS = 2000;

/** PEM text or bytes. */
export type Pem = string | Buffer | Uint8Array;

export interface TlsOptions {
  /** The CA that signed the server's certificate (default: Node's root CAs). */
  ca?: Pem;
  /** This client's certificate chain, for a server that requires mutual TLS (goes with `key`). */
  cert?: Pem;
  /** This client's private key. */
  key?: Pem;
  /** The name to verify the server's certificate against, when it differs from the address's host. */
  serverName?: string;
}

export interface KeepalivePingOptions {
  /** Ping every this many ms while calls or streams are open (default 2000). */
  intervalMs?: number;
  /** Drop the connection when a ping is unanswered this long (default 2000). */
  timeoutMs?: number;
}

/** How connections are made: the part of ClientOptions every store passes through. */
export interface ConnectionOptions {
  /** Connect over TLS (mutual TLS with `cert` and `key`). */
  tls?: TlsOptions;
  /** A bearer token sent with every call: only over TLS, or in plaintext to a loopback address. */
  token?: string;
  /** HTTP/2 keepalive pings, so calls behind a frozen coordinator fail over; false: none. */
  keepalive?: KeepalivePingOptions | false;
  /** Connect interceptors for every call (after the token's). */
  interceptors?: Interceptor[];
}

/** `"a"`, `"a,b"` or `["a", "b"]`: the addresses in order, each once. Throws TypeError naming `field`. */
export function parseEndpoints(value: string | readonly string[], field = "address"): string[] {
  let items: readonly string[];
  if (typeof value === "string") items = [value];
  else if (Array.isArray(value) && value.every((v) => typeof v === "string")) items = value;
  else throw new TypeError(`${field}: an address string or an array of them (got ${String(value)})`);
  const out: string[] = [];
  for (const item of items) {
    for (const part of item.split(",")) {
      const address = part.trim();
      if (!address || /\s/.test(address)) throw new TypeError(`${field}: an empty or malformed endpoint in ${JSON.stringify(value)}`);
      if (!out.includes(address)) out.push(address);
    }
  }
  if (!out.length) throw new TypeError(`${field}: no endpoint given`);
  return out;
}

/** Whether `host:port` (or a URL, or a bare host) names this machine only. */
export function isLoopback(address: string): boolean {
  let host = address.replace(/^[a-z]+:\/\//, "").replace(/\/.*$/, "");
  const m = /^\[(.*)\](:\d+)?$/.exec(host);
  if (m) host = m[1]!;
  else if (host.split(":").length === 2) host = host.split(":")[0]!;
  if (host === "localhost") return true;
  if (isIP(host) === 4) return host.startsWith("127.");
  return host === "::1";
}

/** Refuses option combinations that cannot work (TypeError naming the option). */
export function checkConnection(address: string, options: ConnectionOptions): void {
  const { tls, token } = options;
  if (tls && (tls.cert === undefined) !== (tls.key === undefined)) throw new TypeError("tls: cert and key go together");
  if (options.keepalive) {
    for (const f of ["intervalMs", "timeoutMs"] as const) {
      const v = options.keepalive[f];
      if (v !== undefined && !(Number.isSafeInteger(v) && v > 0)) throw new TypeError(`keepalive.${f}: must be a positive integer (got ${String(v)})`);
    }
  }
  if (token !== undefined) {
    if (typeof token !== "string" || !token.trim()) throw new TypeError("token: must not be empty");
    if (!tls && !isLoopback(address)) {
      throw new TypeError(`token: a bearer token is sent only over TLS or to a loopback address, not in plaintext to ${address}: pass tls`);
    }
  }
}

const asBuffer = (p: Pem | undefined) => (p === undefined ? undefined : typeof p === "string" || Buffer.isBuffer(p) ? p : Buffer.from(p as Uint8Array));

class Endpoint {
  answers = false;
  /** How its last call failed, for the error a caller gets when every endpoint failed. */
  lastFailure = "";
  readonly transport: Transport;
  constructor(readonly address: string, readonly manager: Http2SessionManager | undefined, transport: Transport) {
    this.transport = transport;
  }
}

function openEndpoint(address: string, options: ConnectionOptions): Endpoint {
  checkConnection(address, options);
  const tls = options.tls;
  const baseUrl = address.includes("://") ? address : `${tls ? "https" : "http"}://${address}`;
  const ping = options.keepalive === false ? {} : {
    pingIntervalMs: options.keepalive?.intervalMs ?? 2000,
    pingTimeoutMs: options.keepalive?.timeoutMs ?? 2000,
  };
  const nodeOptions = tls ? {
    ...(tls.ca !== undefined ? { ca: asBuffer(tls.ca) } : {}),
    ...(tls.cert !== undefined ? { cert: asBuffer(tls.cert), key: asBuffer(tls.key) } : {}),
    ...(tls.serverName ? { servername: tls.serverName } : {}),
  } : {};
  const manager = new Http2SessionManager(baseUrl, ping, nodeOptions);
  const interceptors: Interceptor[] = [];
  if (options.token !== undefined) {
    const value = `Bearer ${options.token.trim()}`;
    interceptors.push((next) => (req) => { req.header.set("authorization", value); return next(req); });
  }
  interceptors.push(...(options.interceptors ?? []));
  const transport = createGrpcTransport({ baseUrl, sessionManager: manager, interceptors });
  return new Endpoint(address, manager, transport);
}

/** Whether a failure says its endpoint is not (or no longer) the one to send to. */
function movesOn(err: FencepostError): boolean {
  if (err instanceof NotLeaderError) return true;
  // a coordinator that leads other shards answers: it is the right one for those
  if (!(err instanceof UnavailableError) || err instanceof OutcomeUnknownError || err instanceof NotOwnerError) return false;
  return err.grpcCode === Code.Unavailable || err.grpcCode === Code.DeadlineExceeded;
}

/** No connection to an endpoint: nothing of the call was sent. */
export class Unreachable extends ConnectError {}

const unreachable = (address: string, why: string) =>
  new Unreachable(`${address}: no connection (${why})`, Code.Unavailable);

/** Whether a failed attempt certainly did nothing: a standby's refusal, or no connection at all. */
export function notSent(err: FencepostError): boolean {
  if (err instanceof NotLeaderError || err instanceof NotOwnerError || err.cause instanceof Unreachable) return true;
  if (!(err.cause instanceof ConnectError)) return false;
  // an Execute stream's command failed with its stream: refused by a standby, or never connected
  return (err.cause.cause as { code?: unknown } | undefined)?.code === "ECONNREFUSED" || fromCallError(err.cause) instanceof NotLeaderError;
}

/**
 * A Connect Transport over every endpoint of a client: each call goes to the
 * endpoint believed to lead, and its failures move that belief.
 */
export class Endpoints implements Transport, RetryContext {
  private readonly all: Endpoint[];
  private current: Endpoint;
  private leaderHint = "";
  readonly listed: readonly string[];

  constructor(addresses: readonly string[], private readonly options: ConnectionOptions, fixed?: Transport) {
    this.listed = [...addresses];
    this.all = fixed ? [new Endpoint(addresses[0] ?? "", undefined, fixed)] : addresses.map((a) => openEndpoint(a, options));
    this.current = this.all[0]!;
  }

  /** Where the next call goes. */
  get address(): string { return this.current.address; }

  /** Every endpoint: those given, then leaders learned from standbys. */
  get addresses(): string[] { return this.all.map((e) => e.address); }

  notSent(err: FencepostError): boolean { return notSent(err); }

  /** With several endpoints: each one's last failure and the last leader a standby named. */
  describe(): string {
    if (this.all.length < 2 && !this.leaderHint) return "";
    const tried = this.all.map((e) => `${e.address}: ${e.lastFailure || "not tried"}`).join("; ");
    return ` [endpoints: ${tried}; last leader hint: ${this.leaderHint || "none"}]`;
  }

  close(): void {
    for (const e of this.all) e.manager?.abort();
  }

  /** With several endpoints: wait (at most CONNECT_WAIT_MS) until `e` is connected, or throw UNAVAILABLE. */
  private async reachable(e: Endpoint, signal: AbortSignal | undefined): Promise<void> {
    if (this.all.length < 2 || !e.manager) return;
    const state = e.manager.state();
    if (state === "open" || state === "idle") return;
    let timer: NodeJS.Timeout | undefined;
    const outcome = await Promise.race([
      e.manager.connect(),
      new Promise<"timeout">((r) => { timer = setTimeout(() => r("timeout"), CONNECT_WAIT_MS); }),
    ]).finally(() => clearTimeout(timer));
    if (signal?.aborted) throw ConnectError.from(signal.reason, Code.Canceled);
    if (outcome === "timeout") {
      e.manager.abort(new Error("no connection in time"));
      throw unreachable(e.address, "timed out");
    }
    if (outcome === "error") throw unreachable(e.address, String(e.manager.error() ?? "connection failed"));
  }

  private answered(e: Endpoint): void { e.answers = true; }

  /**
   * A connection that broke under a call surfaces from Node as an aborted,
   * cancelled or reset stream: unless the caller aborted, it is UNAVAILABLE
   * (retried, and the next attempt may go elsewhere). Cut before any answer
   * it gets a hint: a plaintext client at a TLS port, or a refused handshake.
   */
  private explain(err: unknown, signal: AbortSignal | undefined): unknown {
    const ce = ConnectError.from(err);
    if (signal?.aborted) return err;
    const fromNode = typeof (ce.cause as { code?: unknown } | undefined)?.code === "string" || /^http\/2 stream closed/.test(ce.rawMessage);
    if (ce.code === Code.Canceled) {
      const hint = this.options.tls
        ? "the server may have refused the TLS handshake: check tls.ca, cert and key"
        : "the server may require TLS: pass the tls option";
      return new ConnectError(`${ce.rawMessage} (${hint})`, Code.Unavailable, undefined, undefined, err);
    }
    if (fromNode && (ce.code === Code.Aborted || ce.code === Code.Internal || ce.code === Code.Unknown)) {
      return new ConnectError(`the connection broke: ${ce.rawMessage}`, Code.Unavailable, undefined, undefined, err);
    }
    return err;
  }

  /** Move on from `e` when `cause` says so; true when a standby named a leader, now the current endpoint. */
  private afterFailure(e: Endpoint, cause: unknown): boolean {
    const err = fromCallError(cause);
    if (!movesOn(err)) return false;
    e.answers = false;
    e.lastFailure = err instanceof NotLeaderError ? "a standby" : err.message;
    if (err instanceof NotLeaderError) this.leaderHint = err.leader;
    if (err instanceof NotLeaderError && err.leader && err.leader !== e.address) {
      const target = this.find(err.leader);
      if (target) {
        this.current = target;
        return true;
      }
    }
    if (e === this.current && this.all.length > 1) {
      this.current = this.all[(this.all.indexOf(e) + 1) % this.all.length]!;
    }
    return false;
  }

  private find(address: string): Endpoint | undefined {
    const known = this.all.find((e) => e.address === address);
    if (known || !this.all[0]?.manager) return known;
    try {
      const e = openEndpoint(address, this.options);
      this.all.push(e);
      return e;
    } catch (why) {
      if (process.env["FENCEPOST_DEBUG"]) console.error(`not following the leader to ${address}:`, why);
      return undefined;
    }
  }

  async unary<I extends DescMessage, O extends DescMessage>(
    method: DescMethodUnary<I, O>, signal: AbortSignal | undefined, timeoutMs: number | undefined,
    header: HeaderInit, input: MessageInitShape<I>, contextValues?: ContextValues,
  ): Promise<UnaryResponse<I, O>> {
    // A standby refuses before doing anything: follow the leader it names at once, a few hops at most.
    for (let hop = 0; ; hop++) {
      const e = this.current;
      try {
        await this.reachable(e, signal);
        const r = await e.transport.unary(method, signal, timeoutMs, header, input, contextValues);
        this.answered(e);
        e.lastFailure = "";
        return r;
      } catch (thrown) {
        const err = this.explain(thrown, signal);
        if (!this.afterFailure(e, err) || hop >= this.all.length + 1) throw err;
      }
    }
  }

  async stream<I extends DescMessage, O extends DescMessage>(
    method: DescMethodStreaming<I, O>, signal: AbortSignal | undefined, timeoutMs: number | undefined,
    header: HeaderInit, input: AsyncIterable<MessageInitShape<I>>, contextValues?: ContextValues,
  ): Promise<StreamResponse<I, O>> {
    const e = this.current;
    let r: StreamResponse<I, O>;
    try {
      await this.reachable(e, signal);
      r = await e.transport.stream(method, signal, timeoutMs, header, input, contextValues);
    } catch (thrown) {
      const err = this.explain(thrown, signal);
      this.afterFailure(e, err);
      throw err;
    }
    const messages = r.message;
    const self = this;
    async function* watched(): AsyncGenerator<unknown> {
      try {
        for await (const m of messages) {
          self.answered(e);
          yield m;
        }
      } catch (thrown) {
        const err = self.explain(thrown, signal);
        self.afterFailure(e, err);
        throw err;
      }
    }
    return { ...r, message: watched() } as StreamResponse<I, O>;
  }
}
