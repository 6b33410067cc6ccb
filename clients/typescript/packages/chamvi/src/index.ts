export { FencepostStore, InvalidRunStateError, RunNotFoundError } from "./store.js";
export type { FencepostStoreOptions } from "./store.js";
export type {
  Artifact, Checkpoint, IArtifactStore, ICheckpointStore, IEffectStore, IIdempotencyStore, ILockStore, IRunStore,
  IStateStore, IStepStore, IStore, Run, RunClaim, RunStatusLiteral, Step, TestClock,
} from "./types.js";
