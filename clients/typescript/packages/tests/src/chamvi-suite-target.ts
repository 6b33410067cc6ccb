// Runs the IStore contract suite against a small in-memory store with an
// injected clock, correct or with one flaw (STORE_FLAW), so that
// chamvi-suite.test.ts can check the suite passes a correct store and
// catches each flaw.
import { runStoreContractSuite } from "@fencepost/chamvi/contract";
import type { Artifact, Checkpoint, IStore, Run, Step } from "@fencepost/chamvi";

const flaw = process.env["STORE_FLAW"] ?? "none";
const copy = <T>(v: T): T => (flaw === "aliasing" || v === undefined ? v : structuredClone(v));
class Named extends Error { constructor(name: string, message: string) { super(message); this.name = name; } }

class MemoryStore implements IStore {
  now = Date.parse("2030-01-01T00:00:00.000Z");
  private runs = new Map<string, Run>();
  private steps = new Map<string, Step[]>();
  private checkpoints = new Map<string, Checkpoint>();
  private keys = new Map<string, { runId: string; expiresAt: number }>();
  private locks = new Map<string, { owner: string; expiresAt: number }>();
  private effects = new Map<string, unknown>();
  private kv = new Map<string, unknown>();
  private docs = new Map<string, Map<string, unknown>>();
  private artifacts = new Map<string, { meta: Artifact; data: Uint8Array }>();
  private seq = 0;
  private tick(): Date { return new Date(this.now + (this.seq++ % 2)); }

