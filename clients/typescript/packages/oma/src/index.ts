export { FencepostRunStore, EPOCH_SPAN, decodeToken, encodeToken, epochAbove, fromServerRecord, toServerRecord } from "./store.js";
export type { ConnectOptions, FenceMovedEvent } from "./store.js";
export { RunStoreError, RUN_STORE_ERROR_CODES, canTransitionRun, isTerminalRunStatus } from "./types.js";
export type { RunLifecycleStatus, RunRecord, RunStatusCode, RunStore, RunStoreErrorCode } from "./types.js";
