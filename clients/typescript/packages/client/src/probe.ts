// probeServer: check that a fencepost server answers before a store built on
// the client hands itself out, and read its RunStore.Describe declaration.
import type { FencepostClient } from "./client.js";
import { OwnerNotPermittedError, PermissionDeniedError } from "./errors.js";
import { Atomicity } from "./gen/fencepost/v1/run_store_pb.js";
import type { CallOptions } from "./retry.js";

/** What a server declares about its writes (RunStore.Describe). */
export interface ServerDescription {
  /** "cross-process": every write is decided by the server's one writer, so it is atomic across processes. */
  readonly atomicity: "process" | "cross-process";
  /** The storage backend ("sqlite", ...); absent when the caller's role may not call Describe. */
  readonly backend?: string;
  /** The record schema the server holds; absent when the caller's role may not call Describe. */
  readonly schema?: number;
  /** False when the server refused Describe to this caller's role (it answered all the same). */
  readonly described: boolean;
}

export interface ProbeOptions extends CallOptions {
  /** Throw the PermissionDeniedError when Describe is refused, instead of answering the default (for raw-seam users, who need the admin role anyway). */
  requireDescribe?: boolean;
}

/**
 * Call RunStore.Describe once (with the client's retries). Describe is part of
 * the raw seam, which needs the admin role under `--authz`; a caller refused
 * for its role (PermissionDeniedError, not OwnerNotPermittedError) still
 * reached the server, and gets `{ atomicity: "cross-process", described: false }`:
 * every fencepost server decides writes in its one writer (docs/SPEC.md §7).
 * Anything else (unreachable, no credentials, a bad token) is thrown.
 */
export async function probeServer(client: FencepostClient, options: ProbeOptions = {}): Promise<ServerDescription> {
  const { requireDescribe = false, ...callOptions } = options;
  try {
    const d = await client.read((o) => client.stubs.runStore.describe({}, o), callOptions);
    return {
      atomicity: d.atomicity === Atomicity.CROSS_PROCESS ? "cross-process" : "process",
      backend: d.backend,
      schema: d.schema,
      described: true,
    };
  } catch (e) {
    if (requireDescribe || !(e instanceof PermissionDeniedError) || e instanceof OwnerNotPermittedError) throw e;
    return { atomicity: "cross-process", described: false };
  }
}
