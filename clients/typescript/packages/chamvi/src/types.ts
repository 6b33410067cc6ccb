// chamvi's store contract (IStore and its eight parts), as its documentation
// specifies it. The record types follow the shapes fencepost's engine store
// keeps (SPEC §11); they are structural, so an engine's own Run, Step,
// Checkpoint and Artifact objects with these fields can be passed as they are.

export type RunStatusLiteral = string;

export interface RunClaim {
  owner: string;
  expiresAt: Date;
}

export interface Run {
  id: string;
  agent: string;
  status: RunStatusLiteral;
  concurrencyKey?: string;
  input?: unknown;
  output?: unknown;
  error?: unknown;
  metadata?: unknown;
  /** Set by claimRun/renewClaim; read-only elsewhere. */
  claim?: RunClaim;
  /** Set by the store (the server's clock) on createRun. */
  createdAt?: Date;
  /** Set by the store on every write. */
  updatedAt?: Date;
}

export interface Step {
  runId: string;
  name: string;
  /** Position in the run's log, assigned by the store (1, 2, ...). */
  seq?: number;
  status?: string;
  input?: unknown;
  output?: unknown;
  error?: unknown;
  metadata?: unknown;
  createdAt?: Date;
}

export interface Checkpoint {
  runId: string;
  stepIndex: number;
  state: unknown;
  savedAt?: Date;
}

export interface Artifact {
  id: string;
  runId: string;
  name?: string;
  contentType?: string;
  /** Length in bytes (set by the store from the data). */
  size?: number;
  /** SHA-256 of the bytes, lowercase hex (set by the store). */
  sha256?: string;
  metadata?: unknown;
  createdAt?: Date;
}

export interface IRunStore {
  createRun(run: Run): Promise<boolean>;
  getRun(id: string): Promise<Run | undefined>;
  updateRun(id: string, patch: Partial<Run>, opts?: { expectStatus?: RunStatusLiteral[]; expectOwner?: string }): Promise<Run>;
  listRuns(q: {
    agent?: string;
    status?: RunStatusLiteral[];
    concurrencyKey?: string;
    limit?: number;
    offset?: number;
  }): Promise<{ data: Run[]; total: number }>;
  claimRun(id: string, owner: string, ttlMs: number): Promise<boolean>;
  renewClaim(id: string, owner: string, ttlMs: number): Promise<boolean>;
}

export interface IStepStore {
  appendStep(step: Step): Promise<void>;
  listSteps(runId: string): Promise<Step[]>;
}

export interface ICheckpointStore {
  saveCheckpoint(cp: Checkpoint): Promise<void>;
  latestCheckpoint(runId: string): Promise<Checkpoint | undefined>;
}

export interface IIdempotencyStore {
  claimKey(scope: string, key: string, runId: string, ttlMs: number): Promise<{ created: boolean; runId: string }>;
}

export interface ILockStore {
  acquire(key: string, owner: string, ttlMs: number): Promise<boolean>;
  release(key: string, owner: string): Promise<void>;
}

export interface IEffectStore {
  getEffect(key: string): Promise<{ result: unknown } | undefined>;
  putEffect(key: string, result: unknown): Promise<void>;
}

export interface IStateStore {
  kvGet(agent: string, key: string): Promise<unknown>;
  kvSet(agent: string, key: string, value: unknown): Promise<void>;
  docList(agent: string, coll: string, q?: { where?: Record<string, unknown>; limit?: number }): Promise<Array<{ id: string; doc: unknown }>>;
  docUpsert(agent: string, coll: string, id: string, doc: unknown): Promise<void>;
  docDelete(agent: string, coll: string, id: string): Promise<void>;
}

export interface IArtifactStore {
  putArtifact(artifact: Artifact, data: Uint8Array): Promise<boolean>;
  getArtifact(id: string): Promise<Artifact | undefined>;
  readArtifact(id: string): Promise<Uint8Array | undefined>;
  listArtifacts(runId: string): Promise<Artifact[]>;
}

export interface IStore extends IRunStore, IStepStore, ICheckpointStore, IIdempotencyStore, ILockStore, IEffectStore, IStateStore, IArtifactStore {}

/** A clock a test can move: `advance` moves the time every expiry decision uses. */
export interface TestClock {
  advance(ms: number): Promise<void>;
}
