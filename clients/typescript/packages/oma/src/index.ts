export { FencepostRunStore, EPOCH_SPAN, decodeToken, encodeToken, epochAbove, fromServerRecord, toServerRecord } from "./store.js";
export type { ConnectOptions, FenceMovedEvent } from "./store.js";
export { RunStoreError, RUN_STORE_ERROR_CODES, canTransitionRun, isTerminalRunStatus } from "./types.js";
export type { RunLifecycleStatus, RunRecord, RunStatusCode, RunStore, RunStoreErrorCode } from "./types.js";
export { CHECKPOINT_KEY_PREFIX, FencepostMemoryStore, INLINE_VALUE_BYTES, RUN_KEY_PREFIX } from "./memory.js";
export type { MemoryEntry, MemoryStore, MemoryStoreOptions } from "./memory.js";
export { FencepostRunJournal, INLINE_APPEND_BYTES, MAX_APPEND_EVENTS, MAX_JOURNAL_EVENTS, RunJournalError } from "./journal.js";
export type { RunEvent, RunJournal, RunJournalErrorCode, RunJournalOptions, RunJournalRef } from "./journal.js";
