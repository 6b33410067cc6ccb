// The connections of one process's clients that use the same endpoints with
// the same credentials are shared (as the Python SDK shares its Execute
// stream): one HTTP/2 connection per coordinator, one view of which one
// leads, and one Execute stream, so the commands of many clients (a fleet of
// owners in one process) travel in the same messages. Each command names its
// own owner, and the server authorizes each for the connection's identity.
import { createHash } from "node:crypto";
import { createClient } from "@connectrpc/connect";
import { EngineStore } from "./gen/fencepost/v1/engine_store_pb.js";
import { Ledger } from "./gen/fencepost/v1/ledger_pb.js";
import { Endpoints, type ConnectionOptions, type Pem } from "./endpoints.js";
import { CommandChannel } from "./execute.js";

/** What clients of one process may share. */
export interface SharedConnection {
  readonly key: string;
  readonly endpoints: Endpoints;
  /** The Execute stream, opened on first use. */
  channel(): CommandChannel;
}

interface Entry extends SharedConnection {
  users: number;
  stream: CommandChannel | undefined;
}

const shared = new Map<string, Entry>();

const digest = (p: Pem | undefined) =>
  (p === undefined ? "" : createHash("sha256").update(typeof p === "string" ? p : new Uint8Array(p)).digest("hex"));

/** What makes two clients' connections interchangeable, or undefined when they cannot share (interceptors). */
export function shareKey(addresses: readonly string[], options: ConnectionOptions): string | undefined {
  if (options.interceptors?.length) return undefined;
  const tls = options.tls;
  return JSON.stringify([
    addresses, tls ? [digest(tls.ca), digest(tls.cert), digest(tls.key), tls.serverName ?? ""] : null,
    options.token ?? null, options.keepalive ?? null,
  ]);
}

/** The connections for `key` (opened on first use); give them back with `releaseShared`. */
export function acquireShared(key: string, addresses: readonly string[], options: ConnectionOptions): SharedConnection {
  let e = shared.get(key);
  if (!e) {
    const endpoints = new Endpoints(addresses, options);
    const entry: Entry = {
      key, endpoints, users: 0, stream: undefined,
      channel: () => (entry.stream ??= new CommandChannel(createClient(Ledger, endpoints), createClient(EngineStore, endpoints), "stream")),
    };
    e = entry;
    shared.set(key, e);
  }
  e.users++;
  return e;
}

/** One client is done; the last one closes the Execute stream and the connections. */
export async function releaseShared(key: string): Promise<void> {
  const e = shared.get(key);
  if (!e || --e.users > 0) return;
  shared.delete(key);
  await e.stream?.close();
  e.endpoints.close();
}
