// Retries: only UNAVAILABLE is retried, with jittered exponential backoff,
// bounded in total time. A mutation carries one request id for all its
// attempts, so a retry after a lost answer gets the original answer instead
// of applying the command twice.
import { v7 as uuidv7 } from "uuid";
import { fromCallError, isRetryable, OutcomeUnknownError, ShuttingDownError, type FencepostError } from "./errors.js";

export interface RetryPolicy {
  /** First backoff, ms (default 50). */
  initialBackoffMs?: number;
  /** Largest backoff, ms (default 1000). */
  maxBackoffMs?: number;
  /** Backoff growth per attempt (default 2). */
  multiplier?: number;
  /** Random share taken off or added to each backoff, 0 - 1 (default 0.2). */
  jitter?: number;
  /** No new attempt starts after this many ms (default 10 000). */
  totalTimeoutMs?: number;
  /** Each attempt's deadline, ms (default 10 000; 0: none). */
  attemptTimeoutMs?: number;
  /** At most this many attempts (default: unbounded within totalTimeoutMs). */
  maxAttempts?: number;
}

export type FullRetryPolicy = Required<RetryPolicy>;

export function retryPolicy(p: RetryPolicy = {}): FullRetryPolicy {
  const full: FullRetryPolicy = {
    initialBackoffMs: p.initialBackoffMs ?? 50,
    maxBackoffMs: p.maxBackoffMs ?? 1000,
    multiplier: p.multiplier ?? 2,
    jitter: p.jitter ?? 0.2,
    totalTimeoutMs: p.totalTimeoutMs ?? 10_000,
    attemptTimeoutMs: p.attemptTimeoutMs ?? 10_000,
    maxAttempts: p.maxAttempts ?? Number.POSITIVE_INFINITY,
  };
  if (!(full.initialBackoffMs > 0 && full.maxBackoffMs >= full.initialBackoffMs)) {
    throw new RangeError("retry: need 0 < initialBackoffMs <= maxBackoffMs");
  }
  if (full.multiplier < 1) throw new RangeError("retry.multiplier: must be >= 1");
  if (!(full.jitter >= 0 && full.jitter < 1)) throw new RangeError("retry.jitter: must be in [0, 1)");
  if (full.totalTimeoutMs < 0) throw new RangeError("retry.totalTimeoutMs: must be >= 0");
  if (full.attemptTimeoutMs < 0) throw new RangeError("retry.attemptTimeoutMs: must be >= 0");
  if (full.maxAttempts < 1) throw new RangeError("retry.maxAttempts: must be >= 1");
  return full;
}

/** A fresh request id: a UUIDv7 (time-ordered, as the server prefers). */
export function newRequestId(): string {
  return uuidv7();
}

export function backoffDelays(p: FullRetryPolicy): () => number {
  let next = p.initialBackoffMs;
  return () => {
    const d = next * (1 + p.jitter * (2 * Math.random() - 1));
    next = Math.min(p.maxBackoffMs, next * p.multiplier);
    return d;
  };
}

export const sleep = (ms: number, signal?: AbortSignal) =>
  new Promise<void>((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const t = setTimeout(() => { signal?.removeEventListener("abort", onAbort); resolve(); }, ms);
    const onAbort = () => { clearTimeout(t); reject(signal?.reason); };
    signal?.addEventListener("abort", onAbort, { once: true });
  });

/** Every call takes these. */
export interface CallOptions {
  /** Aborts the call (and its retries) with the signal's reason; a mutation already sent may still be applied. */
  signal?: AbortSignal;
  /** The call's whole time, retries included, ms (default: the retry policy's totalTimeoutMs). */
  timeoutMs?: number;
}

/** How a client's retries see its endpoints (several coordinators). */
export interface RetryContext {
  /** Whether a failed attempt certainly did nothing (refused by a standby, never connected). */
  notSent(err: FencepostError): boolean;
  /** Appended to the final error's message: the endpoints tried and how they failed. */
  describe(): string;
}

/** Per-attempt call options for a generated stub: the attempt's deadline and the caller's signal. */
export interface AttemptOptions {
  timeoutMs: number | undefined;
  signal?: AbortSignal;
}

/**
 * Run `attempt` until it succeeds, fails with a non-retryable error, the
 * policy runs out, or `limits` end it (an aborted signal throws its reason;
 * `timeoutMs` bounds every attempt and the retries). `mutation`: a final
 * UNAVAILABLE means the outcome is unknown (OutcomeUnknownError), unless the
 * server said it did nothing (SHUTTING_DOWN).
 */
export async function withRetry<T>(
  policy: FullRetryPolicy,
  mutation: boolean,
  attempt: (opts: AttemptOptions) => Promise<T>,
  limits: CallOptions = {},
  context?: RetryContext,
): Promise<T> {
  let maybeApplied = false;
  const started = performance.now();
  const delay = backoffDelays(policy);
  const signal = limits.signal;
  if (limits.timeoutMs !== undefined && !(limits.timeoutMs > 0)) throw new RangeError("timeoutMs: must be > 0");
  const total = Math.min(policy.totalTimeoutMs, limits.timeoutMs ?? Number.POSITIVE_INFINITY);
  for (let n = 1; ; n++) {
    if (signal?.aborted) throw signal.reason;
    let err: FencepostError;
    let deadline: number | undefined = policy.attemptTimeoutMs || undefined;
    if (limits.timeoutMs !== undefined) {
      const left = Math.max(1, Math.ceil(limits.timeoutMs - (performance.now() - started)));
      deadline = deadline === undefined ? left : Math.min(deadline, left);
    }
    try {
      return await attempt(signal ? { timeoutMs: deadline, signal } : { timeoutMs: deadline });
    } catch (e) {
      if (signal?.aborted) throw signal.reason;
      err = fromCallError(e);
    }
    if (!isRetryable(err)) throw err;
    if (!(err instanceof ShuttingDownError) && !context?.notSent(err)) maybeApplied = true;
    const wait = delay();
    if (n >= policy.maxAttempts || performance.now() - started + wait > total) {
      const where = context?.describe() ?? "";
      if (mutation && maybeApplied) {
        throw new OutcomeUnknownError(`no answer after ${n} attempt(s): ${err.message}${where}`, {
          cause: err, ...(err.grpcCode !== undefined ? { grpcCode: err.grpcCode } : {}),
        });
      }
      if (where) (err as { message: string }).message += where;
      throw err;
    }
    await sleep(wait, signal);
  }
}