  async createRun(run: Run): Promise<boolean> {
    if (this.runs.has(run.id)) return false;
    const t = this.tick();
    this.runs.set(run.id, copy({ ...run, createdAt: t, updatedAt: t }));
    return true;
  }
  async getRun(id: string): Promise<Run | undefined> { return copy(this.runs.get(id)); }
  async updateRun(id: string, patch: Partial<Run>, opts: { expectStatus?: string[]; expectOwner?: string } = {}): Promise<Run> {
    const cur = this.runs.get(id);
    if (!cur) throw new Named("RunNotFoundError", id);
    if (opts.expectStatus?.length && !opts.expectStatus.includes(cur.status)) throw new Named("InvalidRunStateError", "status");
    if (opts.expectOwner !== undefined && cur.claim?.owner !== opts.expectOwner) throw new Named("InvalidRunStateError", "owner");
    const next: Run = { ...cur, updatedAt: this.tick() };
    for (const [k, v] of Object.entries(copy(patch))) {
      if (v === undefined) delete (next as unknown as Record<string, unknown>)[k];
      else (next as unknown as Record<string, unknown>)[k] = v;
    }
    this.runs.set(id, next);
    return copy(next);
  }
  async listRuns(q: { agent?: string; status?: string[]; concurrencyKey?: string; limit?: number; offset?: number }): Promise<{ data: Run[]; total: number }> {
    let all = [...this.runs.values()].filter((r) => (q.agent === undefined || r.agent === q.agent)
      && (!q.status?.length || q.status.includes(r.status)) && (q.concurrencyKey === undefined || r.concurrencyKey === q.concurrencyKey));
    if (flaw !== "list-unordered") all = all.sort((a, b) => a.createdAt!.getTime() - b.createdAt!.getTime() || (a.id < b.id ? -1 : 1));
    else all = all.reverse();
    const from = q.offset ?? 0;
    return { data: copy(all.slice(from, q.limit === undefined ? undefined : from + q.limit)), total: all.length };
  }
  async claimRun(id: string, owner: string, ttlMs: number): Promise<boolean> {
    const run = this.runs.get(id);
    if (!run) return false;
    if (run.claim && run.claim.expiresAt.getTime() > this.now && flaw !== "claim-ignores-expiry") return false;
    run.claim = { owner, expiresAt: new Date(this.now + ttlMs) };
    return true;
  }
  async renewClaim(id: string, owner: string, ttlMs: number): Promise<boolean> {
    const run = this.runs.get(id);
    if (!run?.claim || run.claim.owner !== owner || run.claim.expiresAt.getTime() <= this.now) return false;
    run.claim = { owner, expiresAt: new Date(this.now + ttlMs) };
    return true;
  }
  async appendStep(step: Step): Promise<void> {
    const list = this.steps.get(step.runId) ?? [];
    list.push(copy({ ...step, seq: list.length + 1 }));
    this.steps.set(step.runId, list);
  }
  async listSteps(runId: string): Promise<Step[]> { return copy(this.steps.get(runId) ?? []); }
  async saveCheckpoint(cp: Checkpoint): Promise<void> {
    const cur = this.checkpoints.get(cp.runId);
    if (!cur || cp.stepIndex >= cur.stepIndex) this.checkpoints.set(cp.runId, copy(cp));
  }
  async latestCheckpoint(runId: string): Promise<Checkpoint | undefined> { return copy(this.checkpoints.get(runId)); }
  async claimKey(scope: string, key: string, runId: string, ttlMs: number): Promise<{ created: boolean; runId: string }> {
    const k = JSON.stringify([scope, key]);
    const cur = this.keys.get(k);
    if (cur && cur.expiresAt > this.now) return { created: false, runId: cur.runId };
    this.keys.set(k, { runId, expiresAt: this.now + ttlMs });
    return { created: true, runId };
  }
  async acquire(key: string, owner: string, ttlMs: number): Promise<boolean> {
    const cur = this.locks.get(key);
    if (cur && cur.owner !== owner && cur.expiresAt > this.now) return false;
    this.locks.set(key, { owner, expiresAt: this.now + ttlMs });
    return true;
  }
  async release(key: string, owner: string): Promise<void> {
    if (this.locks.get(key)?.owner === owner) this.locks.delete(key);
  }
  async getEffect(key: string): Promise<{ result: unknown } | undefined> {
    return this.effects.has(key) ? { result: copy(this.effects.get(key)) } : undefined;
  }
  async putEffect(key: string, result: unknown): Promise<void> { this.effects.set(key, copy(result)); }
  async kvGet(agent: string, key: string): Promise<unknown> { return copy(this.kv.get(JSON.stringify([agent, key]))); }
  async kvSet(agent: string, key: string, value: unknown): Promise<void> { this.kv.set(JSON.stringify([agent, key]), copy(value)); }
  async docList(agent: string, coll: string, q: { where?: Record<string, unknown>; limit?: number } = {}): Promise<Array<{ id: string; doc: unknown }>> {
    const docs = this.docs.get(JSON.stringify([agent, coll])) ?? new Map();
    const match = (d: Record<string, unknown>) => Object.entries(q.where ?? {}).every(([k, v]) => JSON.stringify(d[k]) === JSON.stringify(v));
    const out = [...docs.entries()].sort(([a], [b]) => (a < b ? -1 : 1)).filter(([, d]) => match(d as Record<string, unknown>))
      .map(([id, doc]) => ({ id, doc: copy(doc) }));
    return out.slice(0, q.limit);
  }
  async docUpsert(agent: string, coll: string, id: string, doc: unknown): Promise<void> {
    const k = JSON.stringify([agent, coll]);
    if (!this.docs.has(k)) this.docs.set(k, new Map());
    this.docs.get(k)!.set(id, copy(doc));
  }
  async docDelete(agent: string, coll: string, id: string): Promise<void> { this.docs.get(JSON.stringify([agent, coll]))?.delete(id); }
  async putArtifact(artifact: Artifact, data: Uint8Array): Promise<boolean> {
    if (this.artifacts.has(artifact.id)) return false;
    this.artifacts.set(artifact.id, { meta: copy({ ...artifact, size: data.length, createdAt: this.tick() }), data: data.slice() });
    return true;
  }
  async getArtifact(id: string): Promise<Artifact | undefined> { return copy(this.artifacts.get(id)?.meta); }
  async readArtifact(id: string): Promise<Uint8Array | undefined> {
    const a = this.artifacts.get(id);
    if (!a) return undefined;
    return flaw === "artifact-buffer" ? (Buffer.from(a.data) as unknown as Uint8Array) : a.data.slice();
  }
  async listArtifacts(runId: string): Promise<Artifact[]> {
    return copy([...this.artifacts.values()].map((a) => a.meta).filter((m) => m.runId === runId)
      .sort((a, b) => a.createdAt!.getTime() - b.createdAt!.getTime() || (a.id < b.id ? -1 : 1)));
  }
}

runStoreContractSuite(`memory (${flaw})`, async () => {
  const store = new MemoryStore();
  return { store, clock: { advance: async (ms: number) => { store.now += ms; } } };
}, { manyRuns: 1200 });
